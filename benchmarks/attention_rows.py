"""The native blocks' attention over a long cache: M rows (a verification of M - 1 drafts) against
one row, on 1 or more threads (one JSON).

A stack of ``--layers`` native blocks (``exitlm.kernels.native_block``) of an attention shape
(``--heads`` x ``--head-dim``, ``--kv-heads``; a small MLP so that the attention dominates), the
float32 cache of each holding ``--context`` positions; one call of M rows at position
``--context`` per layer. Per M: microseconds per layer (median and best of ``--repeats``
passes; the M's of a pass interleaved) and ``time(M) / time(1)``, the median over passes of
that ratio within a pass. Compare builds or settings by running it on each (the same command,
alternating), e.g. ``EXITLM_NATIVE=build`` on two checkouts.

    python benchmarks/attention_rows.py [--context 768] [--threads 2] [--rows 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _bench import machine, note, one_line_errors
from exitlm.args import int_at_least, int_list


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int_at_least(1), default=768, help="cached positions")
    p.add_argument("--rows", type=int_list, default=[1, 2, 4, 8],
                   help="row counts M (1 first: the base of every ratio)")
    p.add_argument("--heads", type=int_at_least(1), default=4)
    p.add_argument("--kv-heads", type=int_at_least(1), default=4)
    p.add_argument("--head-dim", type=int_at_least(2), default=64)
    p.add_argument("--layers", type=int_at_least(1), default=24)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--repeats", type=int_at_least(1), default=15)
    args = p.parse_args(argv)
    if args.rows[0] != 1 or min(args.rows) < 1:
        p.error("--rows: expected row counts starting with 1, e.g. 1,2,4,8")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads}: expected a divisor of --heads {args.heads}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import torch

    from exitlm.config import ExitConfig, ModelConfig
    from exitlm.kernels import native
    from exitlm.kernels.native_block import Scratch, build_native_block
    from exitlm.model.transformer import EarlyExitLM

    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit(f"attention_rows.py: needs the native kernels "
                         f"({native.kernel_path().describe()})")
    top = args.context + max(args.rows)
    cfg = ModelConfig(vocab_size=256, dim=args.heads * args.head_dim, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      hidden_dim=64, max_seq_len=top,
                      exits=ExitConfig(every_layer=True, norm="final"))
    torch.manual_seed(0)
    model = EarlyExitLM(cfg).eval()
    scratch = Scratch()
    blocks = [build_native_block(native.library(), layer, scratch) for layer in model.layers]
    if any(b is None for b in blocks):
        raise SystemExit("attention_rows.py: the native blocks do not take this shape")
    cache = model.new_cache(1, top)
    gen = torch.Generator().manual_seed(1)
    times: dict[int, list[float]] = {m: [] for m in args.rows}
    with torch.inference_mode():
        for i in range(args.layers):
            cache.keys[i].normal_(generator=gen)
            cache.values[i].normal_(generator=gen)
        cells = {}
        for m in args.rows:
            pos = torch.arange(args.context, args.context + m)[None]
            cells[m] = (torch.randn(1, m, cfg.dim, generator=gen), model.context(pos).rope)
        for rep in range(args.repeats + 1):  # the first pass warms up
            for m, (h, rope) in cells.items():
                t0 = time.perf_counter()
                for i, b in enumerate(blocks):
                    b(h, rope, cache.keys[i][0], cache.values[i][0], args.context, args.threads)
                if rep:
                    times[m].append((time.perf_counter() - t0) / args.layers)
    out = {"context": args.context, "heads": args.heads, "kv_heads": args.kv_heads,
           "head_dim": args.head_dim, "layers": args.layers, "threads": args.threads,
           "repeats": args.repeats, "kernels": native.kernel_path().describe(), "rows": {}}
    for m in args.rows:
        ts = times[m]
        out["rows"][str(m)] = {
            "us_per_layer": round(statistics.median(ts) * 1e6, 1),
            "best_us_per_layer": round(min(ts) * 1e6, 1),
            "cost": round(statistics.median(t / t1 for t, t1 in zip(ts, times[1], strict=True)),
                          2)}
    note(f"context {args.context}, {args.threads} thread(s): " + "  ".join(
        f"M={m} {v['us_per_layer']} us ({v['cost']}x)" for m, v in out["rows"].items()))
    out.update(machine())
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("attention_rows.py"):
        sys.exit(main(sys.argv[1:]))
