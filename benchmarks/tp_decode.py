"""Tensor-parallel decoding against one process, per weight format, on this CPU: greedy
plain decoding (batch 1) of the same prompts with ``--tp T`` processes (one thread each,
shared-memory sums), in one process with one thread and in one process with T threads (the
same cores used the other way), interleaved run by run so that load drifting during the run
hits all alike. Reports decode tokens/s of each, TP's ratio to one thread
(``ratio_of_medians``) and to the better one-process setting
(``ratio_vs_best_one_process``), and
whether the tokens are the same (fp32 sums in another order can part greedy tokens at near
ties; int8 activations and bf16 make that likelier, see docs/guide/generation.md
"Early exit across processes"). Prints one JSON object; progress goes to stderr.

    python benchmarks/tp_decode.py                           # default model, 4 dtypes, TP=2
    python benchmarks/tp_decode.py --dtypes float32,int8 --repeats 3
    python benchmarks/tp_decode.py --model runs/scratch-layerskip/model --dtypes float32
    python benchmarks/tp_decode.py --quick                   # one prompt, 8 tokens, 1 run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from _bench import held_out_prompt_ids, note, one_line_errors
from exitlm.infer import generate
from exitlm.infer.cli import DTYPES, load_for_strategy, tokenizer_for
from exitlm.infer.executors.tp import TPExecutor


def _rate(results: list[Any]) -> float:
    return sum(r.timings.decode_tokens for r in results) / sum(r.timings.decode_s
                                                               for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", default="float32,float16,int8,int4")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each side")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny budgets")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: expected 1 or more runs")
    if a.quick:
        a.prompts, a.max_new_tokens, a.repeats = 1, 8, 1
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"--dtypes: unknown {bad}; choose from {sorted(DTYPES)}")
    torch.set_num_threads(1)
    report: dict[str, Any] = {"torch": torch.__version__, "machine": platform.machine(),
                              "model": a.model, "config": vars(a), "results": []}
    for dtype in dtypes:
        loaded = load_for_strategy(a.model, DTYPES[dtype], "ar")
        model = loaded.model.eval()
        tok = tokenizer_for(loaded, a.model)
        prompts = held_out_prompt_ids(tok, a.prompts, model.config.max_seq_len,
                                      a.max_new_tokens)
        calls = [{"prompts": [p], "max_new_tokens": a.max_new_tokens, "ignore_eos": True}
                 for p in prompts]
        one: list[float] = []
        threaded: list[float] = []
        many: list[float] = []
        same = True
        t0 = time.perf_counter()
        with torch.inference_mode():
            generate(model, None, [prompts[0]], max_new_tokens=4, threads=1)  # warm-up
            for _ in range(a.repeats):
                ref = [generate(model, None, threads=1, **c) for c in calls]
                one.append(_rate(ref))
                threaded.append(_rate([generate(model, None, threads=a.tp, **c)
                                       for c in calls]))
                with TPExecutor(model, a.tp, threads=1) as ranks:
                    got = [generate(ranks, None, threads=1, **c) for c in calls]
                many.append(_rate(got))
                same = same and all(x.sequences[0].token_ids == y.sequences[0].token_ids
                                    for x, y in zip(ref, got, strict=True))
        best_one = max(statistics.median(one), statistics.median(threaded))
        row = {"dtype": dtype, "one_process_tokens_per_s": [round(x, 1) for x in one],
               f"one_process_{a.tp}_threads_tokens_per_s": [round(x, 1) for x in threaded],
               f"tp{a.tp}_tokens_per_s": [round(x, 1) for x in many],
               "ratio_of_medians": round(statistics.median(many) / statistics.median(one), 2),
               "ratio_vs_best_one_process": round(statistics.median(many) / best_one, 2),
               "same_tokens": same}
        report["results"].append(row)
        note(f"[tp_decode] {dtype}: one process {row['one_process_tokens_per_s']} (with "
             f"{a.tp} threads {row[f'one_process_{a.tp}_threads_tokens_per_s']}), TP={a.tp} "
             f"{row[f'tp{a.tp}_tokens_per_s']} tok/s, same tokens: {same} "
             f"({time.perf_counter() - t0:.0f} s)")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    with one_line_errors("tp_decode"):
        main()
