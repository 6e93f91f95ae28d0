"""``n`` choices of one prompt: the prompt prefilled once for all of them, or once per choice.

A request for ``n`` choices (the server's ``n``) becomes ``n`` engine requests with one prompt.
The engine prefills that prompt once - every position but the last in one row, copied into the
others, each choice prefilling its last position with its own sampling
(:func:`exitlm.infer.prefill_plan.plan_prefill`) - or, with ``share_prompts=False`` (the baseline),
once per choice, the ``n`` rows as one padded batch. This script times, in one process and
alternating the settings pass by pass, the time until every choice has its first token for
``n`` = 1 and each ``--choices``, whole prefill and prefill in parts (``--chunk``); and checks
that each choice's tokens are the same either way (seeded sampling, temperature 0.8).

``shared_start``: a request decodes whose prompt is ``--prompt-len - --tail`` tokens of a
shared start (a system prompt) and a tail; then ``max(--choices)`` requests arrive with the
same start and tails of their own. Shared, they copy the start from its row and prefill only
their tails; the time until all have a first token is compared with unshared (greedy).

    python benchmarks/shared_prefill.py                  # default model, a 512-token prompt
    python benchmarks/shared_prefill.py --quick          # a smoke test

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from _bench import ByteIds, long_prompt_ids, machine, note, one_line_errors
from exitlm.args import int_at_least, list_of
from exitlm.infer import Engine, SamplingOptions
from exitlm.io import load_model

RUNNING_EXTRA = 8
"""Tokens the shared-start case's running request decodes past ``--new`` (it must still hold
its row when the others are admitted)."""


def _one(model: Any, prompt: list[int], n: int, chunk: int | None, share: bool,
         new: int) -> tuple[float, list[list[int]]]:
    """One engine, ``n`` choices of ``prompt``: seconds until every choice has its first
    token, and the choices' tokens."""
    engine = Engine(model, None, "ar", max_batch=n, threads=1, prefill_chunk=chunk,
                    share_prompts=share)
    t0 = time.perf_counter()
    reqs = [engine.submit(prompt, SamplingOptions(max_new_tokens=new, temperature=0.8,
                                                  seed=i, ignore_eos=True))
            for i in range(n)]
    engine.run()
    first = max(r.t_first for r in reqs) - t0
    engine.close()
    return first, [list(r.token_ids) for r in reqs]


def _prefix(model: Any, system: list[int], tails: list[list[int]], share: bool, new: int
            ) -> tuple[float, list[list[int]]]:
    """A request of ``system + tails[0]`` decoding, then one per other tail arriving: seconds
    until each of those has its first token, and their tokens (greedy)."""
    engine = Engine(model, None, "ar", max_batch=len(tails), threads=1, share_prompts=share)
    sampling = SamplingOptions(max_new_tokens=new + RUNNING_EXTRA, ignore_eos=True)
    first = engine.submit(system + tails[0], sampling)
    while not first.token_ids:
        engine.step()
    t0 = time.perf_counter()
    reqs = [engine.submit(system + t, sampling) for t in tails[1:]]
    while not all(r.token_ids for r in reqs):
        engine.step()
    took = max(r.t_first for r in reqs) - t0
    engine.run()
    engine.close()
    return took, [list(r.token_ids) for r in reqs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", help="float32, float16, int8, int4, ...")
    p.add_argument("--prompt-len", type=int_at_least(2), default=512)
    p.add_argument("--choices", type=list_of(int_at_least(2), "choice counts (each >= 2)"),
                   default=[2, 4, 8])
    p.add_argument("--chunk", type=int_at_least(1), default=256,
                   help="the prefill budget per step of the in-parts setting")
    p.add_argument("--new", type=int_at_least(1), default=4, help="tokens per choice")
    p.add_argument("--tail", type=int_at_least(1), default=32,
                   help="tokens after the shared start in the prefix case")
    p.add_argument("--passes", type=int_at_least(1), default=3)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--quick", action="store_true", help="a smoke test: short prompt, one pass")
    args = p.parse_args()
    if args.quick:
        args.prompt_len, args.choices, args.passes, args.chunk, args.tail = 64, [3], 1, 16, 8
    torch.set_num_threads(args.threads)
    with one_line_errors("shared_prefill"):
        loaded = load_model(args.model, dtype=args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.prompt_len + args.new + RUNNING_EXTRA > model.config.max_seq_len:
        raise SystemExit(f"shared_prefill: --prompt-len {args.prompt_len} + --new {args.new} "
                         f"+ {RUNNING_EXTRA} exceeds the model's context "
                         f"({model.config.max_seq_len})")
    encoder = tokenizer if tokenizer is not None else ByteIds(model.config.vocab_size)
    k_tails = max(args.choices)
    source = long_prompt_ids(encoder, args.prompt_len + (k_tails + 1) * args.tail,
                             "shared_prefill")
    prompt = source[:args.prompt_len]
    cases = [(n, chunk, share) for chunk in (None, args.chunk) for n in (1, *args.choices)
             for share in ((True,) if n == 1 else (True, False))]
    times: dict[tuple[int, int | None, bool], list[float]] = {c: [] for c in cases}
    tokens: dict[tuple[int, int | None, bool], list[list[int]]] = {}
    _one(model, prompt[:16], 2, None, True, 1)  # warm-up (thread pools, packed weights)
    system = source[:args.prompt_len - args.tail]
    tails = [source[args.prompt_len + i * args.tail:args.prompt_len + (i + 1) * args.tail]
             for i in range(k_tails + 1)]
    prefix: dict[bool, list[float]] = {True: [], False: []}
    prefix_tokens: dict[bool, list[list[int]]] = {}
    for k in range(args.passes):
        note(f"pass {k + 1}/{args.passes}")
        for case in cases if k % 2 == 0 else cases[::-1]:
            t, toks = _one(model, prompt, *case, args.new)
            times[case].append(t)
            tokens[case] = toks
        for share in (True, False) if k % 2 == 0 else (False, True):
            t, toks = _prefix(model, system, tails, share, args.new)
            prefix[share].append(t)
            prefix_tokens[share] = toks
    rows = []
    for n, chunk, share in cases:
        row: dict[str, Any] = {"choices": n, "prefill_chunk": chunk, "shared": share,
                               "all_first_tokens_s": statistics.median(times[n, chunk, share])}
        if n > 1:
            base = statistics.median(times[n, chunk, False]) if share else None
            alone = statistics.median(times[1, chunk, True])
            row["vs_one_choice"] = row["all_first_tokens_s"] / alone
            if base is not None:
                row["speedup_vs_unshared"] = base / row["all_first_tokens_s"]
                row["same_tokens_as_unshared"] = tokens[n, chunk, True] == tokens[n, chunk, False]
        rows.append(row)
    print(json.dumps({"machine": machine(), "model": args.model, "dtype": args.dtype,
                      "prompt_tokens": len(prompt), "new_tokens": args.new,
                      "threads": args.threads, "passes": args.passes, "results": rows,
                      "shared_start": {
                          "start_tokens": len(system), "tail_tokens": args.tail,
                          "arriving": len(tails) - 1,
                          "all_first_tokens_s": {str(k).lower(): statistics.median(v)
                                                 for k, v in prefix.items()},
                          "speedup_vs_unshared": statistics.median(prefix[False])
                          / statistics.median(prefix[True]),
                          "same_tokens_as_unshared": prefix_tokens[True] == prefix_tokens[False]}},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
