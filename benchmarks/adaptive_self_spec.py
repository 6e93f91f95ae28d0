"""Adaptive self-speculation against the static (E, d) grid and plain decoding (one JSON).

In one process and one run, over the same held-out prompts (``exitlm bench``'s built-in
standard-library code prompts, :mod:`exitlm.bench.run`), each prompt's variants interleaved:

* ``ar``: plain decoding (the baseline of every ratio);
* ``adaptive``: ``self-spec`` with no exit or draft length given (chosen per step,
  :mod:`exitlm.infer.adaptive`);
* ``static-default``: the deepest exit head (``L // 2`` for every-layer exits) with d = 4,
  what ``self-spec`` did before it chose for itself;
* ``E{e}-d{d}``: every cell of the grid ``--exits`` x ``--specs`` (``exitlm bench --sweep
  speculation``'s).

Batch 1 is timed as decode tokens per second (tokens after the first over the time after it).
With ``--batch B`` the same comparison runs for plain decoding and adaptive self-spec with B
prompts decoded together by the engine (continuous batching), as the batch's decode tokens per
second. Every variant's output is checked against plain decoding's (``exact_match``).

    python benchmarks/adaptive_self_spec.py --model default-ee --threads 1
    python benchmarks/adaptive_self_spec.py --model runs/scratch-layerskip/model --batch 8
    python benchmarks/adaptive_self_spec.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from _bench import note, one_line_errors
from exitlm.args import int_at_least, int_list


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default-ee", help="model name or path")
    p.add_argument("--num-prompts", type=int_at_least(1), default=4)
    p.add_argument("--max-new-tokens", type=int_at_least(2), default=64)
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="runs per prompt and variant (the fastest kept)")
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--exits", type=int_list, default=None,
                   help="grid exits (default: the model's exit heads, or 4 spread over the depth)")
    p.add_argument("--specs", type=int_list, default=[1, 2, 4, 6], help="grid draft lengths")
    p.add_argument("--batch", type=int_at_least(0), default=0,
                   help="also compare plain and adaptive decoding of this many prompts at once")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, a small grid")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, 16
        args.specs = [1, 4]
    return args


def _grid_exits(model: Any, given: list[int] | None) -> list[int]:
    if given:
        return given
    cfg = model.config
    if cfg.exits.layers:
        return list(cfg.exits.layers)
    n = model.num_layers
    return sorted({max(1, round(n * f)) for f in (0.25, 0.4, 0.5, 0.65)})


def _batch(bench: Any, size: int, new: int, repeats: int) -> dict[str, Any]:
    """Plain and adaptive decoding of ``size`` prompts at once (the engine's batch)."""
    from exitlm.infer.api import generate

    prompts = [bench.prompt_ids[i % len(bench.prompt_ids)] for i in range(size)]
    out: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    for strategy in ("ar", "self-spec"):  # warm-up
        generate(bench.runner, bench.tokenizer, prompts[:2], strategy=strategy,
                 max_new_tokens=4, ignore_eos=True)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, strategy in (("ar", "ar"), ("adaptive", "self-spec")):
            res = generate(bench.runner, bench.tokenizer, prompts, strategy=strategy,
                           max_new_tokens=new, ignore_eos=True)
            tps = res.timings.decode_tokens_per_s
            if tps > best.get(name, 0.0):
                best[name] = tps
                out[name] = {"decode_tokens_per_s": tps, "stats": res.stats.to_dict()}
            tokens[name] = res.token_ids
    out["adaptive"]["exact_match"] = tokens["adaptive"] == tokens["ar"]
    out["adaptive_over_ar"] = best["adaptive"] / best["ar"]
    out["batch"] = size
    return out


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import torch

    from exitlm.bench.run import Bench, BenchConfig, summarize
    from exitlm.infer.self_speculative import resolve_exit_layer

    cfg = BenchConfig(model=args.model, strategies=("ar", "self-spec"),
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                      repeats=args.repeats, threads=args.threads)
    t0 = time.perf_counter()
    bench = Bench(cfg)
    model = bench.model
    exits = _grid_exits(model, args.exits)
    default_exit = resolve_exit_layer(model, None)
    variants: dict[str, tuple[str, dict[str, Any]]] = {
        "ar": ("ar", {}),
        "adaptive": ("self-spec", {}),
        "static-default": ("self-spec", {"exit_layer": default_exit, "num_speculations": 4}),
    }
    for e in exits:
        for d in args.specs:
            variants[f"E{e}-d{d}"] = ("self-spec", {"exit_layer": e, "num_speculations": d})
    note(f"adaptive_self_spec: {bench.model_name}, {len(variants)} variants x "
         f"{len(bench.prompt_ids)} prompts x {args.max_new_tokens} tokens")
    runs = bench.measure(variants, args.max_new_tokens, args.repeats)
    ref = runs["ar"]
    results = {name: summarize(r, ref) for name, r in runs.items()}
    base = results["ar"]["decode_tokens_per_s"]
    for res in results.values():
        res["speedup_vs_ar"] = res["decode_tokens_per_s"] / base if base else 0.0
    grid = {k: v for k, v in results.items() if k.startswith("E")}
    best_name = max(grid, key=lambda k: grid[k]["decode_tokens_per_s"])
    adaptive = results["adaptive"]["decode_tokens_per_s"]
    stats = [r.stats for r in runs["adaptive"]]
    total = type(stats[0]).total(stats)
    out: dict[str, Any] = {
        "model": bench.model_name,
        "num_layers": model.num_layers,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "prompts": len(bench.prompt_ids),
        "max_new_tokens": args.max_new_tokens,
        "grid": {"exits": exits, "specs": args.specs},
        "results": results,
        "adaptive_stats": total.to_dict(),
        "ratios": {
            "adaptive_over_ar": adaptive / base,
            "adaptive_over_best_static": adaptive / grid[best_name]["decode_tokens_per_s"],
            "adaptive_over_static_default":
                adaptive / results["static-default"]["decode_tokens_per_s"],
            "best_static": best_name,
            "best_static_over_ar": grid[best_name]["speedup_vs_ar"],
        },
    }
    if args.batch:
        note(f"adaptive_self_spec: batch of {args.batch}")
        out["batched"] = _batch(bench, args.batch, args.max_new_tokens, args.repeats)
    out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("adaptive_self_spec.py"):
        sys.exit(main(sys.argv[1:]))
