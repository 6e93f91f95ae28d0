"""The kernels a runner gives a model's linear layers on CPU: :class:`Products`.

gpt-fast applies speed to a built model with a handler; exitlm keeps the model untouched and
hands the choice of kernel to every forward instead (``ops`` of
:class:`~exitlm.model.transformer.StepContext`): each product of a plain
:class:`~exitlm.model.layers.Linear` goes through :func:`~exitlm.kernels.linear.linear` with
this object's packed copy of the weight - numpy's OpenBLAS for 1-8 fp32 rows, oneDNN-packed
copies of bf16 weights and (``pack_rows``) of fp32 weights for 2-32-row products, fp32 GEMM for
fp16 prefills. Layers of another class (quantized layers, a parallel layout's layers, which
communicate inside their forward) run their own forward.

The one change made to the model is the layout of its weights (:func:`~exitlm.kernels.layout.
restride`: the same values, the same Parameter objects, other strides): column-major for fp32
weights with ``out > in`` that OpenBLAS multiplies by one row, row-major for those the native
kernels read by rows - and, once laid out, their place: one arena of transparent huge pages
(:func:`~exitlm.runtime.memory.place_weights`; fewer TLB misses in the weight stream of every
token). Packed copies belong to this object, never to the model.
"""

from __future__ import annotations

import torch
from torch import nn

from exitlm.kernels.layout import Packed, pack, restride
from exitlm.kernels.linear import linear
from exitlm.model.layers import Linear
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.memory import place_weights


class Products:
    """Kernels for the linear layers and output embeddings of one model (module docstring).

    Args:
        model: the model (its weights are re-strided and placed in huge pages in place,
            values unchanged).
        pack_rows: keep oneDNN-packed copies of fp32 weights for products of 2-32 rows
            (batches, verification, recomputation): twice the weight memory.
        row_major: ids of modules whose weights stay row-major (read by the native kernels).
    """

    def __init__(self, model: nn.Module, *, pack_rows: bool = False,
                 row_major: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.pack_rows = pack_rows
        self.row_major = row_major
        self.unpacked: frozenset[int] = frozenset()
        self.packs: dict[int, Packed | None] = {}
        self._prepare()

    def enable_rows(self, unpacked: frozenset[int] = frozenset()) -> None:
        """Add packed copies for few-row fp32 products (once), except of the weights whose
        ids are in ``unpacked`` (read as they are by other kernels)."""
        if not self.pack_rows:
            self.pack_rows, self.unpacked = True, unpacked
            self._prepare()

    @torch.no_grad()
    def _prepare(self) -> None:
        for module in self.model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                restride(module.weight, row_major=id(module) in self.row_major)
        place_weights(self.model)  # after the layout (a new layout is a new allocation)
        for weight in self._weights():
            key = id(weight)
            self.packs[key] = pack(weight, self.packs.get(key),
                                   rows=self.pack_rows and key not in self.unpacked)

    def _weights(self) -> list[torch.Tensor]:
        """The weights this object multiplies: every plain linear layer's and the output
        embeddings that are not a linear layer's (a tied input embedding)."""
        out = [m.weight for m in self.model.modules() if type(m) is Linear]
        if isinstance(self.model, EarlyExitLM):
            out += [m.weight for m in head_modules(self.model) if isinstance(m, nn.Embedding)]
        return out

    def pack_of(self, weight: torch.Tensor) -> Packed | None:
        """The packed copy of ``weight`` (``None``: it has none; the plain kernels apply)."""
        return self.packs.get(id(weight))

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``: through :func:`~exitlm.kernels.linear.linear` for a plain linear
        layer, the layer's own forward otherwise (and whenever it carries forward hooks,
        which then run)."""
        if type(layer) is Linear and not (layer._forward_hooks or layer._forward_pre_hooks):
            w = layer._parameters["weight"]
            return linear(x, w, layer._parameters["bias"], self.packs.get(id(w)))
        return layer(x)

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """An output embedding's product through :func:`~exitlm.kernels.linear.linear` with
        its packed copy."""
        return linear(h, weight, None, self.packs.get(id(weight)))


def head_modules(model: EarlyExitLM) -> list[nn.Module]:
    """The modules holding ``model``'s output embeddings: its LM head and own exit matrices
    and, when tied or used by the exits, the input embedding (or its output copy,
    :attr:`~exitlm.model.transformer.EarlyExitLM.tied_head`)."""
    mods: list[nn.Module] = [m for m in (model.lm_head, *(e.proj for e in model.exits.values()))
                             if m is not None]
    if model.lm_head is None or model.config.exits.output == "tied_embedding":
        if model.tied_head is not None:  # the embedding's output copy (an int8 head)
            mods.append(model.tied_head)
        elif isinstance(model.embed_tokens.weight, torch.Tensor):
            mods.append(model.embed_tokens)
    return mods
