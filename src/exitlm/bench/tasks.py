"""Task-level speed vs quality of every decoding strategy (LayerSkip Table 3's shape, EE-LLM
Fig. 8-9): ``exitlm bench --task humaneval|docstrings``.

Two tasks, both offline:

* ``humaneval`` - HumanEval completions, quality = pass@1 (:mod:`exitlm.eval.humaneval`,
  executed in a limited subprocess);
* ``docstrings`` - continue a held-out standard-library docstring from its first line, quality
  = ROUGE-L F1 of the continuation (up to the closing quotes) against the real rest of the
  docstring (:mod:`exitlm.infer.rouge`). Held-out files are the ones the training corpus
  never sees (:mod:`exitlm.io.corpus`).

Each strategy decodes every prompt one at a time (per-sequence latency, as the papers measure
speed-ups), greedy, stopping at the task's stop strings or EOS. Reported per strategy: quality,
decode tokens/s, speed-up over AR measured in the same run, and agreement with AR's output.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from exitlm.bench.names import REPORT_FORMAT, out_files
from exitlm.bench.run import OURS, default_variants
from exitlm.config import ConfigError
from exitlm.eval import humaneval
from exitlm.infer.api import encode_prompts, generate
from exitlm.infer.rouge import rouge_l
from exitlm.io.corpus import DataConfig, is_held_out, list_sources
from exitlm.io.dirs import ensure_dir
from exitlm.paths import write_text_atomic

_DEF = re.compile(r"^(\s*)def \w+\(.*\).*:\s*$")


@dataclass
class Task:
    """Prompts, how generation stops, and how the outputs are scored: ``score(indices,
    texts)`` gives one number per output, ``texts[j]`` answering ``prompts[indices[j]]``; the
    task's quality is their mean."""

    name: str
    metric: str
    prompts: list[str]
    stop: tuple[str, ...]
    max_new_tokens: int
    score: Callable[[list[int], list[str]], list[float]]


def humaneval_task(limit: int | None) -> Task:
    """HumanEval problems; each completion scores 1 when it passes its tests."""

    items = humaneval.problems(limit)

    def score(indices: list[int], texts: list[str]) -> list[float]:
        res = humaneval.score([(items[i]["task_id"], t)
                               for i, t in zip(indices, texts, strict=True)])
        return [float(r["passed"]) for r in res.results]

    return Task("humaneval", "pass@1", [it["prompt"] for it in items], humaneval.STOP, 384,
                score)


def docstring_items(n: int, per_file: int = 8) -> list[tuple[str, str]]:
    """``(prompt, reference)`` pairs from held-out standard-library files: a signature with
    the first docstring line, and the rest of that docstring. Deterministic, at most
    ``per_file`` functions per file."""

    cfg = DataConfig()
    out: list[tuple[str, str]] = []
    for key, path in list_sources(cfg):
        if len(out) >= n:
            break
        if is_held_out(key, cfg.val_fraction, cfg.seed):
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            out += _docstrings(lines)[:per_file]
    if not out:
        raise ConfigError("no held-out standard-library docstrings found")
    return out[:n]


def _docstrings(lines: list[str]) -> list[tuple[str, str]]:
    """Functions with a docstring of 3-12 lines whose quotes open on a line of their own
    text: the signature + first line, and the rest up to the closing quotes."""
    found = []
    for i, line in enumerate(lines[:-2]):
        m = _DEF.match(line)
        opening = lines[i + 1].strip()
        one_line = opening.endswith('"""') and opening != '"""'
        if not m or not opening.startswith('"""') or one_line:
            continue
        end = next((j for j in range(i + 2, min(len(lines), i + 14)) if '"""' in lines[j]),
                   None)
        if end is None or end < i + 3:
            continue
        cut = len(m.group(1))  # dedent methods to the top level
        prompt = "\n".join(x[cut:] for x in lines[i : i + 2]) + "\n"
        reference = "\n".join(x[cut:] for x in lines[i + 2 : end + 1])
        reference = reference[: reference.index('"""')].rstrip()
        if len(prompt) <= 300 and 20 <= len(reference) <= 800:
            found.append((prompt, reference))
    return found


def docstring_task(limit: int | None) -> Task:
    """Docstring continuation scored by ROUGE-L F1 against the real docstring."""
    items = docstring_items(limit or 40)

    def score(indices: list[int], texts: list[str]) -> list[float]:
        return [rouge_l(t, items[i][1]).f for i, t in zip(indices, texts, strict=True)]

    return Task("docstrings", "rouge_l", [p for p, _ in items], ('"""',), 96, score)


TASKS = {"humaneval": humaneval_task, "docstrings": docstring_task}


def run_task(bench: Any, name: str, limit: int | None, out_dir: Path,
             max_new_tokens: int | None = None) -> dict[str, Any]:
    """Every configured strategy of ``bench`` (:class:`~exitlm.bench.run.Bench`) on task
    ``name``: quality, tokens/s, speed-up over AR; writes ``task_<name>.json`` (with every
    completion and its score) and a plot. ``max_new_tokens`` replaces the task's own budget."""

    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    task = TASKS[name](limit)
    if max_new_tokens is not None:
        task.max_new_tokens = max_new_tokens
    variants = {k: v for k, v in default_variants(bench).items() if v[0] in OURS}
    # a prompt's budget is clipped to the model's context; prompts that leave no room are
    # skipped (counted in the report): a small-context model still gets a table
    context = bench.model.config.max_seq_len
    lengths = [len(ids) for ids in encode_prompts(bench.tokenizer, task.prompts)]
    kept = [i for i, n in enumerate(lengths) if n < context]
    if not kept:
        raise ConfigError(f"no {name} prompt fits the model's context of {context} tokens")
    outputs: dict[str, list[str]] = {v: [] for v in variants}
    dec_tokens = dict.fromkeys(variants, 0)
    dec_s = dict.fromkeys(variants, 0.0)
    # every strategy on one prompt before the next prompt: a machine whose load drifts during
    # the run slows every strategy alike, so the speed-ups hold
    for i in tqdm(kept, desc=name, unit="prompt", file=sys.stderr, leave=False):
        budget = min(task.max_new_tokens, context - lengths[i])
        for vname, (strategy, opts) in variants.items():
            res = generate(bench.model, bench.tokenizer, task.prompts[i], strategy=strategy,
                           max_new_tokens=budget, stop_strings=task.stop, **opts)
            outputs[vname].append(res.text)
            dec_tokens[vname] += res.timings.decode_tokens
            dec_s[vname] += res.timings.decode_s
    scores = {vname: task.score(kept, texts) for vname, texts in outputs.items()}
    rows: dict[str, dict[str, Any]] = {}
    for vname, (strategy, opts) in variants.items():
        rows[vname] = {"strategy": strategy, "options": opts,
                       task.metric: sum(scores[vname]) / len(kept),
                       "decode_tokens_per_s": (dec_tokens[vname] / dec_s[vname]
                                               if dec_s[vname] else 0.0),
                       "decode_tokens": dec_tokens[vname]}
    base = rows["ar"]["decode_tokens_per_s"]
    for vname, row in rows.items():
        row["speedup_vs_ar"] = row["decode_tokens_per_s"] / base if base else 0.0
        row["same_output_as_ar"] = sum(a == b for a, b in zip(outputs[vname], outputs["ar"],
                                                              strict=True)) / len(kept)
    report = {"task": name, "metric": task.metric, "items": len(kept),
              "skipped_too_long": len(task.prompts) - len(kept),
              "max_new_tokens": task.max_new_tokens, "results": rows}
    completions = [{"prompt": task.prompts[i], **{v: {"text": outputs[v][j],
                                                      "score": scores[v][j]} for v in variants}}
                   for j, i in enumerate(kept)]
    _, completions_name, plot_name = out_files(name, None)
    path = ensure_dir(out_dir, "--out-dir") / completions_name
    write_text_atomic(path, json.dumps({"format": REPORT_FORMAT, **report,
                                        "completions": completions}, indent=2) + "\n")
    report["completions_file"] = str(path)
    report["plot"] = _plot(out_dir / plot_name, name, task.metric, rows)
    return report


def _plot(path: Path, name: str, metric: str, rows: dict[str, dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for vname, row in rows.items():
        ax.scatter(row["speedup_vs_ar"], row[metric])
        ax.annotate(vname, (row["speedup_vs_ar"], row[metric]), fontsize=8,
                    textcoords="offset points", xytext=(4, 4))
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.margins(x=0.15, y=0.1)  # room for the labels of the outermost points
    ax.set_xlabel("decode speed-up over autoregressive")
    ax.set_ylabel(metric)
    ax.set_title(f"{name}: quality vs speed-up per strategy\n(the shape of LayerSkip Table 3)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
