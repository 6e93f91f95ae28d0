"""Activation memory as EE-LLM Sec. 3.2 / App. A.3.2 counts it: the bytes autograd saves for
the backward pass (parameters excluded), per process."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from exitlm.train.parallel.tensor import local


def _plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or the inner tensors of a wrapper
    subclass (a DTensor's local shard, an asynchronous collective's result)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]
        return [x for i in inner if isinstance(i, torch.Tensor) for x in _plain_parts(i)]
    return [t]


def param_storages(model: nn.Module) -> set[int]:
    """Storage addresses of ``model``'s parameters (this process's shards)."""
    return {local(p).untyped_storage().data_ptr() for p in model.parameters()}


class SavedBytes:
    """Counts bytes autograd saves for backward inside a ``with`` block, excluding
    parameters (``exclude``: :func:`param_storages`) and storages already counted (``seen``,
    shared across blocks of one microbatch). DTensors count their local shard."""

    def __init__(self, exclude: set[int], seen: set[int] | None = None) -> None:
        self.exclude = exclude
        self.seen: set[int] = set() if seen is None else seen
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for inner in _plain_parts(t):
            st = inner.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += st.nbytes()
        return t

    def __enter__(self) -> SavedBytes:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
