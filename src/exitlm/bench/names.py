"""The strategies ``exitlm bench`` compares, by name (no torch: the command's parser reads
them)."""

OURS = ("ar", "early-exit", "self-spec", "ppd")
"""exitlm's decoding strategies."""
THEIRS = ("hf", "hf-ee")
"""transformers' ``generate``: plain, and with LayerSkip's ``assistant_early_exit``."""

BUILTIN_PROMPTS = 8
"""Held-out standard-library prompts a bench runs when it is given no prompts file and no
count."""

REPORT_FORMAT = "exitlm-bench/1"
"""The ``format`` of every report ``exitlm bench`` writes: how it recognises its own files in
``--out-dir`` (it replaces those; anyone else's only with ``--overwrite``)."""

SWEEP_FILES = {"speculation": ("sweep_speculation.json", "sweep_self_spec.csv",
                               "sweep_self_spec.png"),
               "threshold": ("sweep_threshold.json", "sweep_thresholds.csv",
                             "sweep_thresholds.png")}
"""``--sweep KIND``: its report, CSV and plot in ``--out-dir``."""


def out_files(task: str | None, sweep: str | None) -> tuple[str, ...]:
    """The files one ``exitlm bench`` run writes into ``--out-dir``: the report first, then
    the files the report names (a task's completions and plot, a sweep's CSV and plot)."""
    if task is not None:
        return f"task_{task}_report.json", f"task_{task}.json", f"task_{task}.png"
    if sweep is not None:
        return SWEEP_FILES[sweep]
    return ("bench.json",)
