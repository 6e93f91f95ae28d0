"""Memory layout of weights for fast decoding on CPU: re-striding and oneDNN packing.

Decoding one token multiplies a single row by every weight matrix, so it is bound by how fast
the GEMV kernel streams weights. Measured on this project's x86 CPUs (single thread, see
docs/architecture.md "CPU fast paths"):

* fp32: ``F.linear`` with the ``(out, in)`` weight stored **column-major** streams 13-16 GB/s
  when ``out > in`` (q/k/v, MLP input, LM head) against 8-9 GB/s row-major; when
  ``out <= in`` row-major is as fast or faster. Batch-1 fp32 decoding actually runs its
  GEMVs through numpy's OpenBLAS (:mod:`exitlm.kernels.blas`, 17-25 GB/s on one thread),
  which prefers the same layouts.
* fp16: row-major only (column-major is 5-40x slower).
* bf16: ATen's GEMV reaches ~6 GB/s; oneDNN with a pre-packed weight ~10 GB/s, bit-identical.
  Packing keeps a second copy of each linear weight (inference only).
* fp32 products of a few rows (batched decoding, verification): MKL and OpenBLAS pack the
  weight on every GEMM call, so 2-8 rows cost 3-6 GEMVs; oneDNN with the weight packed once
  costs 1.1-2.4. The engine asks for these copies (``pack_rows``) when it decodes several
  rows at a time.

:func:`restride` and :func:`pack` apply these choices to one weight; the values, shapes and
gradients of weights are unchanged, only strides differ (save paths call ``.contiguous()``).
"""

from __future__ import annotations

import torch

from exitlm.kernels.blas import PLAIN_TENSORS
from exitlm.kernels.versions import replace_data, version_of

PACKED_ROWS = (2, 32)
"""Row counts (inclusive) of the fp32 products that use a pre-packed weight: oneDNN with the
weight packed once costs ~1.1-2.4 GEMVs for 2-8 rows where MKL's and OpenBLAS' GEMMs, which
pack the weight on every call, cost 3-6 (docs/architecture.md "CPU fast paths")."""


class Packed:
    """A oneDNN-packed copy of one weight, valid while the weight is unchanged.

    ``every_product``: bf16 copies serve every product; fp32 copies only products of
    :data:`PACKED_ROWS` rows. The copy remembers the weight's version counter and storage,
    so a weight changed in place (an optimizer step) or replaced (``.data =``, ``.to``)
    silently falls back to the plain kernel (:meth:`valid`).
    """

    __slots__ = ("dtype", "every_product", "ptr", "tensor", "version")

    def __init__(self, weight: torch.Tensor, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = version_of(weight)
        self.ptr = weight.data_ptr()
        self.dtype = weight.dtype
        self.every_product = weight.dtype != torch.float32

    def valid(self, weight: torch.Tensor) -> bool:
        """Whether this copy still holds ``weight``'s values."""
        return (version_of(weight) == self.version and weight.dtype is self.dtype
                and weight.data_ptr() == self.ptr)

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the product of ``x`` with ``weight`` should use this copy."""
        if x.dtype is not self.dtype or not self.valid(weight):
            return False
        return self.every_product or PACKED_ROWS[0] <= x.numel() // x.shape[-1] <= PACKED_ROWS[1]


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values stored column-major."""
    return t.t().contiguous().t()


def wants_column_major(weight: torch.Tensor) -> bool:
    """Whether the 2-D ``(out, in)`` ``weight`` is faster column-major for batch-1 GEMV."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and out_features > in_features
    )


def _plain_2d(weight: torch.Tensor) -> bool:
    """Weights the backend may re-stride or pack: plain 2-D tensors with storage (not
    DTensors of tensor parallelism, not meta tensors)."""
    return type(weight) in PLAIN_TENSORS and weight.dim() == 2 and weight.device.type != "meta"


@torch.no_grad()
def restride(weight: torch.Tensor, *, row_major: bool = False) -> None:
    """Store ``weight`` in its fastest decoding layout (in place, values unchanged):
    column-major for fp32 CPU weights with ``out > in`` (OpenBLAS' GEMV), row-major otherwise
    or when ``row_major`` (the native kernels of :mod:`exitlm.kernels.native` read rows; a
    column-major fp32 weight cast to fp16 must become row-major again - this does that)."""
    if not _plain_2d(weight):
        return
    is_cm = weight.shape[0] > 1 and weight.stride() == (1, weight.shape[0])
    if wants_column_major(weight) and not row_major:
        if not is_cm:
            replace_data(weight, column_major)
    elif not weight.is_contiguous():
        replace_data(weight, torch.Tensor.contiguous)


def can_pack(weight: torch.Tensor, rows: bool) -> bool:
    """Whether oneDNN can pack ``weight``: bf16 always, fp32 when ``rows`` (few-row
    products) is asked for; CPU plain tensors only."""
    dtypes = (torch.bfloat16, torch.float32) if rows else (torch.bfloat16,)
    return (
        _plain_2d(weight)
        and weight.device.type == "cpu"
        and weight.dtype in dtypes
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@torch.no_grad()
def pack(weight: torch.Tensor, old: Packed | None = None, *, rows: bool = False) -> Packed | None:
    """A oneDNN-packed copy of ``weight`` (bf16: for every product; fp32: for products of
    :data:`PACKED_ROWS` rows, when ``rows``), ``old`` itself when it is still valid, or None
    when the weight is not packed (other dtypes, no oneDNN, oneDNN without this dtype)."""
    if old is not None and old.valid(weight):
        return old
    if not can_pack(weight, rows):
        return None
    try:
        # batch-size hint: bf16 is packed for batch-1 decoding, fp32 for a few rows
        hint = 8 if weight.dtype == torch.float32 else 1
        return Packed(weight, torch.ops.mkldnn._reorder_linear_weight(weight.data, hint))
    except RuntimeError:  # oneDNN without support for this dtype on this CPU
        return None
