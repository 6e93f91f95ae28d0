"""Continuous batching vs one request at a time, and decoding on a busy machine.

**Throughput.** N requests with mixed prompt and output lengths go through the engine
(``--max-batch``, default 8) and, in the same run, through an engine holding one sequence at a
time (requests queue, first come first served) - the baseline. Two arrival patterns: all at
once, and staggered (request ``i`` arrives ``i * --gap`` seconds after the start). Reported per
side: total generated tokens / wall time, time to first token (from arrival) p50/p99, and
per-token latency (the gaps between a request's successive tokens) p50/p99; and the ratio of
the throughputs. Run on the default model (fp32, greedy AR) and, with ``--ee-model``, on a
LayerSkip-trained model with self-speculative decoding.

**Busy machine** (``--busy``): batch-1 decoding speed with the measuring thread policy
(:class:`exitlm.infer.threads.ThreadPolicy`) vs a fixed count of all cores (exitlm's behaviour
before the policy) vs one thread, each on a quiet machine and with another process spinning
on one core, all in one run.

Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/engine_throughput.py                      # default model, 8 requests
    python benchmarks/engine_throughput.py --ee-model runs/scratch-layerskip/model --busy
    python benchmarks/engine_throughput.py --quick              # a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from _bench import note, percentile
from exitlm.infer import Engine, SamplingOptions, generate, get_strategy
from exitlm.io import load_model

TEXTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "import os\nimport sys\n\ndef main(argv):\n    \"\"\"Parse the arguments and",
    "Q: What is the boiling point of water at sea level?\nA:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
    "The three primary colours are",
    "# Sort a list of dictionaries by a key\nrecords = [{'name': 'b', 'age': 3}, {'name': 'a',",
]




@dataclass
class _Trace:
    """When each of a request's tokens arrived."""

    arrival: float
    times: list[float] = field(default_factory=list)


def serve(model: Any, tok: Any, strategy: str, options: Any, prompts: list[list[int]],
          budgets: list[int], max_batch: int, gap: float, threads: int | None) -> dict:
    """Submit every request at its arrival time, step until all are done, measure."""
    engine = Engine(model, tok, strategy, options, max_batch=max_batch, threads=threads)
    traces: list[_Trace] = []
    start = time.perf_counter()
    pending = list(range(len(prompts)))
    while pending or engine.has_work():
        now = time.perf_counter()
        while pending and start + pending[0] * gap <= now:
            i = pending.pop(0)
            trace = _Trace(start + i * gap)
            traces.append(trace)

            def record(update: Any, trace: _Trace = trace) -> None:
                t = time.perf_counter()
                trace.times.extend([t] * len(update.token_ids))

            engine.submit(prompts[i], SamplingOptions(max_new_tokens=budgets[i],
                                                      ignore_eos=True), on_update=record)
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(max(0.0, start + pending[0] * gap - time.perf_counter()))
    wall = time.perf_counter() - start
    engine.close()
    tokens = sum(len(t.times) for t in traces)
    ttft = [t.times[0] - t.arrival for t in traces]
    itl = [b - a for t in traces for a, b in zip(t.times, t.times[1:], strict=False)]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "token_latency_p50_s": percentile(itl, 0.5),
            "token_latency_p99_s": percentile(itl, 0.99),
            "threads_used": engine.threads.current}


def throughput(model: Any, tok: Any, strategy: str, options: Any, n: int, max_batch: int,
               budget: int, gap: float, threads: int | None) -> dict:
    """Engine vs one at a time, all at once and staggered (same requests, same run)."""
    prompts = [tok.encode(TEXTS[i % len(TEXTS)]) for i in range(n)]
    budgets = [budget // 2 + (i * 7) % (budget // 2 + 1) for i in range(n)]  # mixed lengths
    generate(model, tok, prompts[0], max_new_tokens=4, strategy=strategy, options=options)
    out: dict[str, Any] = {"requests": n, "prompt_tokens": [len(p) for p in prompts],
                           "max_new_tokens": budgets}
    for name, g in (("all_at_once", 0.0), ("staggered", gap)):
        note(f"engine_throughput: {strategy} {name}: batched ...")
        batched = serve(model, tok, strategy, options, prompts, budgets, max_batch, g, threads)
        note(f"engine_throughput: {strategy} {name}: one at a time ...")
        single = serve(model, tok, strategy, options, prompts, budgets, 1, g, threads)
        out[name] = {"engine": batched, "one_at_a_time": single,
                     "throughput_ratio": batched["tokens_per_s"] / single["tokens_per_s"]}
    return out


def _decode_speed(model: Any, tok: Any, threads: int | None, new: int) -> float:
    ids = tok.encode(TEXTS[0])
    res = generate(model, tok, ids, max_new_tokens=new, ignore_eos=True, threads=threads)
    return res.timings.decode_tokens_per_s


def busy(model: Any, tok: Any, new: int) -> dict:
    """Batch-1 decode tokens/s per thread setting, quiet and next to a spinning process."""
    cores = torch.get_num_threads()
    settings = {"policy": None, f"fixed_{cores}": cores, "fixed_1": 1}
    out: dict[str, Any] = {"cores": cores}
    for load in ("quiet", "busy"):
        spinner = None
        if load == "busy":
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            _decode_speed(model, tok, 1, 4)
            out[load] = {}
            for name, n in settings.items():
                note(f"engine_throughput: {load} machine, threads {name} ...")
                out[load][name] = max(_decode_speed(model, tok, n, new) for _ in range(2))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    for load in ("quiet", "busy"):
        best = max(out[load].values())
        out[load]["policy_vs_best"] = out[load]["policy"] / best
    out["busy_policy_over_fixed_all"] = out["busy"]["policy"] / out["busy"][f"fixed_{cores}"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--ee-model", default=None,
                    help="a LayerSkip-trained model for the self-spec scenario")
    ap.add_argument("--exit-layer", type=int, default=None, help="self-spec draft exit")
    ap.add_argument("--num-speculations", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="the longest budget; budgets are mixed between half and this")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between staggered arrivals")
    ap.add_argument("--threads", type=int, default=None,
                    help="fixed threads for the throughput runs (default: the policy)")
    ap.add_argument("--busy", action="store_true", help="also measure on a busy machine")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny budgets")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.max_new_tokens, a.gap = 3, 6, 0.05
    report: dict[str, Any] = {"torch": torch.__version__, "machine": platform.machine(),
                              "threads": torch.get_num_threads(), "config": vars(a)}
    lm = load_model(a.model)
    report["default_model"] = throughput(lm.model, lm.tokenizer, "ar", None, a.requests,
                                         a.max_batch, a.max_new_tokens, a.gap, a.threads)
    if a.busy:
        report["busy_machine"] = busy(lm.model, lm.tokenizer, 16 if a.quick else 48)
    if a.ee_model:
        ee = load_model(a.ee_model)
        from exitlm.infer.cli import byte_level_tokenizer

        tok = ee.tokenizer or byte_level_tokenizer()
        opts = get_strategy("self-spec").options(exit_layer=a.exit_layer,
                                                 num_speculations=a.num_speculations)
        report["layerskip_self_spec"] = throughput(
            ee.model, tok, "self-spec", opts, a.requests, a.max_batch, 2 * a.max_new_tokens,
            a.gap / 4, a.threads)
        report["layerskip_self_spec"]["model"] = a.ee_model
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
