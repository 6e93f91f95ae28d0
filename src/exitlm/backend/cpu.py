"""Speed for decoding on CPU, applied once to a built model: :func:`prepare_for_decoding`.

gpt-fast's handler pattern: the model files stay plain arithmetic, and a handler swaps the
fast pieces into a built model. Here that is, in place and without changing parameter names,
values or the state dict:

* every :class:`~exitlm.model.layers.Linear` becomes a
  :class:`~exitlm.backend.linear.FastLinear` (its ``__class__``; the same Parameter objects),
  whose products go through the one kernel choice of :func:`~exitlm.backend.linear.linear`:
  numpy's OpenBLAS for 1-8 fp32 rows (:mod:`exitlm.backend.blas`), oneDNN-packed copies of
  bf16 weights and, with ``pack_rows``, of fp32 weights for 2-32-row products
  (:mod:`exitlm.backend.layout`), fp32 GEMM for fp16 prefill;
* weights are re-strided for GEMV (column-major for fp32 ``out > in``);
* every stock Llama-family :class:`~exitlm.model.layers.Block` becomes a
  :class:`~exitlm.backend.decode_block.LeanBlock` (the lean batch-1 decoding step);
* ``model.project`` - the one product every exit and the LM head go through - is replaced
  on the instance by :meth:`DecodingBackend.project`, which uses packed copies of the output
  embeddings, unless a parallel layout already replaced it (vocabulary-parallel output of
  :mod:`exitlm.parallel.tensor` and :mod:`exitlm.parallel.infer.tp_decode`).

On a CUDA model the CPU kernels stay out of the way (every product is ``F.linear``) and the
decoding steps get static programs captured as CUDA graphs instead
(:mod:`exitlm.backend.cuda_graphs`; ``EXITLM_CUDA_GRAPHS=0`` turns them off).

Per-model state (which options were applied, packed output embeddings) lives on the model as
``model._decoding_backend``; the one process-wide piece is OpenBLAS' thread count
(:data:`~exitlm.backend.blas.BLAS`, :func:`~exitlm.backend.blas.thread_split`).

A prepared model still trains: with gradients enabled every fast module computes exactly
``F.linear`` and the block's general code. It is meant for inference: forward hooks on the
swapped modules still run (a block whose sub-modules carry hooks takes its general path), but
hooks registered globally do not see the sub-module calls the lean step leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from exitlm.backend import native
from exitlm.backend.blas import BLAS, gemv_bound, thread_split
from exitlm.backend.cuda_graphs import graphs_wanted, use_static_steps
from exitlm.backend.decode_block import LeanBlock, LeanLM, lean_capable
from exitlm.backend.layout import Packed, pack, restride
from exitlm.backend.linear import FastLinear, linear
from exitlm.backend.native_block import Scratch, build_native_block
from exitlm.backend.quant import QuantizedWeight
from exitlm.backend.quantized import quantized_project
from exitlm.model.layers import Block, Linear
from exitlm.model.transformer import EarlyExitLM

M = TypeVar("M", bound=nn.Module)

__all__ = [
    "BLAS",
    "DecodingBackend",
    "FastLinear",
    "LeanBlock",
    "gemv_bound",
    "is_prepared",
    "linear",
    "prepare_for_decoding",
    "thread_split",
]


@dataclass
class _Embedding:
    """An output embedding that is not a linear layer's weight (a tied input embedding) and
    its packed copy."""

    weight: torch.Tensor
    pack: Packed | None


_NATIVE_HEADS = {torch.float32: native.gemm_f32, torch.float16: native.gemm_f16}
NATIVE_HEAD_ROWS = 64
"""The most rows of an output-embedding product exitlm's kernels take (decoding steps,
verification, batches); longer ones (logits over whole sequences) take ``linear``."""


@dataclass
class DecodingBackend:
    """What :func:`prepare_for_decoding` applied to one model (``model._decoding_backend``).

    Attributes:
        pack_rows: whether fp32 weights have packed copies for few-row products.
        dtype, device: the weights' dtype and device when prepared (a model moved or cast
            since is prepared again).
        heads: the output embeddings :meth:`project` multiplies with, each with its packed
            copy (the LM head and own exit matrices are their :class:`FastLinear` layers).
    """

    pack_rows: bool
    dtype: torch.dtype
    device: torch.device
    heads: list[FastLinear | _Embedding] = field(default_factory=list)
    scratch: Scratch = field(default_factory=Scratch)
    """Working memory of the native blocks (:mod:`exitlm.backend.native_block`)."""

    def covers(self, model: nn.Module, pack_rows: bool) -> bool:
        """Whether ``model`` needs nothing more for ``pack_rows``."""
        ref = _reference_weight(model)
        return ((self.pack_rows or not pack_rows)
                and (ref is None or (ref.dtype == self.dtype and ref.device == self.device)))

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """:meth:`~exitlm.model.transformer.EarlyExitLM.project` through
        :func:`~exitlm.backend.linear.linear`, with the packed copy of ``weight`` when it is
        one of the model's output embeddings."""
        if isinstance(weight, QuantizedWeight):
            return quantized_project(h, weight)
        if (weight.dtype in _NATIVE_HEADS and h.dtype is weight.dtype and h.is_cpu
                and weight.is_cpu and weight.is_contiguous() and not torch.is_grad_enabled()
                and h.numel() <= NATIVE_HEAD_ROWS * h.shape[-1]
                and native.library() is not None):
            # fp32/fp16 output embeddings (SmolLM2's tied 49152 x 576) through exitlm's
            # kernels: they read the rows one after the other (fp32 ~39 GB/s against ~34 for
            # OpenBLAS' GEMV, fp16 ~40 against ~24 for torch's) and give every row the same
            # bits whatever the number of rows (plain steps, verification, small batches)
            flat = h.reshape(-1, h.shape[-1]).float()
            out = _NATIVE_HEADS[weight.dtype](flat, weight.detach(), BLAS.threads_override or 1)
            return out.to(h.dtype).reshape(*h.shape[:-1], weight.shape[0])
        for head in self.heads:
            if head.weight is weight:
                return linear(h, weight, None, head.pack)
        return linear(h, weight)

    def __getstate__(self) -> dict[str, object]:
        # a copied model is prepared again (packed copies are not copied, see FastLinear)
        return {**self.__dict__, "heads": [], "dtype": None, "scratch": Scratch()}


def _reference_weight(model: nn.Module) -> torch.Tensor | None:
    if isinstance(model, EarlyExitLM):
        return model.embed_tokens.weight
    return next(iter(model.parameters()), None)


def is_prepared(model: nn.Module, *, pack_rows: bool = False) -> bool:
    """Whether :func:`prepare_for_decoding` with these options would change nothing."""
    state = model.__dict__.get("_decoding_backend")
    return state is not None and state.covers(model, pack_rows)


@torch.no_grad()
def prepare_for_decoding(model: M, *, pack_rows: bool = False) -> M:
    """Make ``model`` decode fast on CPU, in place (module docstring); returns ``model``.

    ``pack_rows`` keeps a oneDNN-packed second copy of fp32 weights for products of 2-32
    rows (batched decoding, verification, KV recomputation): twice the weight memory, asked
    for by the decoding engine only when it multiplies several rows at a time.

    Applied once, by the loader paths that decode (``exitlm generate / bench / serve``, the
    lm-eval and HumanEval adapters) and by the :class:`~exitlm.infer.engine.Engine` when it
    finds a model unprepared. A second call is a cheap no-op unless it asks for more
    (``pack_rows``) or the model was cast or moved since (``model.to(...)``). Training code
    never calls it, and need not: gradients take the plain kernels.
    """
    state: DecodingBackend | None = model.__dict__.get("_decoding_backend")
    if state is not None and state.covers(model, pack_rows):
        return model
    pack_rows = pack_rows or (state is not None and state.pack_rows)
    lib = native.library()
    in_blocks = {id(m) for b in model.modules() if type(b) in (Block, LeanBlock)
                 for m in b.modules()} if lib is not None else set()
    # output embeddings are read by rows too when the native kernels run them (project)
    heads = {id(m) for m in _head_modules(model)} if lib is not None else set()
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FastLinear
        if isinstance(module, FastLinear):  # also a parallel layout's FastLinear subclasses
            # the native block reads its weights by rows
            module.prepare(pack_rows=pack_rows,
                           row_major=id(module) in in_blocks or id(module) in heads)
        elif isinstance(module, nn.Linear | nn.Embedding):
            restride(module.weight, row_major=id(module) in heads)
    scratch = state.scratch if state is not None else Scratch()
    for module in model.modules():
        if type(module) in (Block, LeanBlock):
            nb = None if lib is None else build_native_block(lib, module, scratch)
            module.__class__ = LeanBlock if nb is not None or lean_capable(module) else Block
            if isinstance(module, LeanBlock):
                module.native = nb
    if type(model) is EarlyExitLM and lib is not None:
        model.__class__ = LeanLM  # runs of native blocks in one call
    ref = _reference_weight(model)
    backend = DecodingBackend(pack_rows,
                              ref.dtype if ref is not None else torch.float32,
                              ref.device if ref is not None else torch.device("cpu"),
                              scratch=scratch)
    if isinstance(model, EarlyExitLM):
        backend.heads = _output_embeddings(model, state, pack_rows)
        current = model.__dict__.get("project")
        if current is None or current is quantized_project or isinstance(
                getattr(current, "__self__", None), DecodingBackend):
            model.project = backend.project  # type: ignore[method-assign]
            if backend.device.type == "cuda" and graphs_wanted():
                use_static_steps(model)  # decoding steps as CUDA graphs (backend.cuda_graphs)
    model._decoding_backend = backend  # type: ignore[assignment]
    return model


def _head_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding ``model``'s output embeddings: its LM head and own exit matrices
    and, when tied or used by the exits, the input embedding."""
    if not isinstance(model, EarlyExitLM):
        return []
    mods: list[nn.Module] = [m for m in (model.lm_head, *(e.proj for e in model.exits.values()))
                             if m is not None]
    if isinstance(model.embed_tokens.weight, torch.Tensor) and (
            model.lm_head is None or model.config.exits.output == "tied_embedding"):
        mods.append(model.embed_tokens)
    return mods


def _output_embeddings(model: EarlyExitLM, old: DecodingBackend | None,
                       pack_rows: bool) -> list[FastLinear | _Embedding]:
    """The weights the model's ``project`` multiplies with (:func:`_head_modules`): linear
    layers, packed with them, and the input embedding with a packed copy of its own (as a
    linear layer's)."""
    heads: list[FastLinear | _Embedding] = []
    for mod in _head_modules(model):
        if isinstance(mod, FastLinear):
            heads.append(mod)
        elif mod is model.embed_tokens:
            w = mod.weight
            before = next((h.pack for h in old.heads if isinstance(h, _Embedding)), None) \
                if old is not None else None
            heads.append(_Embedding(w, pack(w, before, rows=pack_rows)))
    return heads
