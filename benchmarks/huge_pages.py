"""Decoding with the weights in huge pages against 4 KiB pages, in one run.

The CPU runners move a model's private weights into one arena of transparent huge pages
(``exitlm.runtime.memory.place_weights``; weights read in place from a mapped checkpoint file
stay there). This script loads the model once per precision and makes two private copies of
it (``copy.deepcopy``: torch's allocator, 4 KiB pages): one whose runner is prepared with
``EXITLM_HUGE_PAGES=0`` (the weights stay in 4 KiB pages) and one whose runner placed them, and
decodes the same prompts
greedily with both, each prompt back to back, ``--repeats`` times. Reported per precision: decode
tokens/s of both (best run), their ratio, the median ratio of the back-to-back pairs, whether
both gave the same tokens, the seconds placement took, and the process's ``AnonHugePages``
after placement (what the kernel actually granted).

Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/huge_pages.py                                # fp32, fp16, int8, int4
    python benchmarks/huge_pages.py --dtypes float32 --repeats 5
    python benchmarks/huge_pages.py --model debug --quick          # a smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from _bench import machine, note, one_line_errors
from exitlm.args import int_at_least

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
DTYPES = ("float32", "float16", "int8", "int4")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a model name or path (default: default)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"comma-separated, of {', '.join(DTYPES)} (default: all)")
    p.add_argument("--new-tokens", type=int_at_least(1), default=48)
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--min-bytes", type=int_at_least(0), default=None,
                   help="place models smaller than exitlm's threshold too (tests)")
    p.add_argument("--quick", action="store_true", help="fp32 only, 8 tokens, one repeat")
    args = p.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        p.error(f"--dtypes: each of {', '.join(DTYPES)}, got {args.dtypes}")
    if args.quick:
        args.dtypes, args.new_tokens, args.repeats = ["float32"], 8, 1
    return args


def _huge_kb() -> int | None:
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    found = re.search(r"AnonHugePages:\s+(\d+) kB", text)
    return int(found.group(1)) if found else None


def _row(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    from exitlm.infer import generate
    from exitlm.io import load_model
    from exitlm.runtime import memory, prepare

    lm = load_model(args.model, dtype=dtype)
    tokenizer = lm.tokenizer
    vocab = lm.model.config.vocab_size
    prompts = PROMPTS if tokenizer is not None else [[(7 * i + 3 * j + 1) % vocab
                                                      for i in range(4 + j)] for j in range(3)]
    small, big = copy.deepcopy(lm.model), copy.deepcopy(lm.model)
    del lm.model
    os.environ["EXITLM_HUGE_PAGES"] = "0"
    try:
        runners = {"small_pages": prepare(small)}
    finally:
        del os.environ["EXITLM_HUGE_PAGES"]
    before = _huge_kb()
    start = time.perf_counter()
    if args.min_bytes is not None:
        memory.place_weights(big, min_bytes=args.min_bytes)
    runners["huge_pages"] = prepare(big)
    placing = time.perf_counter() - start
    after = _huge_kb()
    kw = {"max_new_tokens": args.new_tokens, "threads": args.threads, "ignore_eos": True}
    best = {name: 0.0 for name in runners}
    tokens: dict[str, list[Any]] = {}
    ratios = []  # huge / small of the two runs of one prompt, back to back
    for r in range(args.repeats):
        for prompt in prompts:
            rate = {}
            for name, runner in runners.items():
                out = generate(runner, tokenizer, [prompt], **kw)
                tokens.setdefault(name, []).append(out.token_ids[0])
                rate[name] = out.timings.decode_tokens_per_s
                best[name] = max(best[name], rate[name])
            ratios.append(rate["huge_pages"] / rate["small_pages"])
        note(f"{dtype}: pass {r + 1}/{args.repeats}: best {best}")
    return {"dtype": dtype, "placed": memory.placed(big),
            "placing_s": round(placing, 3),
            "anon_huge_pages_mb": None if after is None else round((after - (before or 0)) / 1024),
            "small_pages_tokens_per_s": round(best["small_pages"], 1),
            "huge_pages_tokens_per_s": round(best["huge_pages"], 1),
            "huge_vs_small": round(best["huge_pages"] / best["small_pages"], 3),
            "huge_vs_small_median_pair": round(statistics.median(ratios), 3),
            "identical": tokens["huge_pages"] == tokens["small_pages"]}


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from exitlm.runtime.memory import huge_pages_available

    torch.set_num_threads(args.threads)
    rows = [_row(args, dtype) for dtype in args.dtypes]
    print(json.dumps({"benchmark": "huge_pages", **machine(), "model": args.model,
                      "threads": args.threads, "new_tokens": args.new_tokens,
                      "repeats": args.repeats, "huge_pages_available": huge_pages_available(),
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("huge_pages.py"):
        sys.exit(main(sys.argv[1:]))
