"""Early exit across processes on this CPU (the shape of EE-LLM Fig. 10): per-token decoding
latency of pipeline-based early-exit inference (``--stages`` processes, EE-LLM Sec. 4), KV
recomputation (one process) and tensor-parallel KV recomputation (``--tp`` processes) over
confidence thresholds, batch 1, one thread per process, greedy, on a LayerSkip-trained model.
Plain autoregressive decoding (one process) is the baseline; ``ar_tp`` is plain decoding over
the ``--tp`` processes. Prints one JSON object; progress
goes to stderr.

    python benchmarks/dist_decode.py --model runs/scratch-layerskip/model
    python benchmarks/dist_decode.py --model default-ee --exit-layers 12
    python benchmarks/dist_decode.py --quick          # 2 prompts, 16 tokens, 2 thresholds

A model directory that does not exist is skipped (a JSON object saying so, exit status 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from _bench import held_out_prompt_ids, note, one_line_errors
from exitlm.infer import generate
from exitlm.infer.cli import load_for_strategy, tokenizer_for
from exitlm.infer.executors.pipeline import PipelineExecutor
from exitlm.infer.executors.tp import TPExecutor
from exitlm.infer.result import GenerationResult
from exitlm.runtime import prepare


def _summary(results: list[GenerationResult], ref: list[GenerationResult] | None
             ) -> dict[str, Any]:
    decode_s = sum(r.timings.decode_s for r in results)
    tokens = sum(r.timings.decode_tokens for r in results)
    layers = [x for r in results for s in r.sequences for x in s.exit_layers]
    n = results[0].num_layers
    out: dict[str, Any] = {
        "ms_per_token": round(1e3 * decode_s / max(1, tokens), 3),
        "tokens_per_s": round(tokens / decode_s, 1) if decode_s else None,
        "early_exit_fraction": round(sum(x < n for x in layers) / max(1, len(layers)), 3),
    }
    if ref is not None:
        same = [a.sequences[0].token_ids == b.sequences[0].token_ids
                for a, b in zip(results, ref, strict=True)]
        out["same_tokens_as_recompute"] = f"{sum(same)}/{len(same)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/scratch-layerskip/model")
    ap.add_argument("--thresholds", default="0.6,0.8,0.9,1.0")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--exit-layers", default=None,
                    help="checked exits, e.g. 4 (default: the model's, or 1/4, 1/2, 3/4 depth)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of all methods in turn; each cell reports its best round")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny budgets")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: expected 1 or more rounds")
    if a.quick:
        a.prompts, a.max_new_tokens, a.thresholds, a.repeats = 2, 16, "0.8,1.0", 1
    if ("/" in a.model or a.model.startswith(".")) and not Path(a.model).is_dir():
        print(json.dumps({"skipped": f"no model directory at {a.model!r} (train one with "
                                     "'exitlm train --config scratch-layerskip')"}))
        return
    torch.set_num_threads(a.threads)
    thresholds = [float(x) for x in a.thresholds.split(",")]
    loaded = load_for_strategy(a.model, torch.float32, "early-exit")
    model = loaded.model.eval()
    tok = tokenizer_for(loaded, a.model)
    prompts = held_out_prompt_ids(tok, a.prompts, model.config.max_seq_len, a.max_new_tokens)
    base: dict[str, Any] = {"max_new_tokens": a.max_new_tokens, "ignore_eos": True}
    exits = {} if a.exit_layers is None else {
        "exit_layers": tuple(int(x) for x in a.exit_layers.split(","))}

    def calls(thr: float, **kw: Any) -> list[dict[str, Any]]:
        return [{"prompts": [p], "strategy": "early-exit", "threshold": thr, **base, **exits,
                 **kw} for p in prompts]

    report: dict[str, Any] = {
        "torch": torch.__version__, "machine": platform.machine(), "model": a.model,
        "num_layers": model.num_layers, "config": vars(a), "results": [],
    }
    warm = {"prompts": [prompts[0]], "strategy": "early-exit", "threshold": 1.0,
            "max_new_tokens": 8, "ignore_eos": True, **exits}
    runs: dict[tuple[str, float], list[list[GenerationResult]]] = {}

    def keep(method: str, thr: float, got: list[GenerationResult]) -> None:
        runs.setdefault((method, thr), []).append(got)
        note(f"[dist_decode] {method} @ {thr}: {_summary(got, None)['ms_per_token']} ms/token")

    # the methods take turns, round after round (the machine's load drifts over minutes);
    # each cell reports its best round
    t0 = time.perf_counter()
    with torch.inference_mode():
        for rnd in range(a.repeats):
            note(f"[dist_decode] round {rnd + 1} of {a.repeats} ({time.perf_counter() - t0:.0f} s)")
            generate(model, None, threads=a.threads, **warm)
            keep("ar", 1.0, [generate(model, None, [p], strategy="ar", threads=a.threads,
                                      **base) for p in prompts])
            for thr in thresholds:
                keep("recompute", thr, [generate(model, None, threads=a.threads, **c)
                                        for c in calls(thr)])
            with PipelineExecutor(prepare(model), a.stages, threads=a.threads) as pipe:
                generate(pipe, None, threads=a.threads, kv="pipeline", **warm)
                for thr in thresholds:
                    keep("pipeline", thr, [generate(pipe, None, threads=a.threads, **c)
                                           for c in calls(thr, kv="pipeline")])
            ar_calls = [{"prompts": [p], "strategy": "ar", **base} for p in prompts]
            every = [warm] + ar_calls + [c for thr in thresholds for c in calls(thr)]
            with TPExecutor(model, a.tp, threads=a.threads) as ranks:
                got_all = [generate(ranks, None, threads=a.threads, **c) for c in every][1:]
            keep("ar_tp", 1.0, got_all[: len(prompts)])
            got_all = got_all[len(prompts):]
            for i, thr in enumerate(thresholds):
                keep("tp", thr, got_all[i * len(prompts):(i + 1) * len(prompts)])

    def best(method: str, thr: float, ref: list[GenerationResult] | None) -> dict[str, Any]:
        cell = runs[(method, thr)]
        rows = [_summary(got, ref) for got in cell]
        out = min(rows, key=lambda r: r["ms_per_token"])
        return {**out, "ms_per_token_rounds": [r["ms_per_token"] for r in rows]}

    ref = {thr: runs[("recompute", thr)][0] for thr in thresholds}
    report["ar"] = best("ar", 1.0, None)
    report["ar_tp"] = {"processes": a.tp, **best("ar_tp", 1.0, runs[("ar", 1.0)][0])}
    report["ar_tp"]["same_tokens_as_ar"] = report["ar_tp"].pop("same_tokens_as_recompute")
    for method, procs in (("recompute", 1), ("pipeline", a.stages), ("tp", a.tp)):
        for thr in thresholds:
            report["results"].append({"method": method, "processes": procs, "threshold": thr,
                                      **best(method, thr, None if method == "recompute"
                                             else ref[thr])})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    with one_line_errors("dist_decode"):
        main()
