"""The one place that decides which kernel a product ``x @ weight.T`` runs on: :func:`linear`.

Every product of a prepared model goes through it: the :class:`FastLinear` modules that
:func:`~exitlm.backend.cpu.prepare_for_decoding` puts in place of the model's linear layers,
the model's output projection (every exit and the LM head), the lean decoding step of
:mod:`exitlm.backend.decode_block`, and the sliced draft heads of self-speculative decoding.

Adding a kernel (native dense kernels, quantized weights): a per-weight precomputed form
belongs on the module that owns the weight (like :attr:`FastLinear.pack`), is made in
:meth:`FastLinear.prepare`, and is chosen in :func:`linear` by the product's dtype and row
count; a weight stored in another form altogether (quantized) is a :class:`FastLinear`
subclass whose ``prepare`` converts it and whose ``forward`` calls its kernel, swapped in by
:func:`~exitlm.backend.cpu.prepare_for_decoding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exitlm.backend.blas import BLAS, PLAIN_TENSORS, SMALL_ROWS, blas_layout
from exitlm.backend.layout import Packed, pack, restride


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest CPU kernel for its shape and dtype.

    * with gradients enabled, or ``x`` requiring grad: exactly ``F.linear`` (a prepared model
      can still be trained or tuned);
    * ``packed``, a oneDNN-packed copy of ``weight`` (:mod:`exitlm.backend.layout`), when it
      is still valid: bf16 for every product (oneDNN ~10 GB/s against ATen's ~6 GB/s GEMV),
      fp32 for products of 2-32 rows (1.1-2.4 GEMVs against 3-6 for MKL, which packs the
      weight on every call);
    * one fp32 row (batch-1 decoding) through numpy's OpenBLAS GEMV, ~1.2-1.5x MKL's
      (:mod:`exitlm.backend.blas`), and 2-8 rows (verification, KV recomputation, small
      batches) through its small-matrix GEMM in blocks of weight rows
      (:meth:`~exitlm.backend.blas.OpenBlas.rows`); plain CPU tensors only (a DTensor of
      tensor parallelism takes ``F.linear``);
    * CPU fp16 GEMM with many rows (prefill) is ~50x slower than fp32, so such inputs are
      computed in fp32 and cast back; one-row GEMV (decoding) stays in fp16, where it is fast.

    (README "Performance" has the measurements.)
    """
    if torch.is_grad_enabled() or x.requires_grad:
        return F.linear(x, weight, bias)
    if packed is not None and packed.serves(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")
    if (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and BLAS.enabled
        and x.is_cpu
        and weight.is_cpu
        and type(weight) in PLAIN_TENSORS
        and type(x) is torch.Tensor
    ):
        if x.numel() == x.shape[-1]:  # one row: batch-1 decoding
            y = BLAS(x, weight)
            return y if bias is None else y + bias
        if (
            SMALL_ROWS[0] <= x.numel() // x.shape[-1] <= SMALL_ROWS[1]
            and x.is_contiguous()
            and blas_layout(weight)
        ):
            y = BLAS.rows(x, weight)
            return y if bias is None else y + bias
    if x.dtype == torch.float16 and x.device.type == "cpu" and x.numel() > 8 * x.shape[-1]:
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.float16)
    return F.linear(x, weight, bias)


class FastLinear(nn.Linear):
    """``nn.Linear`` whose product runs through :func:`linear` with this layer's own packed
    weight copy (:attr:`pack`, made by :meth:`prepare`).

    :func:`~exitlm.backend.cpu.prepare_for_decoding` turns the model's
    :class:`~exitlm.model.layers.Linear` layers into this class in place (same module, same
    parameters, same state dict); hooks registered on the layer run as before.
    """

    pack: Packed | None = None
    """oneDNN-packed copy of :attr:`weight` (inference only; see :func:`linear`)."""

    def prepare(self, *, pack_rows: bool = False, row_major: bool = False) -> None:
        """Re-stride the weight for decoding (``row_major`` for the native kernels) and
        (re)pack it for oneDNN where that pays: bf16 always, fp32 for few-row products when
        ``pack_rows`` (twice the weight memory)."""
        restride(self.weight, row_major=row_major)
        self.pack = pack(self.weight, self.pack, rows=pack_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack)

    def __getstate__(self) -> dict[str, object]:
        # copies and pickles start without the packed copy (a oneDNN tensor); they compute
        # the same through the plain kernels
        state = self.__dict__.copy()
        state.pop("pack", None)
        return state

    @classmethod
    def holding(cls, weight: torch.Tensor, *, pack_rows: bool = False) -> FastLinear:
        """A bias-free layer holding ``weight`` (no gradient), prepared for decoding."""
        lin = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(weight, requires_grad=False)
        lin.prepare(pack_rows=pack_rows)
        return lin
