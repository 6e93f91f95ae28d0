"""The human-readable form of ``exitlm bench``'s report (``--json`` prints the JSON instead):
one aligned table per comparison, sweep or task, with the ratios that matter below it."""

from __future__ import annotations

from typing import Any

from exitlm.table import number, render


def _ratio(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"


def _frac(value: float | None) -> str:
    """A share in [0, 1] (ROUGE-L, acceptance) with two decimals; ``-`` when absent."""
    return "-" if value is None or value != value else f"{value:.2f}"


def _same(fraction: float | None) -> str:
    """Agreement with plain (autoregressive) decoding over the prompts: yes / no / a share."""
    if fraction is None:
        return "-"
    if fraction >= 1.0:
        return "yes"
    if fraction <= 0.0:
        return "no"
    return f"{round(100 * fraction)}%"


def _header(report: dict[str, Any]) -> str:
    cfg = report.get("config", {})
    model = report.get("model", cfg.get("model", "?"))
    return (f"exitlm bench: {model} ({report.get('num_layers', '?')} layers, "
            f"{cfg.get('dtype', '?')}), {report.get('prompts', '?')} prompts x "
            f"{cfg.get('max_new_tokens', '?')} new tokens, {report.get('threads', '?')} "
            f"thread(s)")


def _comparison(report: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in report["results"].items():
        rows.append([name, number(r["decode_tokens_per_s"]),
                     _ratio(r.get("decode_speedup_vs_ar")),
                     number(r["end_to_end_tokens_per_s"]),
                     _same(r.get("exact_match")), _frac(r.get("rouge_l")),
                     _frac(r.get("acceptance_rate")), number(r.get("mean_exit_layer"))])
    out = [render(["strategy", "decode tok/s", "vs ar", "end-to-end tok/s", "same as ar",
                   "ROUGE-L", "acceptance", "mean exit"], rows)]
    names = {"self_spec_over_hf_ee": "self-spec over hf-ee", "self_spec_over_ar":
             "self-spec over ar", "ar_over_hf": "ar over hf"}
    ratios = [f"{names.get(k, k)} {_ratio(v)}" for k, v in report.get("ratios", {}).items()]
    if ratios:
        out.append("decode speed-up: " + ", ".join(ratios))
    copied = report["results"].get("self-spec", {}).get("draft_weights")
    if copied not in (None, "model"):
        out.append(f"self-spec drafted through an {copied} copy of the model "
                   "(--draft-weights model: through the model itself)")
    ppd = report.get("ppd_theory")
    if ppd:
        out.append(f"ppd: p_correct {_frac(ppd['p_correct'])}, measured speed-up "
                   f"{_ratio(ppd['measured_speedup'])}, Theorem 4.1 predicts "
                   f"{_ratio(ppd['predicted_speedup'])}")
    if report.get("note"):
        out.append(f"note: {report['note']}")
    return out


def _sweep(sweep: dict[str, Any]) -> list[str]:
    rows = sweep["rows"]
    if rows and "threshold" in rows[0]:
        table = render(["threshold", "decode tok/s", "vs ar", "same as ar", "ROUGE-L",
                        "exited early"],
                       [[f"{r['threshold']:g}", number(r["decode_tokens_per_s"]),
                         _ratio(r["speedup"]), _same(r["exact_match"]), _frac(r["rouge_l"]),
                         f"{round(100 * r['early_exit_fraction'])}%"] for r in rows])
    else:
        table = render(["exit layer", "speculations", "decode tok/s", "vs ar", "acceptance",
                        "same as ar"],
                       [[str(r["exit_layer"]), str(r["num_speculations"]),
                         number(r["decode_tokens_per_s"]), _ratio(r["speedup"]),
                         _frac(r["acceptance_rate"]), _same(r["exact_match"])] for r in rows])
    out = [f"ar: {number(sweep['ar_decode_tokens_per_s'])} decode tok/s", table]
    ad = sweep.get("adaptive")
    if ad:
        out.append(f"adaptive self-spec: {number(ad['decode_tokens_per_s'])} tok/s, "
                   f"{_ratio(ad['speedup'])} vs ar, {_ratio(ad['over_best_static'])} vs the "
                   f"best static setting, same as ar: {_same(ad['exact_match'])}")
    top = sweep.get("best")
    if top and "threshold" in top and top["speedup"] > 1:
        t = f"{top['threshold']:g}"
        out.append(f"fastest threshold that kept plain decoding's output on all "
                   f"{top.get('prompts', 'the')} prompts: {t} ({_ratio(top['speedup'])} vs ar); "
                   "check it on more prompts, of text the model never saw (--prompts, "
                   "--num-prompts), before recording it as early exit's default in a copy of "
                   f"the model: exitlm convert MODEL OUT --threshold {t}")
    elif top and "threshold" not in top and top["speedup"] > 1 and top["exact_match"] == 1.0:
        e, d, w = top["exit_layer"], top["num_speculations"], top.get("draft_weights")
        w = "" if w in (None, "model") else f",{w}"
        out.append(f"fastest round: E={e}, d={d}{w and f', {w[1:]} drafts'} "
                   f"({_ratio(top['speedup'])} vs ar); record it in a copy of the model for "
                   f"self-spec to prefer: exitlm convert MODEL OUT --draft {e},{d}{w}")
    files = [f for f in (sweep.get("csv"), sweep.get("plot")) if f]
    if files:
        out.append("wrote " + ", ".join(files))
    return out


def _task(task: dict[str, Any]) -> list[str]:
    metric = task["metric"]
    rows = [[name, _frac(r[metric]), number(r["decode_tokens_per_s"]),
             _ratio(r["speedup_vs_ar"]), _same(r["same_output_as_ar"])]
            for name, r in task["results"].items()]
    out = [f"task {task['task']}: {task['items']} items"
           + (f" ({task['skipped_too_long']} skipped: too long for the context)"
              if task.get("skipped_too_long") else "")
           + f", up to {task['max_new_tokens']} new tokens",
           render(["strategy", metric, "decode tok/s", "vs ar", "same as ar"], rows)]
    files = [f for f in (task.get("completions_file"), task.get("plot")) if f]
    if files:
        out.append("wrote " + ", ".join(files))
    return out


def format_report(report: dict[str, Any], json_file: str | None = None) -> str:
    """The table(s) of a ``bench`` report (comparison, ``sweep`` or ``task``)."""
    lines = [_header(report)]
    if "task" in report:
        lines += _task(report["task"])
    elif "sweep" in report:
        lines += _sweep(report["sweep"])
    elif "results" in report:
        lines += _comparison(report)
    if json_file:
        lines.append(f"full report: {json_file} (or pass --json)")
    return "\n".join(lines)
