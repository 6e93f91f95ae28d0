"""Two or more builds of exitlm's C kernels against each other, in one process, alternating.

For kernel work: build the library from two source trees (or with two sets of flags), load
both with ctypes and time the same products on the same weights, the builds taking turns (the
order reversed every other pass), so that a shared machine's load hits them alike. The first
build is the baseline of every ratio, and every build's outputs are compared bit for bit with
it (a kernel change must not move a bit).

Two measurements, one thread, SmolLM2-135M's shapes, weights cycled through >= 96 MB of
distinct copies (or a whole model's worth) so they stream from memory as in decoding:

* ``decode``: one "token" - 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) +
  the head 49152x576, distinct weights, one x row: milliseconds per pass (median, best).
* ``rows``: per shape (SmolLM2's by name, or any ``NxK``), M = 1, 2, 4, 8 x rows:
  microseconds per product and the rows x cost ``time(M) / time(1)`` of each build (of the
  median passes, and of the best ones: on a shared machine, another job's load only ever slows
  a pass).

x rows start on a 64-byte line, as the runtime's do (torch's allocator; the native blocks'
scratch): a 512-bit load across two lines costs about two, which an unaligned numpy buffer
would add to every multi-row cell.

    cc -O3 -march=native -ffp-contract=off -fPIC -shared -std=c11 -pthread \\
        -I src/exitlm/kernels -o /tmp/new.so src/exitlm/kernels/*.c -lm
    python benchmarks/kernel_ab.py --libs old=/tmp/old.so,new=/tmp/new.so --kinds f32,q4a8 \\
        [--passes 9] [--rows 1,2,4,8] [--no-decode] [--no-rows]

``--packed NAME``: that build takes the q4 kinds' weights in the 16-row blocks of
``exitlm_gemm_q4p`` (exitlm.kernels.native.pack_q4); ``--libs plain=X.so,packed=X.so --packed
packed`` compares the two layouts in one build.

Prints JSON on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from _bench import machine, note, one_line_errors
from exitlm.args import int_at_least, int_list

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
KINDS = ("f32", "f16", "q8", "q4", "q8a8", "q4a8", "q4_0", "q4_0a8")
"""``q4_0`` / ``q4_0a8``: q4 / q4a8 products of Q4_0 weights, passed without a mins array (the
kernels compute -8 * scale; builds from before ABI 3 cannot take them)."""
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def x_rows(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(m, k) float32 activations whose first row starts on a 64-byte line, as the runtime's
    (torch's allocator aligns to 64 bytes): numpy's own buffers start anywhere 16 bytes apart,
    and a 512-bit tile's x loads that straddle two lines cost ~2x at 4-8 rows (Zen 5)."""
    buf = np.empty(m * k + 16, np.float32)
    start = (-buf.ctypes.data % 64) // 4
    x = buf[start:start + m * k].reshape(m, k)
    x[:] = rng.standard_normal((m, k), dtype=np.float32)
    return x


def _weight(kind: str, n: int, k: int, rng: np.random.Generator
            ) -> tuple[np.ndarray | None, ...]:
    """The arrays after x of ``exitlm_gemm_<kind>`` for an (n, k) weight."""
    if kind == "f32":
        return (rng.standard_normal((n, k), dtype=np.float32),)
    if kind == "f16":
        return (rng.standard_normal((n, k), dtype=np.float32).astype(np.float16),)
    g = k // 32
    scales = rng.random((n, g), dtype=np.float32) * 0.01
    if kind.startswith("q4"):  # float16 values, as GGUF's (pack_q4 keeps them in float16)
        scales = scales.astype(np.float16).astype(np.float32)
    if kind in ("q8", "q8a8"):
        return rng.integers(-127, 128, (n, k), dtype=np.int8), scales
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    if kind.startswith("q4_0"):
        return q, scales, None
    mins = (rng.random((n, g), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
    return q, scales, mins


def _nbytes(arrays: tuple[np.ndarray | None, ...]) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


def pack_q4(w: tuple[np.ndarray | None, ...]) -> tuple[np.ndarray | None, ...]:
    """A q4 weight ``(q, scales, mins)`` in exitlm_gemm_q4p's 16-row blocks (the layout of
    exitlm.kernels.native.pack_q4), with its row count last."""
    q, scales, mins = w
    n, kh = q.shape
    blocks, g = -(-n // 16), kh // 16

    def in_blocks(a: np.ndarray) -> np.ndarray:
        a = np.concatenate([a, np.repeat(a[-1:], blocks * 16 - n, 0)])
        return a.reshape(blocks, 16, a.shape[1])

    qp = np.ascontiguousarray(in_blocks(q).reshape(blocks, 16, g, 4, 4).transpose(0, 2, 3, 1, 4))
    floats = [a for a in (scales, mins) if a is not None]
    if all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in floats):
        floats = [a.astype(np.float16) for a in floats]  # (float16 scales, as pack_q4)
    sp, *mp = (np.ascontiguousarray(in_blocks(a).transpose(0, 2, 1)) for a in floats)
    return qp, sp, (mp[0] if mp else None), np.array(n)


def _call(lib: ctypes.CDLL, kind: str, x: np.ndarray, w: tuple[np.ndarray | None, ...],
          y: np.ndarray) -> None:
    m, k = x.shape
    n = w[0].shape[0]
    name = kind.replace("q4_0", "q4")
    half: tuple[ctypes.c_int, ...] = ()
    if len(w) == 4:  # pack_q4's
        n, half = int(w[3]), (ctypes.c_int(int(w[1].dtype == np.float16)),)
        w, name = w[:3], name.replace("q4", "q4p")
    fn = getattr(lib, f"exitlm_gemm_{name}")
    rc = fn(x.ctypes.data_as(_P), *(_P(None) if a is None else a.ctypes.data_as(_P) for a in w),
            *half, y.ctypes.data_as(_P), _I64(m), _I64(n), _I64(k), 1)
    if rc != 0:
        raise RuntimeError(f"exitlm_gemm_{kind} returned {rc}")


def _orders(names: list[str], passes: int) -> list[list[str]]:
    return [names if p % 2 == 0 else names[::-1] for p in range(passes)]


def _layouts(libs: dict[str, ctypes.CDLL], packed: set[str], kind: str,
             weights: list[tuple[np.ndarray | None, ...]]
             ) -> dict[str, list[tuple[np.ndarray | None, ...]]]:
    """Each build's copy of ``weights``: pack_q4's for the builds in ``packed`` (q4 kinds)."""
    if not kind.startswith("q4") or not packed & set(libs):
        return {name: weights for name in libs}
    blocked = [pack_q4(w) for w in weights]
    return {name: blocked if name in packed else weights for name in libs}


def decode_pass(libs: dict[str, ctypes.CDLL], kind: str, passes: int,
                rng: np.random.Generator, packed: frozenset[str] = frozenset()
                ) -> dict[str, Any]:
    """One-row products over a model's worth of distinct weights, per build."""
    layer = ("qkv", "o", "gate_up", "down")
    shapes = [SHAPES[s] for s in layer] * 30 + [SHAPES["head"]]
    weights = [_weight(kind, n, k, rng) for n, k in shapes]
    mine = _layouts(libs, set(packed), kind, weights)
    xs = {k: x_rows(1, k, rng) for k in (576, 1536)}
    outs = [np.empty((1, n), np.float32) for n, _ in shapes]
    times: dict[str, list[float]] = {n: [] for n in libs}
    first: dict[str, list[np.ndarray]] = {}
    for order in _orders(list(libs), passes):
        for name in order:
            t0 = time.perf_counter()
            for (_, k), w, y in zip(shapes, mine[name], outs, strict=True):
                _call(libs[name], kind, xs[k], w, y)
            times[name].append((time.perf_counter() - t0) * 1e3)
            first.setdefault(name, [y.copy() for y in outs])
    base = next(iter(libs))
    res: dict[str, Any] = {"bytes": sum(_nbytes(w) for w in weights)}
    for name, t in times.items():
        res[name] = {
            "ms_median": round(statistics.median(t), 2), "ms_best": round(min(t), 2),
            "vs_first_median": round(statistics.median(t) / statistics.median(times[base]), 3),
            "vs_first_best": round(min(t) / min(times[base]), 3),
            "same_bits": all(np.array_equal(a, b) for a, b in zip(first[name], first[base],
                                                                     strict=True)),
        }
    return res


def shape_of(name: str) -> tuple[int, int] | None:
    """(N, K) of a named SmolLM2 shape or of ``NxK``, else None."""
    if name in SHAPES:
        return SHAPES[name]
    m = re.fullmatch(r"(\d+)x(\d+)", name)
    if m is None or int(m[1]) < 1 or int(m[2]) < 1:
        return None
    return int(m[1]), int(m[2])


def rows_pass(libs: dict[str, ctypes.CDLL], kind: str, shape: str, rows: list[int],
              passes: int, rng: np.random.Generator, packed: frozenset[str] = frozenset()
              ) -> dict[str, Any]:
    """Microseconds per product and rows x cost for M in ``rows``, per build."""
    n, k = shape_of(shape)  # type: ignore[misc]
    one = _weight(kind, n, k, rng)
    copies = max(2, (96 << 20) // _nbytes(one))
    weights = [one] + [_weight(kind, n, k, rng) for _ in range(copies - 1)]
    mine = _layouts(libs, set(packed), kind, weights)
    xs = {m: x_rows(m, k, rng) for m in rows}
    us: dict[str, dict[int, list[float]]] = {name: {m: [] for m in rows} for name in libs}
    outs: dict[str, dict[int, np.ndarray]] = {name: {} for name in libs}
    for order in _orders(list(libs), passes):
        for name in order:
            for m in rows:
                y = np.empty((m, n), np.float32)
                t0 = time.perf_counter()
                for w in mine[name]:
                    _call(libs[name], kind, xs[m], w, y)
                us[name][m].append((time.perf_counter() - t0) / len(weights) * 1e6)
                outs[name].setdefault(m, y.copy())
    base = next(iter(libs))
    res: dict[str, Any] = {}
    for name in libs:
        med = {m: statistics.median(us[name][m]) for m in rows}
        best = {m: min(us[name][m]) for m in rows}
        res[name] = {
            "us_median": {m: round(med[m], 1) for m in rows},
            "us_best": {m: round(best[m], 1) for m in rows},
            "rows_x_cost": {m: round(med[m] / med[rows[0]], 2) for m in rows[1:]},
            "rows_x_cost_best": {m: round(best[m] / best[rows[0]], 2) for m in rows[1:]},
            "same_bits": all(np.array_equal(outs[name][m], outs[base][m]) for m in rows),
        }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", required=True,
                    help="comma-separated name=path.so; the first is the baseline")
    ap.add_argument("--kinds", default="f32,f16,q8a8,q4a8",
                    help=f"comma-separated subset of {list(KINDS)}")
    ap.add_argument("--passes", type=int_at_least(1), default=9)
    ap.add_argument("--rows", type=int_list, default=[1, 2, 4, 8],
                    help="row counts of the rows pass, 1 first (default 1,2,4,8)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="shapes of the rows pass: names or NxK (K a multiple of 32 for the "
                         "grouped kinds), e.g. layerskip-code's 768x256,256x256,1376x256,256x688")
    ap.add_argument("--narrow-rows", default="",
                    help="comma-separated name=N: that AVX-512 build runs its products of up to "
                         "N rows on its 256-bit tiles (0: none; exitlm_set_narrow_rows; "
                         "default: its choice for this CPU). A path named twice is loaded from "
                         "a copy, so each name keeps its own setting")
    ap.add_argument("--packed", default="",
                    help="comma-separated names from --libs whose q4 products take the weights "
                         "packed in 16-row blocks (exitlm_gemm_q4p, ABI 7 and later)")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-rows", action="store_true")
    args = ap.parse_args(argv)
    pairs = [p.split("=", 1) for p in args.libs.split(",") if p]
    if not pairs or any(len(p) != 2 for p in pairs):
        ap.error("--libs: expected name=path.so[,name=path.so...]")
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: unknown {bad}; choose from {list(KINDS)}")
    rows = args.rows
    if not rows or rows[0] != 1 or min(rows) < 1:
        ap.error("--rows: expected positive row counts starting with 1, e.g. 1,2,4,8")
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if shape_of(s) is None]
    if bad:
        ap.error(f"--shapes: {bad}: expected names from {list(SHAPES)} or NxK")
    if not args.no_rows and any(k not in ("f32", "f16") for k in kinds):
        odd = [s for s in shapes if shape_of(s)[1] % 32]  # type: ignore[index]
        if odd:
            ap.error(f"--shapes: {odd}: the grouped kinds need K a multiple of 32")
    narrow = [p.split("=", 1) for p in args.narrow_rows.split(",") if p]
    names = {name for name, _ in pairs}
    if any(len(p) != 2 or p[0] not in names or not p[1].isdigit() or int(p[1]) > 2**20
           for p in narrow):
        ap.error(f"--narrow-rows: expected name=N (N rows, 0 or more) for names in --libs "
                 f"{sorted(names)}")
    packed = frozenset(p for p in args.packed.split(",") if p)
    if packed - names:
        ap.error(f"--packed: {sorted(packed - names)}: not names in --libs {sorted(names)}")
    libs = {}
    seen: set[str] = set()
    copies = tempfile.TemporaryDirectory(prefix="kernel_ab_")
    for name, path in pairs:
        if not os.path.isfile(path):
            ap.error(f"--libs: {path}: no such file")
        real = os.path.realpath(path)
        if real in seen:  # dlopen would hand back the same library, globals and all
            real = shutil.copy(real, os.path.join(copies.name, f"{name}.so"))
        seen.add(os.path.realpath(path))
        libs[name] = ctypes.CDLL(real)
        if name in packed and not hasattr(libs[name], "exitlm_gemm_q4p"):
            ap.error(f"--packed: {name}: {path} has no exitlm_gemm_q4p (a build before ABI 7)")
    settings = {}
    for name, rows_n in narrow:
        fn = getattr(libs[name], "exitlm_set_narrow_rows", None)
        if fn is None or fn(int(rows_n)) < 0:
            ap.error(f"--narrow-rows: {name}: that build has no 512-bit tiles to narrow")
    for name, lib in libs.items():
        fn = getattr(lib, "exitlm_set_narrow_rows", None)
        settings[name] = None if fn is None or fn(-1) < 0 else int(fn(-1))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "libs": dict(pairs), "packed": sorted(packed), "narrow_rows": settings,
        "passes": args.passes, "threads": 1,
        **machine(),
        "decode": {}, "rows": {},
    }
    for kind in kinds:
        if not args.no_decode:
            note(f"{kind}: decode-like pass")
            out["decode"][kind] = decode_pass(libs, kind, args.passes, rng, packed)
            note(f"  {json.dumps(out['decode'][kind])}")
        if not args.no_rows:
            out["rows"][kind] = {}
            for shape in shapes:
                note(f"{kind} {shape}: rows {rows}")
                out["rows"][kind][shape] = rows_pass(libs, kind, shape, rows, args.passes, rng,
                                                     packed)
                note(f"  {json.dumps(out['rows'][kind][shape])}")
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    with one_line_errors("kernel_ab"):
        sys.exit(main())
