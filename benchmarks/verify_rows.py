"""The cost of self-speculation's verification round in one-position steps (one JSON).

Verifying d drafts runs the model's layers over d + 1 positions of one sequence, then the LM
head over those rows. For each precision, on the model's runner (the native blocks on CPU),
after a prompt of ``--prompt`` positions: ``runner.layers`` over all layers for 1 position and
for each ``--positions`` value, and ``runner.logits`` (the final head) for as many rows; calls
interleaved, each cost as ``time(P positions) / time(1 position)`` (the median over passes of
that ratio within a pass, and the ratio of the best passes), with the milliseconds per call.

Run it once per checkout to compare kernels before and after a change (the same command on a
checkout of another branch, alternating; with an editable install, whose import hook comes
before ``PYTHONPATH``, install the other checkout in a second virtual environment), e.g.::

    python benchmarks/verify_rows.py --model default --precisions float32,int8
    python benchmarks/verify_rows.py --model layerskip-code --precisions float16 --prompt 768 \
        --threads 2
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/verify_rows.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _bench import note, one_line_errors
from exitlm.args import int_at_least, int_list


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="model name or path")
    p.add_argument("--precisions", default="float32,int8",
                   help="comma-separated dtypes for load_model (float32, float16, int8, int4)")
    p.add_argument("--positions", type=int_list, default=[2, 5, 8],
                   help="verification widths d + 1 (default 2,5,8)")
    p.add_argument("--prompt", type=int_at_least(1), default=64, help="positions before")
    p.add_argument("--repeats", type=int_at_least(1), default=15, help="passes")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="threads of the native calls (default 1)")
    p.add_argument("--narrow-rows", type=int_list, default=None,
                   help="comma-separated settings of the avx512 build's narrow_rows (products "
                        "of up to N rows on its 256-bit tiles), each timed in every pass, e.g. "
                        "1,2 (default: the library's choice only)")
    args = p.parse_args(argv)
    if args.narrow_rows is not None and min(args.narrow_rows) < 0:
        p.error("--narrow-rows: expected row counts of 0 or more, e.g. 1,2")
    return args


def _precision(name: str, dtype: str, widths: list[int], prompt: int, repeats: int,
               narrow: list[int] | None) -> dict:
    import torch

    from exitlm.io.loader import load_model
    from exitlm.kernels import native
    from exitlm.runtime import prepare

    torch_dtypes = {"float32": torch.float32, "float16": torch.float16}
    model = load_model(name, dtype=torch_dtypes.get(dtype, dtype)).model.eval()
    runner = prepare(model)
    n = model.num_layers
    cache = runner.new_cache(1, prompt + max(widths) + 1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt + max(widths)), generator=gen)
    with torch.inference_mode():
        pos = torch.arange(prompt).unsqueeze(0)
        runner.layers(runner.embed(tokens[:, :prompt], pos), 0, n, pos, cache)
        cells = {}
        for m in [1, *widths]:
            p = torch.arange(prompt, prompt + m).unsqueeze(0)
            h = runner.embed(tokens[:, prompt : prompt + m], p)
            cells[m] = (h, p, runner.layers(h, 0, n, p, cache))
        own = native.narrow_rows()
        if narrow is not None and own is None:
            raise SystemExit("verify_rows.py: --narrow-rows: the loaded kernels have no 512-bit "
                             f"tiles to narrow ({native.kernel_path().describe()})")
        settings = narrow or [own]
        times: dict[tuple[int | None, str, int], list[float]] = {}
        for rep in range(repeats + 1):  # the first pass warms up
            for setting in settings:
                if setting is not None:
                    native.set_narrow_rows(setting)
                for m, (h, p, out) in cells.items():
                    t0 = time.perf_counter()
                    runner.layers(h, 0, n, p, cache)
                    t1 = time.perf_counter()
                    runner.logits(out, n)
                    t2 = time.perf_counter()
                    if rep:
                        times.setdefault((setting, "layers", m), []).append(t1 - t0)
                        times.setdefault((setting, "head", m), []).append(t2 - t1)
        if own is not None:
            native.set_narrow_rows(own)
    res: dict = {"runner": runner.kind, "kernels": native.kernel_path().describe(),
                 "num_layers": n}
    if narrow is None:
        res.update(_costs(times, own, widths, dtype))
    else:
        res["narrow_rows"] = {str(s): _costs(times, s, widths, f"{dtype} narrow_rows={s}")
                              for s in settings}
    return res


def _costs(times: dict, setting: int | None, widths: list[int], label: str) -> dict:
    """Per part (layers, head): 1-position milliseconds and each width's cost over them."""
    res: dict = {}
    for part in ("layers", "head"):
        one = times[(setting, part, 1)]
        row = {"ms_1": round(statistics.median(one) * 1e3, 3),
               "best_ms_1": round(min(one) * 1e3, 3)}
        for m in widths:
            ts = times[(setting, part, m)]
            row[f"P={m}"] = {
                "ms": round(statistics.median(ts) * 1e3, 3),
                "cost": round(statistics.median(t / t1 for t, t1 in zip(ts, one, strict=True)), 2),
                "best_cost": round(min(ts) / min(one), 2)}
        res[part] = row
    note(f"{label}: layers 1 position {res['layers']['ms_1']} ms, "
         + "  ".join(f"{k} {v['cost']}x ({v['best_cost']}x)" for k, v in res["layers"].items()
                     if k.startswith("P="))
         + f" | head {res['head']['ms_1']} ms, "
         + "  ".join(f"{k} {v['cost']}x" for k, v in res["head"].items() if k.startswith("P=")))
    return res


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import torch

    from exitlm.kernels.blas import thread_split

    torch.set_num_threads(1)
    with thread_split(1, args.threads):
        precisions = {d: _precision(args.model, d, args.positions, args.prompt, args.repeats,
                                    args.narrow_rows)
                      for d in args.precisions.split(",")}
    out = {"model": args.model, "prompt": args.prompt, "repeats": args.repeats,
           "threads": args.threads, "precisions": precisions}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    with one_line_errors("verify_rows.py"):
        sys.exit(main(sys.argv[1:]))
