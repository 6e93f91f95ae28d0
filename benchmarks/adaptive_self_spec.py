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

With ``--fresh N``, N more passes compare what a fresh process sees: each pass loads the model
anew for every variant (``ar``, ``adaptive`` and, for a model whose config records its
measured best round, ``exits.draft``, that round fixed), so that the planner starts with no
measured times, and interleaves the variants per prompt (``fresh`` in the JSON).

    python benchmarks/adaptive_self_spec.py --model default-ee --threads 1
    python benchmarks/adaptive_self_spec.py --model runs/scratch-layerskip/model --batch 8
    python benchmarks/adaptive_self_spec.py --quick
    python benchmarks/adaptive_self_spec.py --model layerskip-code --specs 4 --exits 10 --fresh 5
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
    p.add_argument("--fresh", type=int_at_least(0), default=0,
                   help="also this many passes on freshly loaded models (a new process's planner)")
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


def _fresh(bench: Any, passes: int, new: int) -> dict[str, Any]:
    """``passes`` passes over the prompts, each on models loaded anew for every variant (the
    planner's measured times start empty, as in a new process), variants interleaved per
    prompt (the order rotating); decode tokens per second per pass and over all."""
    from exitlm.infer.api import generate
    from exitlm.runtime import prepare

    hint = bench.model.config.exits.draft
    variants: dict[str, dict[str, Any]] = {"ar": {}, "adaptive": {}}
    if hint is not None:
        variants["hint-fixed"] = {"exit_layer": hint.exit_layer,
                                  "num_speculations": hint.num_speculations}
    names = list(variants)
    totals = {n: [0, 0.0] for n in names}
    per_pass = []
    for p in range(passes):
        runners = {n: prepare(bench.load_again().model) for n in names}

        def run(name: str, ids: list[int], n_new: int, runners: dict = runners) -> Any:
            return generate(runners[name], bench.tokenizer, ids,
                            strategy="ar" if name == "ar" else "self-spec",
                            max_new_tokens=n_new, ignore_eos=True, **variants[name])

        for name in names:  # warm-up, as exitlm bench's
            run(name, bench.prompt_ids[0], 4)
        sums = {n: [0, 0.0] for n in names}
        for i, ids in enumerate(bench.prompt_ids):
            order = names[i % len(names):] + names[: i % len(names)]
            outs = {}
            for name in order:
                res = run(name, ids, new)
                sums[name][0] += res.timings.decode_tokens
                sums[name][1] += res.timings.decode_s
                outs[name] = res.token_ids
            if any(outs[n] != outs["ar"] for n in names):
                raise RuntimeError(f"fresh pass {p}: a variant's output differs from plain "
                                   f"decoding's on prompt {i}")
        base = sums["ar"][0] / sums["ar"][1]
        per_pass.append({n: sums[n][0] / sums[n][1] / base for n in names})
        for n in names:
            totals[n][0] += sums[n][0]
            totals[n][1] += sums[n][1]
        note(f"adaptive_self_spec: fresh pass {p + 1}/{passes}: "
             + ", ".join(f"{n} {r:.3f}x" for n, r in per_pass[-1].items()))
    base = totals["ar"][0] / totals["ar"][1]
    return {"passes": per_pass, "exact_match": True,
            "over_ar": {n: totals[n][0] / totals[n][1] / base for n in names}}


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
    if args.fresh:
        out["fresh"] = _fresh(bench, args.fresh, args.max_new_tokens)
    out["wall_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("adaptive_self_spec.py"):
        sys.exit(main(sys.argv[1:]))
