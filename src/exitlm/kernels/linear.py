"""The one place that decides which kernel a product ``x @ weight.T`` runs on: :func:`linear`.

Every product a CPU runner computes through torch goes through it: the linear layers' products
(:class:`~exitlm.runtime.products.Products`), the output projections of every exit and the LM
head, and a tensor-parallel shard's partial products.

Adding a kernel: a per-weight precomputed form (like a oneDNN-packed copy,
:mod:`exitlm.kernels.layout`) belongs to whoever owns the kernels' state (the runner's
:class:`~exitlm.runtime.products.Products`) and is passed in; the choice is made here, by the
product's dtype and row count. A weight stored in another form altogether (quantized) is a
module of its own with its own kernel (:mod:`exitlm.kernels.quantized`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exitlm.kernels import native
from exitlm.kernels.blas import BLAS, PLAIN_TENSORS, SMALL_ROWS, blas_layout
from exitlm.kernels.layout import Packed
from exitlm.kernels.quant import dense_linear

F16_NATIVE_ROWS = 40
"""fp16 products of fewer rows run on the native kernel. Measured on a 2-core Sapphire Rapids VM,
one thread, a 24-layer dim-256 fp16 model's prefill against weights converted to fp32 for
torch's GEMM: 8 positions 1.45x faster, 16 1.24x, 32 1.04x, 48 0.86x, 64 0.64x; batch-4
decoding 1.48x (the same tokens)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the fastest CPU kernel for its shape and dtype.

    * with gradients enabled, or ``x`` requiring grad: exactly ``F.linear`` (a prepared model
      can still be trained or tuned);
    * ``packed``, a oneDNN-packed copy of ``weight`` (:mod:`exitlm.kernels.layout`), when it
      is still valid: bf16 for every product (oneDNN ~10 GB/s against ATen's ~6 GB/s GEMV),
      fp32 for products of 2-32 rows (1.1-2.4 GEMVs against 3-6 for MKL, which packs the
      weight on every call);
    * one fp32 row (batch-1 decoding) through numpy's OpenBLAS GEMV, ~1.2-1.5x MKL's
      (:mod:`exitlm.kernels.blas`), and 2-8 rows (verification, KV recomputation, small
      batches) through its small-matrix GEMM in blocks of weight rows
      (:meth:`~exitlm.kernels.blas.OpenBlas.rows`); plain CPU tensors only (a DTensor of
      tensor parallelism takes ``F.linear``);
    * fp16 weights and activations, fewer than :data:`F16_NATIVE_ROWS` rows: the native
      row-invariant kernel, which reads the fp16 weight as it is (batches, verification,
      short prefills: the same bits for a row whatever the row count); from there on torch's
      CPU fp16 GEMM is ~50x slower than fp32, so such inputs are computed in fp32 (the weight
      converted) and cast back.

    (docs/architecture.md "CPU fast paths" has the measurements.)
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
    if x.dtype is torch.float32 and weight.dtype is torch.float16 and x.is_cpu:
        # a float32 model holding a weight in fp16 (a quantized draft copy's layers that
        # cannot be quantized, runtime/draft_copy.py): the native kernel reads it as it is
        # (row-invariant, fp32 activations); F.linear on the weight in fp32 without it
        y = dense_linear(x, weight.detach(), torch.get_num_threads())
        return y if bias is None else y + bias
    if (
        x.dtype is torch.float16
        and weight.dtype is torch.float16
        and x.is_cpu
        and weight.is_cpu
        and type(weight) in PLAIN_TENSORS
        and type(x) is torch.Tensor
        and x.numel() < F16_NATIVE_ROWS * x.shape[-1]
        and weight.is_contiguous()
        and native.available()
    ):
        y = native.gemm_f16(x.float().contiguous(), weight.detach(), torch.get_num_threads())
        y = y.to(torch.float16)
        return y if bias is None else y + bias
    if x.dtype == torch.float16 and x.device.type == "cpu" and x.numel() > 8 * x.shape[-1]:
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.float16)
    return F.linear(x, weight, bias)
