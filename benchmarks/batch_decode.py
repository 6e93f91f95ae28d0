"""Batched decoding on CPU: the native blocks against the torch path, in one run.

A batch of B sequences steps through the native blocks in one call per run of layers (each
row at its own position of its own cache row; ``exitlm.runtime.native``), or - the baseline -
through torch's layers with oneDNN-packed weight copies for its few-row products (the eager
runner, ``backend="eager"``, which is what the native runner did for batches before). Both
runners decode the same prompts, greedy, ``--new-tokens`` each, alternating, best of
``--repeats``; each has its own copy of the model (the runners lay the weights out
differently). Reported per batch size: decode tokens/s summed over the batch for both, their
ratio, and whether the native batch gave every sequence the tokens it gets decoded alone
(``identical_to_alone``: batching is exact there by construction).

Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/batch_decode.py                          # default model, B = 1, 2, 4, 8
    python benchmarks/batch_decode.py --dtype int8 --batches 1,4
    python benchmarks/batch_decode.py --model debug --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from _bench import machine, note, one_line_errors
from exitlm.args import int_at_least, int_list

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
    "class Stack:\n    def __init__(self):",
    "The three primary colours are",
    "for i in range(10):",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a model name or path (default: default)")
    p.add_argument("--dtype", choices=("float32", "float16", "int8", "int4"), default="float32")
    p.add_argument("--batches", type=int_list, default=[1, 2, 4, 8],
                   help="batch sizes, at most 8 (default 1,2,4,8)")
    p.add_argument("--new-tokens", type=int_at_least(1), default=32)
    p.add_argument("--repeats", type=int_at_least(1), default=2)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--quick", action="store_true", help="B = 1, 2; 8 tokens; one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = [1, 2], 8, 1
    if not args.batches or not all(1 <= b <= len(PROMPTS) for b in args.batches):
        p.error(f"--batches: each between 1 and {len(PROMPTS)}, got {args.batches}")
    return args


def _prompts(tokenizer: Any, vocab: int, b: int) -> list[Any]:
    if tokenizer is not None:
        return PROMPTS[:b]
    return [[(7 * i + 3 * j + 1) % vocab for i in range(4 + 2 * j)] for j in range(b)]


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from exitlm.infer import generate
    from exitlm.io import load_model
    from exitlm.runtime import prepare

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype.startswith("float") else args.dtype
    lm = load_model(args.model, dtype=dtype)
    tokenizer = lm.tokenizer
    runners = {"torch": prepare(copy.deepcopy(lm.model), backend="eager"),
               "native": prepare(lm.model, backend="native")}
    kw = {"max_new_tokens": args.new_tokens, "threads": args.threads, "ignore_eos": True}
    rows = []
    for b in args.batches:
        prompts = _prompts(tokenizer, lm.model.config.vocab_size, b)
        alone = [generate(runners["native"], tokenizer, [p], **kw).token_ids[0]
                 for p in prompts]
        best = {name: 0.0 for name in runners}
        same = True
        for r in range(args.repeats):
            for name, runner in runners.items():
                out = generate(runner, tokenizer, prompts, **kw)
                best[name] = max(best[name], out.timings.decode_tokens_per_s)
                if name == "native":
                    same = same and out.token_ids == alone
            note(f"batch {b}: pass {r + 1}/{args.repeats}")
        rows.append({"batch": b, "torch_tokens_per_s": round(best["torch"], 1),
                     "native_tokens_per_s": round(best["native"], 1),
                     "native_vs_torch": round(best["native"] / best["torch"], 3),
                     "identical_to_alone": same})
    print(json.dumps({"benchmark": "batch_decode", **machine(), "model": args.model,
                      "dtype": args.dtype, "threads": args.threads,
                      "new_tokens": args.new_tokens, "repeats": args.repeats,
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("batch_decode.py"):
        sys.exit(main(sys.argv[1:]))
