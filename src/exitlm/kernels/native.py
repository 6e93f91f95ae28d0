"""The native products of ``kernels.c`` (loaded by :mod:`exitlm.kernels.loader`) with checks.

Each ``gemm_*`` computes ``y[..., n] = sum_k x[..., k] * W[n, k]`` for a float32 ``x`` of shape
``(..., K)`` and returns float32 ``(..., N)``. With the native library the value of every output
element is a fixed function of its row of ``x`` and its row of ``W`` (a fixed summation order,
see ``kernels.c``): the same bits whatever the number of rows in the call, whatever
``threads`` is and whatever instruction set the loaded build uses. Decoders rely on this to
make 1-row decoding and k-row draft verification give identical tokens.

How the library is built, chosen and loaded (installed per-ISA builds, ``EXITLM_NATIVE``):
:mod:`exitlm.kernels.loader`. Without it every function falls back to a torch reference path
(same values up to rounding, but *not* row-invariant: BLAS may change its blocking with the
number of rows).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import torch

from exitlm.env import OFF, switched_off
from exitlm.errors import warn
from exitlm.kernels import loader

__all__ = [
    "BoundGemm",
    "available",
    "bind",
    "bind_q4_packed",
    "forget",
    "gemm_f16",
    "gemm_f32",
    "gemm_q4",
    "gemm_q4_packed",
    "gemm_q8",
    "int8_activations",
    "kernel_path",
    "library",
    "library_path",
    "narrow_rows",
    "pack_q4",
    "packs_q4",
    "set_int8_activations",
    "set_narrow_rows",
    "unavailable_reason",
]

_ON = ("1", "true", "yes", "on", "")


def _env_int8_activations() -> bool:
    """``EXITLM_INT8_ACTIVATIONS`` (default on); a value that is neither on nor off warns and
    counts as on."""
    raw = os.environ.get("EXITLM_INT8_ACTIVATIONS", "1")
    value = raw.strip().lower()
    if value in OFF:
        return False
    if value not in _ON:
        warn(f"EXITLM_INT8_ACTIVATIONS={raw!r}: expected 1 or 0 (on/off, true/false, yes/no); "
             "keeping int8 activations on")
    return True


def int8_activations() -> bool:
    """Whether the fused native blocks (``block.c``) multiply int8/int4 weights with their
    activations rounded to int8 in groups of 32 (:func:`gemm_q8` / :func:`gemm_q4` with
    ``int8_activations=True``), as llama.cpp does for Q8_0/Q4_x weights. On by default;
    ``EXITLM_INT8_ACTIVATIONS=0`` or :func:`set_int8_activations` turn it off (float32
    activations: slower, closer to the dequantized weights). The native runtime's heads follow
    it too (its exit heads and LM head, ``block.c``'s draft chains and segments:
    :meth:`exitlm.runtime.native.NativeRunner.project`), since their inputs come from the
    row-invariant native blocks; :func:`exitlm.kernels.quant.qlinear` called without
    ``int8_activations`` (the eager model's quantized layers, whose inputs torch computes)
    keeps float32 activations, where rounding would magnify a last-bit difference into a
    quantization step. False without the library."""
    lib = _load()
    return bool(lib is not None and lib.exitlm_int8_activations())


def set_int8_activations(on: bool) -> bool:
    """Switch int8 activations of the native blocks (:func:`int8_activations`) for this
    process; returns the previous setting. Process-wide on purpose: plain steps and draft
    verification must round alike for the lossless decoders to stay token-identical, so
    switch it before decoding, not during. Also sets ``EXITLM_INT8_ACTIVATIONS`` in this
    process's environment, which the worker processes it spawns later read."""
    lib = _load()
    if lib is None:
        return False
    # processes started from now on (PPD and pipeline workers, spawned) round alike
    os.environ["EXITLM_INT8_ACTIVATIONS"] = "1" if on else "0"
    return bool(lib.exitlm_set_int8_activations(int(bool(on))))


def narrow_rows() -> int | None:
    """The most x rows whose products the loaded AVX-512 build runs on its 256-bit tiles rather
    than its 512-bit ones (``narrow_rows`` in ``prefetch.c``; 0: none): chosen at load from the
    CPU - 2 on AMD family 25 (Zen 4), whose AVX-512 executes each 512-bit operation as two
    256-bit halves, so decoding's one-row steps and two-row verifications or batches take the
    narrow tiles there. None without the library or in a build without 512-bit tiles. Either
    way every product has the same bits; only its speed changes."""
    lib = _load()
    if lib is None:
        return None
    rows = lib.exitlm_set_narrow_rows(-1)
    return None if rows < 0 else int(rows)


def set_narrow_rows(rows: int) -> int | None:
    """Set :func:`narrow_rows` for this process (benchmarks comparing the two tile widths);
    returns the previous value, or None where there is nothing to set."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= 2**20:
        raise ValueError(f"narrow rows: expected a whole number of rows from 0, got {rows!r}")
    lib = _load()
    if lib is None:
        return None
    before = lib.exitlm_set_narrow_rows(rows)
    return None if before < 0 else int(before)


def _load() -> ctypes.CDLL | None:
    """The loaded library, or None (the reason is in :func:`unavailable_reason`)."""
    if _f32 is not None:
        return loader.library()
    lib = loader.library()
    if lib is not None:
        lib.exitlm_set_int8_activations(int(_env_int8_activations()))
        _bind_fast(lib)
    return lib


def forget() -> None:
    """Forget the loaded library, so that the next call finds and loads it again under the
    environment of that moment (tests switching ``EXITLM_NATIVE``)."""
    global _f32, _f16, _q8, _q4, _q8a8, _q4a8, _q4p, _q4pa8
    loader.reset()
    _f32 = _f16 = _q8 = _q4 = _q8a8 = _q4a8 = _q4p = _q4pa8 = None


def available() -> bool:
    """Whether the native library is loaded (finds and loads it on first call)."""
    return _load() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    _load()
    path = loader.kernel_path()
    return "" if path.backend == "native" else f"native kernels unavailable: {path.reason}"


def kernel_path() -> loader.KernelPath:
    """Which kernels run and why (:class:`exitlm.kernels.loader.KernelPath`)."""
    _load()
    return loader.kernel_path()


def library() -> ctypes.CDLL | None:
    """The loaded library, every signature declared (None without one)."""
    return _load()


def library_path() -> Path | None:
    """Path of the loaded shared library (None without one)."""
    path = kernel_path().library
    return Path(path) if path else None


# Bound C functions (set by _bind_fast) - module globals keep the per-call lookups minimal.
_f32 = _f16 = _q8 = _q4 = _q8a8 = _q4a8 = _q4p = _q4pa8 = None


def _bind_fast(lib: ctypes.CDLL) -> None:
    """Publish the bound functions as module globals (one global lookup per call)."""
    global _f32, _f16, _q8, _q4, _q8a8, _q4a8, _q4p, _q4pa8
    _f32, _f16, _q8, _q4 = lib.exitlm_gemm_f32, lib.exitlm_gemm_f16, lib.exitlm_gemm_q8, \
        lib.exitlm_gemm_q4
    _q8a8, _q4a8 = lib.exitlm_gemm_q8a8, lib.exitlm_gemm_q4a8
    _q4p, _q4pa8 = lib.exitlm_gemm_q4p, lib.exitlm_gemm_q4pa8


_F32, _F16, _I8, _U8 = torch.float32, torch.float16, torch.int8, torch.uint8


def _bad(name: str, what: str, t: object, dtype: torch.dtype, shape: str) -> ValueError:
    """The error for a tensor argument that is not a contiguous CPU ``dtype`` of ``shape``."""
    if not isinstance(t, torch.Tensor):
        return ValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        return ValueError(f"{name}: {what} must be {dtype}, got {t.dtype}")
    if not t.is_cpu:
        return ValueError(f"{name}: {what} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        return ValueError(f"{name}: {what} must be contiguous (call .contiguous())")
    return ValueError(f"{name}: {what} must have shape {shape}, got {tuple(t.shape)}")


def _w2(t: torch.Tensor, dtype: torch.dtype, name: str, what: str) -> tuple[int, int]:
    """(N, C) of a 2-D contiguous CPU weight tensor of ``dtype`` (ValueError otherwise)."""
    if (type(t) is not torch.Tensor or t.dtype != dtype or t.dim() != 2 or not t.is_cpu
            or not t.is_contiguous()):
        raise _bad(name, what, t, dtype, "(N, K)")
    n, c = t.shape
    return n, c


def _aux(t: torch.Tensor, n: int, g: int, name: str, what: str) -> None:
    """Check a float32 (N, K/32) scales / mins tensor."""
    if (type(t) is not torch.Tensor or t.dtype != _F32 or not t.is_cpu
            or not t.is_contiguous() or t.shape != (n, g)):
        raise _bad(name, what, t, _F32, f"({n}, {g})")


def _rows(x: torch.Tensor, k: int, name: str) -> int:
    """Rows M of a contiguous CPU float32 x (..., K) (ValueError otherwise)."""
    if (type(x) is not torch.Tensor or x.dtype != _F32 or not x.is_cpu or not x.is_contiguous()
            or x.dim() < 1 or x.shape[-1] != k):
        raise _bad(name, "x", x, _F32, f"(..., {k})")
    return x.numel() // k if k else 0


def _groups(k: int, name: str) -> int:
    """Number of 32-element groups along K (ValueError unless K is a positive multiple of 32)."""
    if k % 32 != 0 or k == 0:
        raise ValueError(f"{name}: K must be a positive multiple of 32, got {k}")
    return k // 32


def _threads(threads: int, name: str) -> None:
    """ValueError unless ``threads`` is a positive int."""
    if type(threads) is not int or threads < 1:
        raise ValueError(f"{name}: threads must be a positive int, got {threads!r}")


def _out(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Uninitialised float32 output ``(..., N)`` for ``x (..., K)`` with ``m`` rows."""
    if x.dim() == 2:
        return torch.empty(m, n)
    return torch.empty((*x.shape[:-1], n))


def gemm_f32(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x (..., K) float32 @ w.T`` for a float32 row-major ``w (N, K)`` -> ``(..., N)``."""
    n, k = _w2(w, _F32, "gemm_f32", "w")
    m = _rows(x, k, "gemm_f32")
    _threads(threads, "gemm_f32")
    if _f32 is None and _load() is None:
        return torch.nn.functional.linear(x, w)
    y = _out(x, m, n)
    _f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y


def gemm_f16(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x (..., K) float32 @ w.T`` for a float16 row-major ``w (N, K)`` (converted exactly to
    float32 in registers) -> float32 ``(..., N)``."""
    n, k = _w2(w, _F16, "gemm_f16", "w")
    m = _rows(x, k, "gemm_f16")
    _threads(threads, "gemm_f16")
    if _f16 is None and _load() is None:
        return torch.nn.functional.linear(x, w.float())
    y = _out(x, m, n)
    _f16(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y


def gemm_q8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, threads: int = 1, *,
            int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = q[n, k] * scales[n, k // 32]`` (int8 ``q (N, K)``, float32
    ``scales (N, K/32)``; Q8_0 groups) -> float32 ``(..., N)``.

    ``int8_activations``: round each row of ``x`` to int8 in groups of 32 first and take integer
    dot products (``kernels.c`` q8a8, llama.cpp's Q8_0 x Q8_0; still row-invariant). Without
    the native library the fallback keeps float32 activations."""
    n, k = _w2(q, _I8, "gemm_q8", "q")
    g = _groups(k, "gemm_q8")
    _aux(scales, n, g, "gemm_q8", "scales")
    m = _rows(x, k, "gemm_q8")
    _threads(threads, "gemm_q8")
    if _q8 is None and _load() is None:
        w = (q.float().view(n, g, 32) * scales.unsqueeze(-1)).view(n, k)
        return torch.nn.functional.linear(x, w)
    y = _out(x, m, n)
    (_q8a8 if int8_activations else _q8)(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                         y.data_ptr(), m, n, k, threads)
    return y


def gemm_q4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            threads: int = 1, *, int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = nibble[n, k] * scales[n, g] + mins[n, g]``, ``g = k // 32``
    (Q4_1 groups) -> float32 ``(..., N)``. ``mins=None`` is Q4_0: ``mins = -8 * scales``, which
    the kernels compute instead of reading an array (the same floats, the same bits; a fifth
    fewer bytes streamed per product).

    ``q`` is uint8 ``(N, K/2)``: group g of a row is bytes ``[16g, 16g + 16)``; byte j holds
    element j of the group in its low nibble and element j + 16 in its high nibble (GGUF order).
    ``int8_activations`` as in :func:`gemm_q8` (the ``min`` term keeps float32 sums of ``x``).
    """
    n, kh = _w2(q, _U8, "gemm_q4", "q")
    k = 2 * kh
    g = _groups(k, "gemm_q4")
    _aux(scales, n, g, "gemm_q4", "scales")
    if mins is not None:
        _aux(mins, n, g, "gemm_q4", "mins")
    m = _rows(x, k, "gemm_q4")
    _threads(threads, "gemm_q4")
    if _q4 is None and _load() is None:
        return torch.nn.functional.linear(x, unpack_q4(q, scales, mins))
    y = _out(x, m, n)
    (_q4a8 if int8_activations else _q4)(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                         0 if mins is None else mins.data_ptr(), y.data_ptr(),
                                         m, n, k, threads)
    return y


Q4_BLOCK = 16
"""W rows per block of the packed q4 layout (:func:`pack_q4`)."""

Q4Packed = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""A q4 weight in :func:`pack_q4`'s layout: ``(q, scales, mins or None)``."""


def packs_q4() -> bool:
    """Whether the loaded library reads q4 weights in 16-row blocks (:func:`pack_q4`; the
    builds with AVX2, whose W-rows-in-lanes tiles read them) and ``EXITLM_Q4_PACKED`` is not
    off (``0``: keep int4 weights in one copy, the plain layout)."""
    if switched_off("EXITLM_Q4_PACKED"):
        return False  # (the plain layout only: no second copy of the int4 weights)
    lib = _load()
    return lib is not None and bool(lib.exitlm_has_avx2())


def pack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> Q4Packed:
    """A q4 weight (:func:`gemm_q4`'s layout) in the layout ``exitlm_gemm_q4p`` reads: rows in
    blocks of :data:`Q4_BLOCK` (the last padded with copies of row N - 1); per block and group,
    its 16 rows' bytes ``4c .. 4c + 3`` side by side for c = 0..3 (uint8 ``(B, G, 4, 16, 4)``)
    and its 16 rows' scales (mins) side by side (``(B, G, 16)``): float16 when every scale and
    min is exactly a float16 (GGUF's are; the kernels widen them back to the same float32),
    else float32. Decoding one token streams every weight once, so on a core whose memory
    bandwidth bounds it the 10% fewer bytes of float16 scales are 10% less time.

    What the W-rows-in-lanes tiles build in registers from the plain layout (a 4 x 4
    transposition of dwords per group and tile, one of the scales per tile; lanes.c) is done
    once here, so that a tile reads one forward stream with plain loads
    (docs/measurements/q4_packed_2026-12-03.md). The same operands meet in the same
    operations, so the products give the same bits as on the plain layout. It is a second
    copy of the weight: the plain one stays for lookups, saving and the torch paths."""
    n, kh = q.shape
    g = kh // 16
    blocks = -(-n // Q4_BLOCK)
    pad = blocks * Q4_BLOCK - n

    def in_blocks(t: torch.Tensor) -> torch.Tensor:
        if pad:
            t = torch.cat([t, t[-1:].expand(pad, -1)])
        return t.reshape(blocks, Q4_BLOCK, t.shape[1])

    qp = in_blocks(q).reshape(blocks, Q4_BLOCK, g, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    floats = [scales] if mins is None else [scales, mins]
    if all(torch.equal(t.half().float(), t) for t in floats):
        floats = [t.half() for t in floats]
    sp, *mp = (in_blocks(t).permute(0, 2, 1).contiguous() for t in floats)
    return qp, sp, (mp[0] if mp else None)


def _packed_k(packed: Q4Packed, n: int, name: str) -> int:
    """K of a :func:`pack_q4` weight of ``n`` rows, its tensors checked."""
    qp, sp, mp = packed
    if qp.dtype != _U8 or qp.dim() != 5 or tuple(qp.shape[2:]) != (4, Q4_BLOCK, 4):
        raise ValueError(f"{name}: q must be pack_q4's uint8 (B, G, 4, {Q4_BLOCK}, 4), got "
                         f"{qp.dtype} {tuple(qp.shape)}")
    blocks, g = qp.shape[0], qp.shape[1]
    if not (blocks - 1) * Q4_BLOCK < n <= blocks * Q4_BLOCK:
        raise ValueError(f"{name}: n={n} rows do not fit the {blocks} blocks of q")
    for what, t in (("q", qp), ("scales", sp), ("mins", mp)):
        if t is None:
            continue
        if ((t is not qp and (t.dtype not in (_F32, _F16) or t.dtype != sp.dtype
                             or tuple(t.shape) != (blocks, g, Q4_BLOCK)))
                or not t.is_contiguous() or not t.is_cpu):
            raise ValueError(f"{name}: {what} must be pack_q4's contiguous CPU tensor")
    return 32 * g


def gemm_q4_packed(x: torch.Tensor, packed: Q4Packed, n: int, threads: int = 1, *,
                   int8_activations: bool = False) -> torch.Tensor:
    """:func:`gemm_q4` of a weight of ``n`` rows packed by :func:`pack_q4`: the same bits.
    Needs a library that :func:`packs_q4`."""
    k = _packed_k(packed, n, "gemm_q4_packed")
    m = _rows(x, k, "gemm_q4_packed")
    _threads(threads, "gemm_q4_packed")
    if not packs_q4():
        raise RuntimeError("gemm_q4_packed: the native library that reads packed q4 weights "
                           f"is not loaded ({unavailable_reason() or 'a build without AVX2'})")
    qp, sp, mp = packed
    y = _out(x, m, n)
    (_q4pa8 if int8_activations else _q4p)(x.data_ptr(), qp.data_ptr(), sp.data_ptr(),
                                           0 if mp is None else mp.data_ptr(),
                                           int(sp.dtype is _F16), y.data_ptr(), m, n, k, threads)
    return y


class BoundGemm:
    """One of the ``gemm_*`` products with its weight checked and its pointers taken once.

    ``bound(x, threads=1)`` returns the same bits as the ``gemm_*`` call it stands for, with only
    ``x`` checked per call (the per-call Python work of a decoding step's many small products);
    ``int8_activations=True`` stands for the call with ``int8_activations=True`` (quantized
    kinds only; the float kinds have no such product and ignore it). It keeps references to
    the weight tensors, so their storage stays valid; do not resize them.
    """

    __slots__ = ("_fn", "_fn8", "_keep", "_ptrs", "_ref", "k", "kind", "n")

    def __init__(self, kind: str, tensors: tuple[torch.Tensor | None, ...], n: int, k: int,
                 ref: Callable[..., torch.Tensor]) -> None:
        self.kind, self.n, self.k = kind, n, k
        self._keep = tensors
        self._ref = ref
        lib = _load()
        self._fn = None if lib is None else getattr(lib, f"exitlm_gemm_{kind}")
        # the same product with int8 activations (q8a8, q4a8, q4pa8: the same signatures)
        self._fn8 = (None if lib is None or kind in ("f32", "f16")
                     else getattr(lib, f"exitlm_gemm_{kind}a8"))
        self._ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)

    def __call__(self, x: torch.Tensor, threads: int = 1,
                 int8_activations: bool = False) -> torch.Tensor:
        """``x (..., K) float32 -> (..., N) float32`` (``threads`` a positive int)."""
        if self._fn is None:
            return self._ref(x, *self._keep, threads=threads)
        n, k = self.n, self.k
        m = _rows(x, k, self.kind)
        y = torch.empty(m, n) if x.dim() == 2 else _out(x, m, n)
        fn = self._fn8 if int8_activations and self._fn8 is not None else self._fn
        fn(x.data_ptr(), *self._ptrs, y.data_ptr(), m, n, k, threads)
        return y


def bind(kind: str, *weights: torch.Tensor | None) -> BoundGemm:
    """Check a weight once and return a fast callable: ``bind("f32", w)``, ``bind("f16", w)``,
    ``bind("q8", q, scales)``, ``bind("q4", q, scales, mins)`` (formats as in ``gemm_*``; q4's
    ``mins`` may be None: Q4_0)."""
    if kind in ("f32", "f16"):
        if len(weights) != 1:
            raise ValueError(f"bind({kind!r}): pass the weight (N, K)")
        n, k = _w2(weights[0], _F32 if kind == "f32" else _F16, f"bind({kind!r})", "w")
        return BoundGemm(kind, weights, n, k, gemm_f32 if kind == "f32" else gemm_f16)
    if kind == "q8":
        if len(weights) != 2:
            raise ValueError("bind('q8'): pass q and scales")
        n, k = _w2(weights[0], _I8, "bind('q8')", "q")
        _aux(weights[1], n, _groups(k, "bind('q8')"), "bind('q8')", "scales")
        return BoundGemm(kind, weights, n, k, gemm_q8)
    if kind == "q4":
        if len(weights) != 3:
            raise ValueError("bind('q4'): pass q, scales and mins")
        n, kh = _w2(weights[0], _U8, "bind('q4')", "q")
        g = _groups(2 * kh, "bind('q4')")
        _aux(weights[1], n, g, "bind('q4')", "scales")
        if weights[2] is not None:
            _aux(weights[2], n, g, "bind('q4')", "mins")
        return BoundGemm(kind, weights, n, 2 * kh, gemm_q4)
    raise ValueError(f"bind: kind must be 'f32', 'f16', 'q8' or 'q4', got {kind!r}")


def bind_q4_packed(packed: Q4Packed, n: int) -> BoundGemm:
    """:func:`bind` for a weight of ``n`` rows packed by :func:`pack_q4` (the same bits as
    ``bind("q4", ...)`` of the plain weight); needs a library that :func:`packs_q4`."""
    k = _packed_k(packed, n, "bind_q4_packed")

    def ref(x: torch.Tensor, *_: object, threads: int = 1) -> torch.Tensor:
        return gemm_q4_packed(x, packed, n, threads)

    bound = BoundGemm("q4p", packed, n, k, ref)
    qp, sp, mp = packed
    bound._ptrs = (qp.data_ptr(), sp.data_ptr(), 0 if mp is None else mp.data_ptr(),
                   int(sp.dtype is _F16))
    return bound


def q4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Packed Q4 ``(N, K/2)`` (see :func:`gemm_q4`) as its nibbles ``(N, K/32, 32)`` uint8, in
    element order: each group's low nibbles, then its high ones."""
    n, kh = q.shape
    b = q.view(n, kh // 16, 16)
    return torch.cat((b & 15, b >> 4), dim=-1)


def unpack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize packed Q4 (see :func:`gemm_q4`; ``mins=None``: ``-8 * scales``) to
    ``(N, K)``: ``nibble * scale + min`` computed in float32 (a multiply then an add, each
    rounded)."""
    if mins is None:
        mins = scales * -8.0
    n, kh = q.shape
    w = q4_nibbles(q).float() * scales.unsqueeze(-1) + mins.unsqueeze(-1)
    return w.view(n, 2 * kh).to(dtype)
