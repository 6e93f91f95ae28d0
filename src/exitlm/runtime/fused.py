"""One layer's static step, compiled: the graph runner's kernels fused by ``torch.compile``.

A CUDA graph removes the host's launch cost of each kernel but replays every kernel the eager
modules launch - ~20 per layer (norms, the three products, rotary, the cache scatter,
attention, residuals, the gated activation), ~600 a SmolLM2 step, whose device-side gaps
then set the step's time. Compiling the layer lets the compiler fuse the element-wise work
into the products' neighbours (gpt-fast compiles its whole ``decode_one_token`` for the same
reason). Here only *one layer's* step is compiled (regional compilation): the layers of a
model share one structure, and with dynamo's ``inline_inbuilt_nn_modules`` (the default) a
module's parameters are inputs of the compiled program rather than constants, so the program
compiled for layer 0 serves every layer - one compile per shape, not one per layer.

Two choices keep the compiles few:

* the layer sees a :class:`LayerSlot` - its own keys and values, the first ``S`` slots - and
  not the model's :class:`~exitlm.model.kv_cache.KVCache`, so nothing in the program depends
  on which layer it is (a slot number would be a constant of the program);
* ``S`` (the attended slots), the rows and the positions per row are tensor sizes, which the
  compiler makes dynamic after the first size it sees change (automatic dynamic shapes): a
  sequence growing through 64, 128, 256 ... slots recompiles once, not at every size.

The arithmetic is the eager modules' own (:class:`~exitlm.model.layers.Block` traced as it
is), so the compiled step computes what the static step computes, up to the compiler's
rounding (fused element-wise code, an fp32 accumulation kept in registers). The CPU tests run
it through a compiler backend that does not generate code (``aot_eager``: the traced graph
run by eager kernels), which checks the tracing, the in-place cache writes and the
recompile count without a C++ compiler's minutes; the GPU uses ``inductor`` (Triton).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from exitlm.model.kv_cache import KVCache, WritePlan

COMPILERS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends a :class:`FusedStep` accepts: ``inductor`` generates fused
kernels (Triton on CUDA, C++ on CPU); ``aot_eager`` / ``eager`` trace without generating code
(the tests' check of the tracing)."""

RECOMPILE_LIMIT = 16
"""The most programs dynamo keeps for the step (per compiled function); past it a call would
run uncompiled (dynamo's default is 8: rows, positions and slots each change once, and
float16/bfloat16/float32 models in one process triple that)."""


class LayerSlot:
    """One layer's keys and values as the static step writes and reads them: the first ``S``
    slots of its cache slot, ``(B, kv_heads, S, D)``. Writes scatter at the plan's device
    positions; the host-side fill bookkeeping stays with the caller (the graph runner records
    it after the program, :func:`~exitlm.runtime.graphs._grow_fill`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, plan: WritePlan
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`KVCache.write`'s scatter at ``plan.index`` ``(B, T)`` (``slot`` is this
        slot's, whatever its number); returns every attended slot."""
        assert plan.index is not None
        idx = plan.index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys.scatter_(2, idx, k.to(self.keys.dtype))
        self.values.scatter_(2, idx, v.to(self.values.dtype))
        return self.keys, self.values


def static_block(block: nn.Module, h: torch.Tensor, cos: torch.Tensor | None,
                 ssin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Layer ``block``'s step on ``h`` ``(B, T, D)`` at device positions ``index``
    ``(B, T)``: keys/values written into ``keys`` / ``values`` (its slot's first ``S`` slots,
    in place), attention over them under ``mask`` ``(B, 1, T, S)``; ``cos`` / ``ssin`` the
    rotary tables at those positions (``None`` without rotary positions)."""
    plan = WritePlan(end=keys.shape[2], start=-1, length=h.shape[1], index=index,
                     new_fill=index[:, 0])
    rope = None if cos is None or ssin is None else (cos, ssin)
    slot = cast(KVCache, LayerSlot(keys, values))  # duck-typed: only write() is called
    return cast(torch.Tensor, block(h, rope, slot, 0, plan, mask))


class FusedStep:
    """:func:`static_block` compiled once by ``torch.compile(fullgraph=True)`` with the
    backend ``compiler`` (:data:`COMPILERS`); call it as :func:`static_block`.

    Attributes:
        compiler: the backend's name.
    """

    def __init__(self, compiler: str = "inductor") -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"unknown compiler backend {compiler!r}; choose one of "
                             f"{COMPILERS}")
        self.compiler = compiler
        self._fn: Callable[..., Any] | None = None

    def __call__(self, block: nn.Module, h: torch.Tensor, cos: torch.Tensor | None,
                 ssin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._fn is None:  # torch._dynamo is imported here, not by every process
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit,
                                                RECOMPILE_LIMIT)
            self._fn = torch.compile(static_block, fullgraph=True, backend=self.compiler)
        return cast(torch.Tensor, self._fn(block, h, cos, ssin, keys, values, index, mask))


__all__ = ["COMPILERS", "FusedStep", "LayerSlot", "static_block"]
