"""GGUF weights kept quantized: Q8_0, Q4_0 and Q4_1 blocks read straight into
:class:`~exitlm.kernels.quant.QuantizedWeight` (no fp32 copy of the weight is made).

ggml's blocks hold 32 weights of one row each (the group size of exitlm's formats):

* ``Q8_0``: fp16 scale ``d``, then 32 int8 ``q``: ``w = d * q``;
* ``Q4_0``: fp16 ``d``, then 16 bytes of nibbles: ``w = d * (nibble - 8)``;
* ``Q4_1``: fp16 ``d``, fp16 ``m``, then 16 bytes of nibbles: ``w = d * nibble + m``.

Byte ``j`` of a 4-bit block holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high nibble, which is the order exitlm's int4 format keeps. Q4_0 becomes int4 with
``min = -8 d`` (exact in fp32), Q8_0 becomes int8, so both libraries multiply by the same
weight values.
"""

from __future__ import annotations

import numpy as np
import torch

from exitlm.kernels.quant import GROUP, QuantizedWeight

# ggml type name -> (bytes per block, kind)
BLOCK_TYPES = {"Q8_0": (34, "int8"), "Q4_0": (18, "int4"), "Q4_1": (20, "int4")}


def block_kind(type_name: str) -> str | None:
    """The exitlm quantization a ggml tensor type maps to without dequantizing, or None."""
    entry = BLOCK_TYPES.get(type_name)
    return None if entry is None else entry[1]


def blocks_to_weight(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A :class:`QuantizedWeight` of ``shape`` ``(rows, cols)`` from a tensor's raw blocks
    ``raw`` (uint8, ``(rows, blocks_per_row * block_bytes)``, rows in final order)."""
    size = BLOCK_TYPES[type_name][0]
    rows, cols = shape
    if cols % GROUP:
        raise ValueError(f"{cols} columns are not a multiple of {GROUP}")
    nb = cols // GROUP
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, nb)
    if type_name == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantizedWeight("int8", torch.from_numpy(q), torch.from_numpy(d), None)
    if type_name == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nib = b[..., 4:]
    else:  # Q4_0
        m = np.float32(-8.0) * d
        nib = b[..., 2:]
    q = np.ascontiguousarray(nib).reshape(rows, cols // 2)
    return QuantizedWeight("int4", torch.from_numpy(q), torch.from_numpy(d),
                           torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)))
