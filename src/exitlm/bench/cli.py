"""``exitlm bench``: decoding strategies against each other and against ``transformers``.

    exitlm bench                                   # default-ee, built-in code prompts, all
    exitlm bench --strategies ar,self-spec,hf-ee --exit-layer 20 --num-speculations 4
    exitlm bench --prompts prompts.jsonl --max-new-tokens 128 --repeats 2
    exitlm bench --sweep speculation --sweep-exits 12,16,20,24 --sweep-speculations 2,4,6
    exitlm bench --sweep threshold --sweep-thresholds 1,0.9,0.8,0.6,0.4
    exitlm bench --task humaneval --limit 40 --strategies ar,early-exit,self-spec
    exitlm bench --task docstrings --threshold 0.8

Prints a table of the results (``--json``: the full report as one JSON object instead); the
report is always written to ``--out-dir`` (``bench.json``, ``sweep_*.json`` or
``task_*_report.json``); sweeps also write a CSV and a PNG there. Files of those names that
exitlm bench did not write are not replaced (unless ``--overwrite``). See
:mod:`exitlm.bench.run` for what is measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exitlm.args import int_at_least, list_of, thread_count, unit_float
from exitlm.bench.names import BUILTIN_PROMPTS, OURS, REPORT_FORMAT, THEIRS, out_files
from exitlm.config import ConfigError
from exitlm.errors import ExitlmError
from exitlm.infer.flags import add_head_dtype_flag, add_strategy_flags, strategies_taking
from exitlm.infer.strategies import STRATEGIES
from exitlm.infer.strategy_options import MAX_SPECULATIONS
from exitlm.io.dirs import ensure_dir
from exitlm.paths import write_text_atomic

if TYPE_CHECKING:
    from exitlm.bench.run import BenchConfig

# --exit-layer is the draft exit of self-spec (and transformers' assistant_early_exit) in the
# benchmark, not early-exit's fixed exit; hf-ee mirrors self-spec's drafting options
_NOT_IN_BENCH = {"exit_layer": ("early-exit",)}
_HF_EE = ("exit_layer", "num_speculations", "draft_threshold")


def routes(name: str) -> tuple[str, ...]:
    """The benchmarked strategies a strategy flag configures."""
    targets = [s for s in strategies_taking(name) if s not in _NOT_IN_BENCH.get(name, ())]
    return (*targets, "hf-ee") if name in _HF_EE else tuple(targets)


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command to the ``exitlm`` parser."""
    p = subparsers.add_parser(
        "bench", help="benchmark decoding strategies (tokens/s, acceptance, agreement)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="default-ee",
                   help="model to benchmark (falls back to 'default' if default-ee is missing)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "int8", "int4"),
                   default="float32",
                   help="weights of the benchmarked model; int8/int4 are weight-only quantized "
                        "(the transformers baseline then runs the fp32 weights)")
    add_head_dtype_flag(p)
    p.add_argument("--strategies", default=",".join(OURS + THEIRS),
                   help=f"comma-separated subset of {list(OURS + THEIRS)} (hf = transformers "
                        "generate, hf-ee = transformers assistant_early_exit)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="JSONL prompts (strings or {\"prompt\": ...}); default: code-completion "
                        "prompts from held-out standard-library files")
    p.add_argument("--num-prompts", type=int_at_least(1), default=None,
                   help="prompts run: with --prompts, the file's first N (default: all of "
                        f"them); without, N held-out standard-library prompts (default "
                        f"{BUILTIN_PROMPTS})")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="tokens per prompt (default: 64; with --task, the task's own budget)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="runs per prompt and strategy; the fastest is kept")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads (1 is fastest for "
                   "batch-1 decoding on a shared CPU)")
    p.add_argument("--layerskip-exits", action="store_true",
                   help="exit through the final norm + head at every layer (LayerSkip; the "
                        "exits transformers' assistant_early_exit uses) instead of the "
                        "model's own exit heads")
    add_strategy_flags(p)
    p.add_argument("--sweep", choices=("speculation", "threshold"), default=None,
                   help="speculation: self-spec over exit layer x speculations (LayerSkip "
                        "Fig. 6); threshold: early exit over thresholds (EE-LLM Fig. 8)")
    p.add_argument("--sweep-exits", type=list_of(int_at_least(1), "exit layers"),
                   default=None, help="exit layers for --sweep speculation")
    p.add_argument("--sweep-speculations",
                   type=list_of(int_at_least(1, MAX_SPECULATIONS), "speculation counts"),
                   default=None, help="speculations for --sweep speculation (default: "
                                      f"{_listed(SWEEP_SPECULATIONS)})")
    p.add_argument("--sweep-thresholds", type=list_of(unit_float, "thresholds in [0, 1]"),
                   default=None, help=f"thresholds for --sweep threshold (default: "
                                      f"{_listed(SWEEP_THRESHOLDS)})")
    p.add_argument("--task", choices=("humaneval", "docstrings"), default=None,
                   help="task-level quality vs speed of every strategy: HumanEval pass@1 or "
                        "held-out docstring continuation ROUGE-L (LayerSkip Table 3)")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="items of --task (default: all 164 HumanEval problems / 40 docstrings)")
    p.add_argument("--out-dir", type=Path, default=Path("bench_out"),
                   help="where bench.json, CSVs and plots go")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files of the same names in --out-dir that exitlm bench did "
                        "not write (its own earlier results are replaced anyway)")
    p.add_argument("--json", action="store_true",
                   help="print the full JSON report instead of the table")
    p.set_defaults(func=run)


SWEEP_SPECULATIONS = (1, 2, 4, 6)
SWEEP_THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)

# the flags that only a mode reads: the mode's argparse dest and the value it must have
# (None: any)
_MODE_FLAGS = {"sweep_exits": ("sweep", "speculation"),
               "sweep_speculations": ("sweep", "speculation"),
               "sweep_thresholds": ("sweep", "threshold"),
               "limit": ("task", None)}


def _listed(values: tuple[object, ...]) -> str:
    return ",".join(str(v) for v in values)


def check_modes(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen mode would ignore: ``--task`` with ``--sweep``, a sweep's
    values without that sweep, ``--limit`` without ``--task``."""
    if args.task is not None and args.sweep is not None:
        raise ConfigError(f"--task {args.task} and --sweep {args.sweep} are separate runs; "
                          "pass one of them")
    for dest, (mode, wanted) in _MODE_FLAGS.items():
        if getattr(args, dest, None) is None:
            continue
        chosen = getattr(args, mode)
        if chosen is None or (wanted is not None and chosen != wanted):
            needs = f"--{mode}" if wanted is None else f"--{mode} {wanted}"
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} applies to {needs} only; it would be ignored",
                              hint=f"add {needs} or leave out {flag}")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from exitlm.bench.run import BenchConfig  # lazy: the parser imports no torch

    check_modes(args)
    strategies = tuple(dict.fromkeys(s.strip() for s in args.strategies.split(",")
                                     if s.strip()))
    if not strategies:
        raise ConfigError(f"--strategies: expected a comma-separated subset of "
                          f"{list(OURS + THEIRS)}, got {args.strategies!r}")
    options: dict[str, dict[str, Any]] = {}
    names = {f for s in STRATEGIES.values() for f in s.options_type.__dataclass_fields__}
    for name in sorted(names):
        value = getattr(args, name, None)
        if value is None:
            continue
        for t in routes(name):
            options.setdefault(t, {})[name] = value
    return BenchConfig(
        model=args.model, dtype=args.dtype, head_dtype=args.head_dtype, strategies=strategies,
        prompts_file=args.prompts,
        num_prompts=args.num_prompts,  # None: the whole file, or BUILTIN_PROMPTS of ours
        max_new_tokens=args.max_new_tokens or 64,
        repeats=args.repeats, threads=args.threads,
        layerskip_exits=args.layerskip_exits, options=options,
    )


def bench_report(path: Path) -> dict[str, Any] | None:
    """The report in ``path`` when exitlm bench wrote it (a JSON object whose ``format`` is
    :data:`~exitlm.bench.names.REPORT_FORMAT`), else None (missing, unreadable, not JSON,
    someone else's)."""
    from exitlm.io.st import read_json  # lazy: the parser imports no torch

    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except ExitlmError:
        return None
    return data if isinstance(data, dict) and data.get("format") == REPORT_FORMAT else None


def _named_files(report: dict[str, Any]) -> set[str]:
    """The names of the files a report says its run wrote (a task's completions and plot, a
    sweep's CSV and plot)."""
    names = set()
    for section in ("task", "sweep"):
        part = report.get(section)
        if isinstance(part, dict):
            names.update(Path(v).name for k, v in part.items()
                         if k in ("completions_file", "csv", "plot") and isinstance(v, str))
    return names


def check_out_files(out_dir: Path, files: tuple[str, ...], overwrite: bool) -> None:
    """Refuse to replace a file of ``files`` (the report first, then the files it names) in
    ``out_dir`` that exitlm bench did not write: exitlm's are the report with its ``format``
    and the files that report names; ``overwrite`` accepts any file (never a directory)."""
    report = bench_report(out_dir / files[0])
    ours = set() if report is None else {files[0], *_named_files(report)}
    present = [n for n in files if (out_dir / n).exists() or (out_dir / n).is_symlink()]
    for name in present:
        if not (out_dir / name).is_file():
            raise ConfigError(f"--out-dir {out_dir}: {name} is not a file; exitlm bench "
                              "writes its results under that name",
                              hint="move it away or choose another --out-dir")
    foreign = [n for n in present if n not in ours]
    if foreign and not overwrite:
        raise ConfigError(
            f"--out-dir {out_dir}: {', '.join(foreign)} not written by exitlm bench; "
            "refusing to replace", hint="choose another --out-dir, move the files away, or "
                                        "pass --overwrite to replace them")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm bench``; returns the exit status (bad input raises an
    :class:`~exitlm.errors.ExitlmError`)."""
    # lazy: the parser imports no torch
    from exitlm.bench.run import Bench, describe, run_comparison, sweep_self_spec, sweep_thresholds

    cfg = config_from_args(args)
    out_dir: Path = ensure_dir(args.out_dir, "--out-dir")
    files = out_files(args.task, args.sweep)
    check_out_files(out_dir, files, args.overwrite)  # before the (slow) benchmark
    bench = Bench(cfg)
    report: dict[str, Any] = {"format": REPORT_FORMAT, **describe(bench)}
    if args.task is not None:
        from exitlm.bench.tasks import run_task  # lazy: loaded when the command runs

        report["task"] = run_task(bench, args.task, args.limit, out_dir, args.max_new_tokens)
    elif args.sweep == "speculation":
        ecfg = bench.model.config.exits
        exits = (args.sweep_exits if args.sweep_exits
                 else list(ecfg.layers) if ecfg.layers and not ecfg.every_layer
                 else sorted({max(1, bench.model.num_layers * k // 8) for k in (2, 3, 4, 5, 6)}))
        specs = args.sweep_speculations or list(SWEEP_SPECULATIONS)
        report["sweep"] = sweep_self_spec(bench, list(exits), specs, out_dir)
    elif args.sweep == "threshold":
        thresholds = args.sweep_thresholds or list(SWEEP_THRESHOLDS)
        report["sweep"] = sweep_thresholds(bench, thresholds, out_dir)
    else:
        report.update(run_comparison(bench))
    text = json.dumps(report, indent=2, ensure_ascii=False)
    name = files[0]
    check_out_files(out_dir, (name,), args.overwrite)  # it may have appeared while we ran
    write_text_atomic(out_dir / name, text + "\n")
    if args.json:
        print(text)
    else:
        from exitlm.bench.report import format_report  # lazy: the parser imports no torch

        print(format_report(report, str(out_dir / name)))
    return 0
