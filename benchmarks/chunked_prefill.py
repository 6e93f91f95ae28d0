"""A long prompt arriving while other requests decode: whole prefill against prefill in parts.

The engine prefills a new request's prompt before its next decoding step, so a long prompt
holds every running stream for its whole prefill. With ``prefill_chunk`` (``exitlm serve
--prefill-chunk``) it is prefilled in parts of at most that many positions, one part per step,
the other streams decoding in between (vLLM's chunked prefill, Sarathi-Serve). This script
runs, on one engine per setting and in the same process, alternating the settings pass by
pass:

* ``--streams`` short requests (held-out standard-library prompts) start decoding;
* after each has produced ``--warm`` tokens, a long request arrives: ``--long`` tokens of a
  held-out standard-library source file, ``--long-new`` tokens to generate;
* everything runs to the end.

Reported per setting (``whole``, then each part size), the median over ``--passes`` passes:
the running streams' longest gap between two tokens after the long prompt arrived (the
stall) and their p50 gap, the long request's time to first token, the tokens the running
streams produced in between (all streams together), and whether the long request's tokens
equal the whole prefill's. One thread (``--threads``), greedy AR.

    python benchmarks/chunked_prefill.py                       # default model, 1024 tokens
    python benchmarks/chunked_prefill.py --dtype int8 --chunks 128,256,512
    python benchmarks/chunked_prefill.py --quick               # a smoke test

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

import torch

from _bench import (
    ByteIds,
    held_out_prompt_ids,
    long_prompt_ids,
    machine,
    note,
    one_line_errors,
    percentile,
)
from exitlm.args import int_at_least, int_list
from exitlm.infer import Engine, SamplingOptions
from exitlm.io import load_model


def _one_pass(model: Any, tokenizer: Any, chunk: int | None, shorts: list[list[int]],
              long: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One engine, the scenario of the module docstring; times from the engine's steps."""
    engine = Engine(model, tokenizer, "ar", max_batch=len(shorts) + 1, threads=args.threads,
                    prefill_chunk=chunk)
    times: dict[int, list[float]] = {}
    short = SamplingOptions(max_new_tokens=args.short_new, ignore_eos=True)
    reqs = [engine.submit(p, short) for p in shorts]
    for r in reqs:
        times[r.id] = []
    late = None
    arrived = 0.0
    try:
        while engine.has_work():
            for u in engine.step():
                if u.request.id in times and u.token_ids:
                    times[u.request.id].extend([time.perf_counter()] * len(u.token_ids))
            if late is None and all(len(times[r.id]) >= args.warm for r in reqs):
                arrived = time.perf_counter()
                late = engine.submit(long, SamplingOptions(max_new_tokens=args.long_new,
                                                           ignore_eos=True))
    finally:
        engine.close()
    assert late is not None, "the short requests ended before the long one arrived"
    gaps = []  # between successive tokens of a short request, the later one after the arrival
    for r in reqs:
        ts = times[r.id]
        gaps += [b - a for a, b in itertools.pairwise(ts) if b > a and b >= arrived]
    if args.debug:
        note(f"gaps {[round(g, 3) for g in gaps]}")
    during = sum(arrived <= t < late.t_first for r in reqs for t in times[r.id])
    return {"max_gap_s": max(gaps), "p50_gap_s": percentile(gaps, 0.5),
            "long_ttft_s": late.t_first - arrived, "tokens_while_it_filled": during,
            "long_tokens": list(late.token_ids)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", help="float32, float16, int8, int4, ...")
    p.add_argument("--chunks", type=int_list, default=[128, 256, 512],
                   help="part sizes compared with the whole prefill")
    p.add_argument("--long", type=int_at_least(2), default=1024, help="tokens of the long prompt")
    p.add_argument("--long-new", type=int_at_least(1), default=8)
    p.add_argument("--streams", type=int_at_least(1), default=2)
    p.add_argument("--short-new", type=int_at_least(2), default=160)
    p.add_argument("--warm", type=int_at_least(1), default=8)
    p.add_argument("--passes", type=int_at_least(1), default=3)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--debug", action="store_true", help="print every pass's gaps")
    p.add_argument("--quick", action="store_true", help="a smoke test: short prompt, one pass")
    args = p.parse_args()
    if args.quick:
        args.long, args.chunks, args.passes, args.short_new = 96, [32], 1, 40
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    context = model.config.max_seq_len
    encoder = tokenizer if tokenizer is not None else ByteIds(model.config.vocab_size)
    if args.long + args.long_new > context:
        raise SystemExit(f"chunked_prefill: --long {args.long} + --long-new {args.long_new} "
                         f"exceeds the model's context ({context})")
    shorts = held_out_prompt_ids(encoder, args.streams, context, args.short_new, keep=32)
    long = long_prompt_ids(encoder, args.long, "chunked_prefill")
    settings: list[int | None] = [None, *args.chunks]
    runs: dict[str, list[dict[str, Any]]] = {}
    for k in range(args.passes):
        order = settings if k % 2 == 0 else settings[::-1]
        for chunk in order:
            name = "whole" if chunk is None else str(chunk)
            note(f"pass {k + 1}/{args.passes}: {name}")
            runs.setdefault(name, []).append(_one_pass(model, tokenizer, chunk, shorts, long,
                                                       args))
    whole_tokens = runs["whole"][0]["long_tokens"]
    report: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype,
        "long_prompt_tokens": args.long, "streams": args.streams, "threads": args.threads,
        "passes": args.passes, "settings": {},
    }
    for name, rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs)
               for key in ("max_gap_s", "p50_gap_s", "long_ttft_s", "tokens_while_it_filled")}
        report["settings"][name] = {
            **{key: round(v, 4) for key, v in med.items()},
            "long_tokens_equal_whole": all(r["long_tokens"] == whole_tokens for r in rs),
        }
    base = report["settings"]["whole"]["max_gap_s"]
    for s in report["settings"].values():
        s["stall_vs_whole"] = round(s["max_gap_s"] / base, 3)
    report["machine"] = machine()
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    with one_line_errors("chunked_prefill"):
        sys.exit(main())
