"""Quantized weight formats (groups of 32 along K) and the products that use them.

* ``int8`` (Q8_0-like): ``W[n, k] = q[n, k] * scales[n, k // 32]``, ``q`` int8 ``(N, K)``,
  ``d = absmax / 127`` per group, ``q = round(w / d)``.
* ``int4`` (Q4_1-like): ``W[n, k] = nibble[n, k] * scales[n, g] + mins[n, g]``, ``q`` uint8
  ``(N, K // 2)``: group g of a row is bytes ``[16g, 16g + 16)``, byte j holds element j of the
  group in its low nibble and element j + 16 in its high nibble (GGUF Q4_0/Q4_1 block order).
  ``d = (max - min) / 15``, ``q = round((w - min) / d)`` clamped to ``[0, 15]``. Q4_0 weights
  load as ``mins = -8 * scales``; the native kernels then read no mins (they compute them,
  :meth:`QuantizedWeight.kernel_mins`).

The products here take float32 activations, rounded to int8 in groups of 32 only where the
caller asks (``int8_activations``: the fused native blocks and the native runtime's heads, see
:func:`exitlm.kernels.native.int8_activations`). :func:`qlinear` and :func:`dense_linear`
use the native kernels of :mod:`exitlm.kernels.native` for fewer than :data:`ROW_THRESHOLD`
rows: there every output is a fixed function of its row of ``x`` and row of ``W`` (same bits
for 1 row or 16, for 1 thread or 2), which is what makes plain decoding and draft verification
token-identical. From ``ROW_THRESHOLD`` rows on (prefills), and whenever the native library is
unavailable, they dequantize and call ``torch.nn.functional.linear`` - faster there, but *not*
row-invariant.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from exitlm.kernels import native
from exitlm.kernels.versions import version_of

__all__ = [
    "GROUP",
    "QUANT_KINDS",
    "ROW_THRESHOLD",
    "QuantizedWeight",
    "dense_linear",
    "embedding_rows",
    "qlinear",
    "quantize",
]

QUANT_KINDS = ("int8", "int4")
GROUP = 32
# Rows from which qlinear / dense_linear switch to dequantize + BLAS matmul; below it the exact
# per-row kernels are used. benchmarks/gemv_kernels.py "crossover_us" (3072 x 576, one thread,
# AVX2 EPYC): at 64 rows the kernels were 0-18% faster, at 128 dequantize + matmul was 8-26%
# faster (q8/q4; f32/f16 similar), at 256 1.3-2.2x faster; the crossover lies between.
ROW_THRESHOLD = 96


_PACKED: dict[int, tuple[weakref.ref, tuple, native.Q4Packed]] = {}
"""The packed copies of int4 weights (:meth:`QuantizedWeight.kernel_packed`) by the ``id`` of
their ``q`` tensor, for as long as it lives, with the storage and version of ``q``, ``scales``
and ``mins`` they were made from: a quantized module builds a new ``QuantizedWeight`` from its
buffers on every access, and packing a weight takes milliseconds."""


def _packed_copy(w: QuantizedWeight, make: bool = True) -> native.Q4Packed | tuple[()]:
    """``w``'s packed copy from :data:`_PACKED`, made (when ``make``) if it has none or its
    tensors changed since; else ``()``."""
    anchor = w.q
    key = tuple((t.data_ptr(), version_of(t)) for t in (w.q, w.scales, w.mins) if t is not None)
    got = _PACKED.get(id(anchor))
    if got is not None and got[0]() is anchor and got[1] == key:
        return got[2]
    if not make:
        return ()
    packed = native.pack_q4(w.q, w.scales, w.kernel_mins())
    if got is None or got[0]() is not anchor:
        weakref.finalize(anchor, _PACKED.pop, id(anchor), None)
    _PACKED[id(anchor)] = (weakref.ref(anchor), key, packed)
    return packed


@dataclass(frozen=True)
class QuantizedWeight:
    """(N, K) weight in groups of 32 along K (int8: Q8_0-like, int4: Q4_1-like)."""

    kind: str  # "int8" | "int4"
    q: torch.Tensor  # int8 (N, K) | uint8 (N, K // 2), nibble order as in the module docstring
    scales: torch.Tensor  # float32 (N, K // 32)
    mins: torch.Tensor | None  # float32 (N, K // 32) for int4, None for int8
    # the native product bound to these tensors (built on first qlinear; never pickled)
    _bound: native.BoundGemm | None = field(default=None, init=False, repr=False, compare=False)
    # whether mins == -8 * scales exactly (Q4_0), found on first kernel_mins()
    _q4_0: bool | None = field(default=None, init=False, repr=False, compare=False)
    # int4: the copy in 16-row blocks the native kernels read (native.pack_q4; _PACKED), found
    # on first kernel_packed(); () where they read the plain layout (never pickled)
    _packed: native.Q4Packed | tuple[()] | None = field(default=None, init=False, repr=False,
                                                        compare=False)

    def __post_init__(self) -> None:
        """Check kind, dtypes and shapes (K a multiple of 32) once, at construction."""
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"QuantizedWeight: kind must be one of {QUANT_KINDS}, got "
                             f"{self.kind!r}")
        want = torch.int8 if self.kind == "int8" else torch.uint8
        if self.q.dtype != want or self.q.dim() != 2:
            raise ValueError(f"QuantizedWeight({self.kind}): q must be a 2-D {want} tensor, got "
                             f"{self.q.dtype} {tuple(self.q.shape)}")
        n, k = self.shape
        if k % GROUP:
            raise ValueError(f"QuantizedWeight: K must be a multiple of {GROUP}, got {k}")
        g = k // GROUP
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (n, g):
            raise ValueError(f"QuantizedWeight: scales must be float32 ({n}, {g}), got "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if self.kind == "int4":
            if (self.mins is None or self.mins.dtype != torch.float32
                    or tuple(self.mins.shape) != (n, g)):
                raise ValueError(f"QuantizedWeight(int4): mins must be float32 ({n}, {g})")
        elif self.mins is not None:
            raise ValueError("QuantizedWeight(int8): mins must be None")

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the tensors only (the bound kernel holds this process's pointers)."""
        state = dict(self.__dict__)
        state["_bound"] = None
        state["_packed"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def _kernel(self) -> native.BoundGemm | None:
        """The native product bound to this weight, built once (None off-CPU or without the
        native library)."""
        b = self._bound
        if b is None:
            if not (self.q.is_cpu and native.available()):
                return None
            packed = self.kernel_packed()
            if self.kind == "int8":
                b = native.bind("q8", self.q, self.scales)
            elif packed is not None:
                b = native.bind_q4_packed(packed, self.shape[0])
            else:
                b = native.bind("q4", self.q, self.scales, self.kernel_mins())
            object.__setattr__(self, "_bound", b)
        return b

    def kernel_mins(self) -> torch.Tensor | None:
        """The mins array the native kernels read: None for int8, and for int4 weights whose
        mins are exactly ``-8 * scales`` (GGUF Q4_0, module docstring), whose min the kernels
        compute from the scale instead - the same floats, so the same bits, with a fifth fewer
        bytes streamed per product (16 nibble bytes and a scale per group instead of a scale
        and a min). Checked once per weight (on CPU tensors: the kernels' only device)."""
        if self.mins is None:
            return None
        if not self.mins.is_cpu:
            return self.mins
        q4_0 = self._q4_0
        if q4_0 is None:
            q4_0 = bool(torch.equal(self.mins, self.scales * -8.0))
            object.__setattr__(self, "_q4_0", q4_0)
        return None if q4_0 else self.mins

    def kernel_packed(self) -> native.Q4Packed | None:
        """int4 on a native build that reads them: this weight in 16-row blocks
        (:func:`exitlm.kernels.native.pack_q4`: the same products, the same bits, one forward
        stream per tile), made once and kept beside the plain tensors; else None."""
        got = self._packed
        if got is None:
            got = ()
            if (self.kind == "int4" and self.q.is_cpu and self.q.is_contiguous()
                    and self.scales.is_contiguous() and native.packs_q4()):
                got = _packed_copy(self)
            object.__setattr__(self, "_packed", got)
        return got or None

    @property
    def shape(self) -> torch.Size:
        """``(N, K)`` of the dequantized weight."""
        n, c = self.q.shape
        return torch.Size([n, c if self.kind == "int8" else 2 * c])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype products and dequantization produce (float32)."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        """Where ``q`` (and the scales) live."""
        return self.q.device

    def __getitem__(self, rows: slice) -> QuantizedWeight:
        """Output rows ``rows`` (a step-1 slice) as views of the same storage."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise ValueError(f"QuantizedWeight: index with a step-1 slice of rows, got {rows!r}")
        part = QuantizedWeight(self.kind, self.q[rows], self.scales[rows],
                               None if self.mins is None else self.mins[rows])
        start, stop, _ = rows.indices(self.shape[0])
        packed = self._packed
        if packed is None and self.kind == "int4":
            packed = _packed_copy(self, make=False)
        if packed and start % native.Q4_BLOCK == 0 and stop > start:
            # whole blocks of this weight's packed copy (its rows past stop: outputs dropped)
            b0, b1 = start // native.Q4_BLOCK, -(-stop // native.Q4_BLOCK)
            object.__setattr__(part, "_q4_0", self._q4_0)
            object.__setattr__(part, "_packed", tuple(None if t is None else t[b0:b1]
                                                      for t in packed))
        return part

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Output rows ``index`` (a 1-D tensor of row numbers, in that order) as a weight of
        their own (copies: a ranked draft vocabulary's head)."""
        index = index.to(self.q.device)
        return QuantizedWeight(self.kind, self.q.index_select(0, index).contiguous(),
                               self.scales.index_select(0, index).contiguous(),
                               None if self.mins is None
                               else self.mins.index_select(0, index).contiguous())

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns ``[start, stop)`` as a weight of their own (contiguous copies): the
        part of a row-parallel layer one tensor-parallel rank keeps (Megatron-LM's row split).

        A group's scale (and min) belong to all of its 32 columns, so only whole groups can be
        cut without quantizing again: both ends must be multiples of :data:`GROUP` (int4:
        bytes ``[start / 2, stop / 2)`` of every row, 16 per group). The result then holds
        exactly those columns' ``q``, ``scales`` and ``mins``, so it dequantizes to the same
        columns of this weight and its products are partial sums of this weight's products.
        """
        k = self.shape[1]
        if not 0 <= start < stop <= k or start % GROUP or stop % GROUP:
            raise ValueError(f"QuantizedWeight.columns: [{start}, {stop}) of {k} columns does "
                             f"not cut whole groups of {GROUP}")
        g0, g1 = start // GROUP, stop // GROUP
        per = 1 if self.kind == "int8" else 2  # elements per byte of q
        q = self.q[:, start // per : stop // per].contiguous()
        mins = None if self.mins is None else self.mins[:, g0:g1].contiguous()
        return QuantizedWeight(self.kind, q, self.scales[:, g0:g1].contiguous(), mins)

    def padded(self, rows: int) -> QuantizedWeight:
        """This weight with zero rows added up to ``rows`` (``q``, scales and mins all zero,
        so they dequantize, and multiply, to exactly 0): a vocabulary-parallel shard that the
        vocabulary does not fill."""
        n, _ = self.shape
        if rows <= n:
            return self
        extra = rows - n

        def grow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra, t.shape[1])])

        return QuantizedWeight(self.kind, grow(self.q), grow(self.scales),
                               None if self.mins is None else grow(self.mins))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(N, K)`` weight: ``q * scale`` (int8) or ``nibble * scale + min`` (int4), each
        operation rounded in float32, then cast to ``dtype``."""
        n, k = self.shape
        if self.kind == "int8":
            w = self.q.float().view(n, k // GROUP, GROUP) * self.scales.unsqueeze(-1)
            return w.view(n, k).to(dtype)
        assert self.mins is not None
        return native.unpack_q4(self.q, self.scales, self.mins, dtype)

    def linear(self, x: torch.Tensor, threads: int = 1, *,
               int8_activations: bool = False) -> torch.Tensor:
        """``x @ W.T`` (float32 out) for activations of any float dtype: the product
        :meth:`~exitlm.model.transformer.EarlyExitLM.project` asks a weight that is not a
        tensor for (:func:`qlinear`, whose ``threads`` and ``int8_activations`` these are)."""
        return qlinear(x if x.dtype == torch.float32 else x.float(), self, threads,
                       int8_activations=int8_activations)

    def nbytes(self) -> int:
        """Bytes of ``q``, ``scales`` and ``mins``."""
        total = self.q.numel() * self.q.element_size()
        total += self.scales.numel() * self.scales.element_size()
        if self.mins is not None:
            total += self.mins.numel() * self.mins.element_size()
        return total


def quantize(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """Quantize a float ``(N, K)`` weight (K a multiple of 32) in groups of 32 along K.

    int8: ``d = absmax / 127``, ``q = round(w / d)``; int4: ``d = (max - min) / 15``,
    ``q = round((w - min) / d)`` clamped to [0, 15], ``mins = min``, with ``min`` and ``d``
    on float16 values (:func:`_half_exact`). Groups with ``d = 0`` (all zero, or constant for
    int4) get ``q = 0`` and reproduce exactly (no NaN).
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"quantize: kind must be one of {QUANT_KINDS}, got {kind!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError("quantize: w must be a 2-D floating-point tensor (N, K)")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize: K must be a multiple of {GROUP}, got {k}")
    g = w.detach().to(torch.float32).reshape(n, k // GROUP, GROUP)
    if kind == "int8":
        d = g.abs().amax(dim=-1) / 127.0
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(g / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q.view(n, k).contiguous(), d.contiguous(), None)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = (hi - lo) / 15.0
    lo, d = _half_exact(lo, d)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((g - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    q = torch.where((d > 0).unsqueeze(-1), q, torch.zeros_like(q))
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low), j + 16 (high)
    return QuantizedWeight("int4", packed.reshape(n, k // 2).contiguous(), d.contiguous(),
                           lo.contiguous())


def _half_exact(lo: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 mins and scales moved onto float16 values, as GGUF's Q4_1 stores them: each min
    rounded down and each scale up to the nearest float16 (the groups' ranges stay covered;
    the reconstruction error stays within half a step plus a float16 ulp). The native kernels
    then read the scales as float16 (a tenth fewer bytes; see
    :func:`exitlm.kernels.native.pack_q4`). Unchanged when a value lies outside float16's
    range or a constant group's value is no float16 (it would no longer reproduce exactly)."""
    lim = 65504.0  # float16's largest finite value
    if not lo.numel() or not (lo.abs().max() <= lim and d.max() * 1.001 <= lim):
        return lo, d  # (also NaN)
    lo16 = lo.half()
    if bool(((d == 0) & (lo16.float() != lo)).any()):
        return lo, d
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, lo16.new_tensor(-lim)), lo16)
    d16 = d.half()
    d16 = torch.where(d16.float() < d, torch.nextafter(d16, d16.new_tensor(lim)), d16)
    return lo16.float(), d16.float()


def _rows(x: torch.Tensor) -> int:
    """Rows of ``x (..., K)``: the product of the leading dimensions."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def qlinear(x: torch.Tensor, w: QuantizedWeight, threads: int = 1, *,
            int8_activations: bool = False) -> torch.Tensor:
    """``x (..., K) float32 @ W.T -> (..., N) float32`` for a quantized ``W``.

    Fewer than :data:`ROW_THRESHOLD` rows on the CPU: the native per-row kernel (row-invariant,
    exact per (row, output) arithmetic), with each row of ``x`` rounded to int8 in groups of 32
    when ``int8_activations`` (:func:`~exitlm.kernels.native.gemm_q8`'s integer products, the
    fused blocks' arithmetic). Otherwise, or without the native library: dequantize +
    ``F.linear`` with float32 ``x`` (not row-invariant).
    """
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"qlinear: w must be a QuantizedWeight, got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ValueError(f"qlinear: x must be a float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.is_cpu and _rows(x) < ROW_THRESHOLD:
        kernel = w._kernel()
        if kernel is not None:
            return kernel(x if x.is_contiguous() else x.contiguous(), threads,
                          int8_activations)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"qlinear: x must have shape (..., {w.shape[1]}), got {tuple(x.shape)}")
    return F.linear(x, w.dequantize())


def dense_linear(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x (..., K) float32 @ w.T -> (..., N) float32`` for a float32 or float16 ``w (N, K)``.

    Fewer than :data:`ROW_THRESHOLD` rows: the native row-invariant kernel; otherwise, or
    without the native library: ``F.linear`` (float16 weights converted to float32 first).
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ValueError(f"dense_linear: x must be a float32 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dense_linear: w must be a float32 or float16 tensor, got "
                         f"{getattr(w, 'dtype', type(w).__name__)}")
    if _rows(x) < ROW_THRESHOLD and x.is_cpu and w.is_cpu and native.available():
        x = x.contiguous()
        if w.dtype == torch.float32:
            return native.gemm_f32(x, w, threads)
        return native.gemm_f16(x, w, threads)
    return F.linear(x, w if w.dtype == torch.float32 else w.float())


def embedding_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Dequantized rows ``W[ids]``: ids of any shape ``(...)`` -> float32 ``(..., K)``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("embedding_rows: ids must be an int64/int32 tensor")
    flat = ids.reshape(-1).long()
    sub = QuantizedWeight(w.kind, w.q.index_select(0, flat), w.scales.index_select(0, flat),
                          None if w.mins is None else w.mins.index_select(0, flat))
    return sub.dequantize().view(*ids.shape, w.shape[1])
