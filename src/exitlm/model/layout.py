"""Memory layout of weights for fast batch-1 decoding on CPU.

Decoding one token multiplies a single row by every weight matrix, so it is bound by how fast
the GEMV kernel streams weights. Measured on this project's x86 CPUs (single thread, README
"Performance"):

* fp32: ``F.linear`` with the ``(out, in)`` weight stored **column-major** streams 13-16 GB/s
  when ``out > in`` (q/k/v, MLP input, LM head) against 8-9 GB/s row-major; when
  ``out <= in`` row-major is as fast or faster. Batch-1 fp32 decoding actually runs its
  GEMVs through numpy's OpenBLAS (:func:`exitlm.model.layers.linear`, 17-25 GB/s on one
  thread), which prefers the same layouts.
* fp16: row-major only (column-major is 5-40x slower).
* bf16: ATen's GEMV reaches ~6 GB/s; oneDNN with a pre-packed weight ~10 GB/s, bit-identical.
  Packing keeps a second copy of each linear weight (inference only).
* fp32 products of a few rows (batched decoding, verification): MKL and OpenBLAS pack the
  weight on every GEMM call, so 2-8 rows cost 3-6 GEMVs; oneDNN with the weight packed once
  costs 1.1-2.4. The engine asks for these copies (``pack_fp32_rows``) when it decodes
  several rows at a time.

:func:`optimize_layout` applies these choices. Values, shapes, parameter names and gradients
are unchanged; only strides differ (save paths call ``.contiguous()``).
"""

from __future__ import annotations

import torch
from torch import nn

from exitlm.model.layers import is_packed, register_packed


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def wants_column_major(weight: torch.Tensor) -> bool:
    """Whether the 2-D ``(out, in)`` ``weight`` is faster column-major for batch-1 GEMV."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and out_features > in_features
    )


def _can_pack(weight: torch.Tensor, fp32: bool) -> bool:
    dtypes = (torch.bfloat16, torch.float32) if fp32 else (torch.bfloat16,)
    return (
        weight.device.type == "cpu"
        and weight.dtype in dtypes
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


@torch.no_grad()
def optimize_layout(model: nn.Module, *, pack_bf16: bool = True,
                    pack_fp32_rows: bool = False) -> nn.Module:
    """Re-stride (and on CPU pre-pack) every linear weight of ``model``.

    ``pack_bf16`` packs bf16 weights for oneDNN (every product); ``pack_fp32_rows`` keeps a
    oneDNN-packed second copy of fp32 weights for products of a few rows
    (:data:`~exitlm.model.layers.PACKED_ROWS`: batched decoding, verification, KV
    recomputation) - twice the weight memory, asked for by the decoding engine only when it
    multiplies several rows at a time.

    Idempotent, and safe to call again after ``model.to(dtype)`` (``.to`` keeps strides, and a
    column-major fp32 weight cast to fp16 must become row-major again - this does that).
    """
    for module in model.modules():
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        w = module.weight
        if w.dim() != 2 or w.device.type == "meta":
            continue
        is_cm = w.shape[0] > 1 and w.stride() == (1, w.shape[0])
        if wants_column_major(w):
            if not is_cm:
                w.data = _column_major(w.data)
        elif not w.is_contiguous():
            w.data = w.data.contiguous()
        if is_packed(w):
            continue  # already packed and unchanged since
        if (pack_bf16 and _can_pack(w, fp32=False)) or (pack_fp32_rows and _can_pack(w, True)):
            try:
                # batch-size hint: bf16 is packed for batch-1 decoding, fp32 for a few rows
                hint = 8 if w.dtype == torch.float32 else 1
                register_packed(w, torch.ops.mkldnn._reorder_linear_weight(w.data, hint))
            except RuntimeError:  # oneDNN without support for this dtype on this CPU
                register_packed(w, None)
    return model
