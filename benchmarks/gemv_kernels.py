"""Batch-small products on SmolLM2-135M's shapes: exitlm's native kernels vs OpenBLAS and torch.

For each weight shape (N x K) and M = 1, 2, 4, 8, 16 rows, one thread: microseconds per call
and GB/s of weight streamed (bytes of the weight in that format, scales included) for
``gemm_f32``, ``gemm_f16``, ``gemm_q8``, ``gemm_q4`` (also with ``int8_activations``: q8a8,
q4a8; q4p / q4pa8: the q4 weight in the 16-row blocks the runtime reads, native.pack_q4), numpy's
``np.dot(x, W.T)`` on a row-major
fp32 W (OpenBLAS; the project's batch-1 path) and ``torch.nn.functional.linear`` fp32. Each
method cycles through a stack of distinct weight copies (>= 48 MB per format) so every call
streams its weight from memory, as in real decoding; methods are interleaved, medians of
``--repeats`` passes (and the best pass, which on a shared machine says more about the kernel
than about the neighbours). Also: ctypes call overhead (a 1 x 32 product), the effect of
``threads=2``, and the crossover between the exact per-row kernels and dequantize + matmul for
many rows. The rows x cost table (per shape, in the JSON as ``rows_x_cost`` and on stderr):
``time(M rows) / time(1 row)`` per precision, the median of that ratio within each pass (the
M's of a pass run interleaved, so the ratio is robust to a shared machine's load) and the
ratio of the best passes. Prints JSON on stdout.

    python benchmarks/gemv_kernels.py [--repeats 7] [--quick] [--rows 1,2,4,8]
        [--methods f32,q8a8] [--shapes qkv,o] [--no-threads] [--no-crossover]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from _bench import note
from exitlm.kernels import native, quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16)
STACK_BYTES = 48 << 20


def _copies(nbytes: int) -> int:
    return max(2, -(-STACK_BYTES // nbytes))


def _time_pass(fn: Callable[[int], object], n: int) -> float:
    """Seconds per call, averaged over one pass through ``n`` weight copies."""
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n


def bench_shape(name: str, n: int, k: int, repeats: int, threads2: bool,
                rows: tuple[int, ...] = ROWS, only: set[str] | None = None) -> dict:
    gen = torch.Generator().manual_seed(0)
    f32_bytes = n * k * 4
    c32 = _copies(f32_bytes)
    w32 = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(c32)]
    w32np = [w.numpy() for w in w32]
    c16 = _copies(f32_bytes // 2)
    w16 = [w32[i % c32].half() if i < c32 else (torch.randn(n, k, generator=gen) * 0.05).half()
           for i in range(c16)]
    base8 = quant.quantize(w32[0], "int8")
    base4 = quant.quantize(w32[0], "int4")
    c8, c4 = _copies(base8.nbytes()), _copies(base4.nbytes())
    q8 = [base8] + [quant.QuantizedWeight("int8", torch.randint(-127, 128, (n, k), generator=gen,
                                                                dtype=torch.int8),
                                          base8.scales.clone(), None) for _ in range(c8 - 1)]
    q4 = [base4] + [quant.QuantizedWeight("int4", torch.randint(0, 256, (n, k // 2), generator=gen,
                                                                dtype=torch.uint8),
                                          base4.scales.clone(), base4.mins.clone())
                    for _ in range(c4 - 1)]
    # the layout the runtime's int4 products read where the build has AVX2 (native.pack_q4)
    q4p = [native.pack_q4(w.q, w.scales, w.kernel_mins()) for w in q4] if native.packs_q4() \
        else []
    q4p_bytes = sum(t.numel() * t.element_size() for t in q4p[0] if t is not None) if q4p else 0
    nbytes = {"numpy_f32": f32_bytes, "torch_f32": f32_bytes, "f32": f32_bytes,
              "f16": f32_bytes // 2, "q8": base8.nbytes(), "q4": base4.nbytes(),
              "q8a8": base8.nbytes(), "q4a8": base4.nbytes(), "q4p": q4p_bytes,
              "q4pa8": q4p_bytes}
    out: dict = {"N": n, "K": k, "weight_bytes": nbytes, "copies": {"f32": c32, "f16": c16,
                                                                    "q8": c8, "q4": c4}}
    # every (M, method) cell timed once per pass, cells of one pass interleaved, so that the
    # rows x cost ratios time(M) / time(1) compare passes taken under the same load
    cells: dict[tuple[int, str], tuple[Callable[[int], object], int]] = {}
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        xnp = x.numpy()
        methods: dict[str, tuple[Callable[[int], object], int]] = {
            "numpy_f32": (lambda i, xnp=xnp: np.dot(xnp, w32np[i].T), c32),
            "torch_f32": (lambda i, x=x: torch.nn.functional.linear(x, w32[i]), c32),
            "f32": (lambda i, x=x: native.gemm_f32(x, w32[i]), c32),
            "f16": (lambda i, x=x: native.gemm_f16(x, w16[i]), c16),
            "q8": (lambda i, x=x: native.gemm_q8(x, q8[i].q, q8[i].scales), c8),
            "q4": (lambda i, x=x: native.gemm_q4(x, q4[i].q, q4[i].scales, q4[i].mins), c4),
            # int8 activations (the native blocks' products by default)
            "q8a8": (lambda i, x=x: native.gemm_q8(x, q8[i].q, q8[i].scales,
                                                   int8_activations=True), c8),
            "q4a8": (lambda i, x=x: native.gemm_q4(x, q4[i].q, q4[i].scales, q4[i].mins,
                                                   int8_activations=True), c4),
        }
        if q4p:  # 16-row blocks: the same bits as q4 / q4a8
            methods.update({
                "q4p": (lambda i, x=x: native.gemm_q4_packed(x, q4p[i], n), c4),
                "q4pa8": (lambda i, x=x: native.gemm_q4_packed(x, q4p[i], n,
                                                               int8_activations=True), c4),
            })
        if threads2 and m in (1, 8):
            methods.update({
                "f32_t2": (lambda i, x=x: native.gemm_f32(x, w32[i], threads=2), c32),
                "f16_t2": (lambda i, x=x: native.gemm_f16(x, w16[i], threads=2), c16),
                "q8_t2": (lambda i, x=x: native.gemm_q8(x, q8[i].q, q8[i].scales, threads=2), c8),
                "q4_t2": (lambda i, x=x: native.gemm_q4(x, q4[i].q, q4[i].scales, q4[i].mins,
                                                   threads=2), c4),
            })
        for key, cell in methods.items():
            if only is None or key.removesuffix("_t2") in only:
                cells[(m, key)] = cell
    times: dict[tuple[int, str], list[float]] = {key: [] for key in cells}
    for fn, c in cells.values():  # warm-up
        _time_pass(fn, min(c, 2))
    for _ in range(repeats):
        for key, (fn, c) in cells.items():
            times[key].append(_time_pass(fn, c))
    for m in rows:
        row = {}
        for (m_, key), ts in times.items():
            if m_ != m:
                continue
            sec, best = statistics.median(ts), min(ts)
            size = nbytes[key.removesuffix("_t2")]
            row[key] = {"us": round(sec * 1e6, 1), "GBps": round(size / sec / 1e9, 2),
                        "best_us": round(best * 1e6, 1), "best_GBps": round(size / best / 1e9, 2)}
        out[f"M={m}"] = row
        note(f"{name} M={m} GB/s median(best): "
             + ", ".join(f"{k_} {v['GBps']}({v['best_GBps']})" for k_, v in row.items()))
    out["rows_x_cost"] = rows_x_cost(times, rows)
    return out


def rows_x_cost(times: dict[tuple[int, str], list[float]], rows: tuple[int, ...]) -> dict:
    """``method -> "M=m" -> {"median", "best"}``: the cost of an M-row product in one-row
    products, ``time(M) / time(1)``: the median over passes of that ratio within a pass, and
    the ratio of the best passes."""
    table: dict = {}
    for (m, key), ts in times.items():
        one = times.get((1, key))
        if m == 1 or one is None or key.endswith("_t2"):
            continue
        ratios = [t / t1 for t, t1 in zip(ts, one, strict=True)]
        table.setdefault(key, {})[f"M={m}"] = {"median": round(statistics.median(ratios), 2),
                                               "best": round(min(ts) / min(one), 2)}
    return table


def cost_table(shapes: dict[str, dict]) -> str:
    """The rows x cost table as text: one line per precision and shape, median (best)."""
    lines = ["rows x cost = time(M rows) / time(1 row), median over passes (best passes):"]
    kinds = ("f32", "f16", "q8", "q8a8", "q4", "q4a8", "q4p", "q4pa8", "numpy_f32", "torch_f32")
    for kind in kinds:
        for shape, res in shapes.items():
            cost = res["rows_x_cost"].get(kind)
            if cost:
                lines.append(f"  {kind:9s} {shape:8s} " + "  ".join(
                    f"{m}: {v['median']:.2f} ({v['best']:.2f})" for m, v in cost.items()))
    return "\n".join(lines)


def ctypes_overhead(calls: int = 20000) -> dict:
    """Per-call cost of a 1 x 32 product: the checked wrapper, a ``native.bind`` callable, the
    bare ctypes call (no checks, no allocation), and torch / numpy for scale."""
    x, w = torch.randn(1, 32), torch.randn(1, 32)
    y = torch.empty(1, 1)
    lib = native.library()
    assert lib is not None
    f = lib.exitlm_gemm_f32
    px, pw, py = x.data_ptr(), w.data_ptr(), y.data_ptr()
    res = {}
    bound = native.bind("f32", w)
    for label, fn in (("wrapper_gemm_f32_us", lambda: native.gemm_f32(x, w)),
                      ("bound_f32_us", lambda: bound(x)),
                      ("bare_ctypes_us", lambda: f(px, pw, py, 1, 1, 32, 1)),
                      ("torch_linear_us", lambda: torch.nn.functional.linear(x, w)),
                      ("numpy_dot_us", lambda: np.dot(x.numpy(), w.numpy().T))):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            best.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
        res[label] = round(statistics.median(best), 2)
    return res


def crossover(repeats: int) -> dict:
    """Exact per-row kernel vs dequantize + F.linear (gate+up 3072 x 576) for many rows."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=gen) * 0.05
    fmt = {"int8": quant.quantize(w, "int8"), "int4": quant.quantize(w, "int4")}
    w16 = w.half()
    res: dict = {}
    for m in (16, 32, 64, 128, 256):
        x = torch.randn(m, 576, generator=gen)
        methods = {
            "q8_kernel": lambda x=x: native.gemm_q8(x, fmt["int8"].q, fmt["int8"].scales),
            "q8_dequant_mm": lambda x=x: torch.nn.functional.linear(x, fmt["int8"].dequantize()),
            "q8a8_kernel": lambda x=x: native.gemm_q8(x, fmt["int8"].q, fmt["int8"].scales,
                                                      int8_activations=True),
            "q4_kernel": lambda x=x: native.gemm_q4(x, fmt["int4"].q, fmt["int4"].scales,
                                                fmt["int4"].mins),
            "q4_dequant_mm": lambda x=x: torch.nn.functional.linear(x, fmt["int4"].dequantize()),
            "f16_kernel": lambda x=x: native.gemm_f16(x, w16),
            "f16_convert_mm": lambda x=x: torch.nn.functional.linear(x, w16.float()),
            "f32_kernel": lambda x=x: native.gemm_f32(x, w),
            "f32_torch": lambda x=x: torch.nn.functional.linear(x, w),
        }
        ts: dict[str, list[float]] = {key: [] for key in methods}
        for _ in range(repeats):
            for key, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                ts[key].append(time.perf_counter() - t0)
        res[f"M={m}"] = {key: round(statistics.median(v) * 1e6, 1) for key, v in ts.items()}
        note(f"crossover M={m}: {res[f'M={m}']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="skip the head and the crossover")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="comma-separated row counts, 1 first (default %(default)s)")
    ap.add_argument("--methods", default="",
                    help="comma-separated subset of f32,f16,q8,q4,q8a8,q4a8,q4p,q4pa8 (q4 in "
                         "16-row blocks, native.pack_q4),numpy_f32,torch_f32")
    ap.add_argument("--no-threads", action="store_true", help="skip the two-thread cells")
    ap.add_argument("--no-crossover", action="store_true", help="skip the crossover")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not native.available():
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    result: dict = {"threads": 1, "repeats": args.repeats,
                    "library": str(native.library_path()),
                    "kernels": native.kernel_path().describe(), "ctypes": ctypes_overhead()}
    note(f"ctypes: {result['ctypes']}")
    shapes = [s for s in args.shapes.split(",") if not (args.quick and s == "head")]
    rows = tuple(int(m) for m in args.rows.split(","))
    if rows[0] != 1:
        sys.exit(f"--rows: the first value must be 1 (the reference of the cost), got {args.rows}")
    only = set(args.methods.split(",")) if args.methods else None
    result["shapes"] = {s: bench_shape(s, *SHAPES[s], args.repeats, not args.no_threads,
                                       rows, only) for s in shapes}
    note(cost_table(result["shapes"]))
    if not (args.quick or args.no_crossover):
        result["crossover_us"] = crossover(args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
