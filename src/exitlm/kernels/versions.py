"""Version counters of the tensors that cached copies and prepared native calls were made from.

Copies of weights (packed int4 blocks, greedy screens, oneDNN layouts, sliced heads) and the
native blocks remember ``(data_ptr, _version)`` of their source and are rebuilt when it moves
or is written in place. A tensor made under ``torch.inference_mode`` (a model loaded or
quantized inside it, a tensor-parallel rank's padded vocabulary rows) keeps no version
counter - reading ``_version`` raises - and its in-place writes cannot be seen; such tensors
count as version -1, so the caches key on where they live only.

Code that moves a weight to new storage (``t.data = ...``: re-striding, a dtype change, huge
pages) makes the new tensor under the same mode (:func:`replace_data`): a normal tensor put
under an inference tensor's ``.data`` has no version counter either, and every later op on it
raises."""

from __future__ import annotations

from collections.abc import Callable

import torch

INFERENCE = -1
"""The version of an inference tensor (:func:`version_of`)."""


def version_of(t: torch.Tensor) -> int:
    """``t._version``, or :data:`INFERENCE` for an inference tensor."""
    return INFERENCE if t.is_inference() else t._version


def replace_data(t: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``t.data = make(t.data)``, the new tensor made an inference tensor exactly where ``t``
    is one (the module docstring)."""
    with torch.inference_mode(t.is_inference()):
        t.data = make(t.data)
