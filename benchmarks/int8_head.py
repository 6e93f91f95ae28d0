"""Plain decoding with the float LM head against the int8 head (``--head-dtype int8``), same run.

SmolLM2-135M's tied 49152 x 576 head is read once per decoded token: 113 MB in fp32, as much as
~8 of its 30 layers. ``load_model(..., head_dtype="int8")`` keeps every layer and the
embedding lookups in the model's dtype and multiplies the head in int8 (groups of 32, 1.125
bytes a weight). This script loads the embedded model twice - float head and int8 head - and
decodes the same prompts with both, greedy, exactly N new tokens (EOS ignored), alternating the
two models on every repeat so that background load hits both, one warm-up each.

Reported, per variant: decode tokens/s of the fastest run of each prompt summed
(``decode_tokens_per_s_best``) and of the median run (``decode_tokens_per_s_median``); one LM
head product of one row timed alone (best and median of ``--head-calls`` calls); the bytes the
head reads. Agreement: for each prompt, whether the two greedy continuations are identical and
the first token index where they differ (``null``: none).

    python benchmarks/int8_head.py                      # fp32 model, 4 prompts x 64 tokens
    python benchmarks/int8_head.py --repeats 5 --threads 1
    python benchmarks/int8_head.py --dtype float16 --quick

Prints one JSON object on stdout; progress goes to stderr. Timings on a shared machine are
noisy: compare medians and bests of the same run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

import torch

from _bench import machine, note, one_line_errors

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef moving_average(x, w):\n    ",
]
VARIANTS = ("float_head", "int8_head")


def decode(runner: Any, ids: list[int], new: int, threads: int) -> dict[str, Any]:
    """One greedy generation of exactly ``new`` tokens."""
    from exitlm.infer import generate

    res = generate(runner, None, ids, max_new_tokens=new, ignore_eos=True, threads=threads)
    tm = res.timings
    return {"tokens": list(res.token_ids[0]), "decode_s": tm.decode_s,
            "decode_tokens": tm.decode_tokens}


def head_call_us(runner: Any, calls: int) -> dict[str, float]:
    """Microseconds of one LM head product of one row (the runner's ``logits`` of the final
    layer), best and median of ``calls``."""
    model = runner.model
    h = torch.randn(1, model.config.dim).to(model.embed_tokens.weight.dtype
                                             if isinstance(model.embed_tokens.weight,
                                                           torch.Tensor) else torch.float32)
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            t0 = time.perf_counter()
            runner.project(h, model.output_embedding())
            times.append((time.perf_counter() - t0) * 1e6)
    return {"best": min(times), "median": statistics.median(times)}


def head_bytes(model: Any) -> int:
    """Bytes one LM head product reads."""
    w = model.output_embedding()
    return int(w.numel() * w.element_size()) if isinstance(w, torch.Tensor) else int(w.nbytes())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (None: identical)."""
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    return diff


def rate(runs: list[dict[str, Any]]) -> float:
    """Decode tokens/s over ``runs`` together."""
    return sum(r["decode_tokens"] for r in runs) / max(1e-9, sum(r["decode_s"] for r in runs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="model name or path (default: embedded)")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="the model's weights (the int8 variant quantizes its head alone)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt and variant")
    ap.add_argument("--threads", type=int, default=1, help="torch and kernel threads")
    ap.add_argument("--head-calls", type=int, default=50, help="timed single head products")
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 tokens, 1 run")
    args = ap.parse_args(argv)
    from exitlm.io import load_model
    from exitlm.runtime import prepare

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    prompts = PROMPTS[:1] if args.quick else PROMPTS
    new = 16 if args.quick else args.new_tokens
    repeats = 1 if args.quick else max(1, args.repeats)
    note(f"loading {args.model} ({args.dtype}) twice: float head, int8 head ...")
    loaded = load_model(args.model, dtype=dtype)
    models = {"float_head": loaded.model,
              "int8_head": load_model(args.model, dtype=dtype, head_dtype="int8").model}
    tok = loaded.tokenizer
    if tok is None:
        raise SystemExit("int8_head.py: the model has no tokenizer")
    prompt_ids = [tok.encode(p) for p in prompts]
    runners = {k: prepare(m) for k, m in models.items()}
    for k, r in runners.items():  # warm-up (kernels, caches, thread measurement)
        decode(r, prompt_ids[0], 8, args.threads)
        note(f"warm: {k} ({runners[k].kind} runner)")
    runs: dict[str, list[list[dict[str, Any]]]] = {k: [[] for _ in prompts] for k in VARIANTS}
    for rep in range(repeats):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for i, ids in enumerate(prompt_ids):
            for k in order:
                runs[k][i].append(decode(runners[k], ids, new, args.threads))
        note(f"repeat {rep + 1}/{repeats}: "
             + ", ".join(f"{k} {rate([r for p in runs[k] for r in p[-1:]]):.1f} tok/s"
                         for k in VARIANTS))
    results: dict[str, Any] = {}
    for k in VARIANTS:
        per = runs[k]
        best = [max(p, key=lambda r: r["decode_tokens"] / r["decode_s"]) for p in per]
        median = [sorted(p, key=lambda r: r["decode_tokens"] / r["decode_s"])[(len(p) - 1) // 2]
                  for p in per]
        results[k] = {
            "decode_tokens_per_s_best": rate(best),
            "decode_tokens_per_s_median": rate(median),
            "head_bytes": head_bytes(models[k]),
            "head_product_us": head_call_us(runners[k], args.head_calls),
            "runner": runners[k].kind,
        }
    agreement = []
    for i, p in enumerate(prompts):
        a, b = runs["float_head"][i][0]["tokens"], runs["int8_head"][i][0]["tokens"]
        diff = first_difference(a, b)
        agreement.append({"prompt": p, "identical": diff is None, "first_difference": diff})
    base, fast = results["float_head"], results["int8_head"]
    report = {
        "date": datetime.date.today().isoformat(),
        "model": loaded.source,
        "dtype": args.dtype,
        "batch_size": 1,
        "new_tokens": new,
        "prompts": len(prompts),
        "repeats": repeats,
        "threads": args.threads,
        **machine(),
        "results": results,
        "speedup_best": fast["decode_tokens_per_s_best"] / base["decode_tokens_per_s_best"],
        "speedup_median": fast["decode_tokens_per_s_median"]
        / base["decode_tokens_per_s_median"],
        "agreement": agreement,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    with one_line_errors("int8_head.py"):
        sys.exit(main())
