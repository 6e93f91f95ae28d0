"""Memory layout of weights for fast batch-1 decoding on CPU.

Decoding one token multiplies a single row by every weight matrix, so it is bound by how fast
the GEMV kernel streams weights. On the x86 CPUs measured for this project (see README,
"Performance"), ``F.linear`` with an ``(out, in)`` weight stored **column-major** (i.e. the
``(in, out)`` transpose is contiguous) streams fp32 and bf16 weights ~1.8x faster than the
default row-major layout, while fp16 is fastest row-major and pathologically slow
column-major. :func:`optimize_layout` re-strides weights accordingly; values, shapes, names
and gradients are unchanged, only ``stride()`` differs. Save paths call ``.contiguous()``.
"""

from __future__ import annotations

import torch
from torch import nn


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def preferred_column_major(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 2-D weights should be column-major for batch-1 GEMV on ``device``."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


@torch.no_grad()
def optimize_layout(model: nn.Module) -> nn.Module:
    """Re-stride every 2-D weight of ``model`` for its dtype/device (see module docstring).

    Idempotent, and safe to call again after ``model.to(dtype)`` (``.to`` keeps strides, so a
    column-major fp32 model cast to fp16 must be re-laid out - this function does that).
    """
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            w = module.weight
            if w.dim() != 2 or w.device.type == "meta":
                continue
            want_cm = preferred_column_major(w.dtype, w.device)
            is_cm = w.stride() == (1, w.shape[0])
            if want_cm and not is_cm:
                w.data = _column_major(w.data)
            elif not want_cm and not w.is_contiguous():
                w.data = w.data.contiguous()
    return model
