"""Quantized models: weight-only int8/int4 linear layers and embeddings (issue 16).

A quantized model is the same :class:`~exitlm.model.transformer.EarlyExitLM` built with other
modules, gpt-fast style (``WeightOnlyInt8QuantHandler``): every ``nn.Linear`` of the blocks and
exit heads becomes a :class:`QuantizedLinear`, the token embedding (which is also the LM head
when tied) a :class:`QuantizedEmbedding`, whose :class:`~exitlm.kernels.quant.QuantizedWeight`
computes its own product when the model's one output product
(:meth:`~exitlm.model.transformer.EarlyExitLM.project`) meets it. Norms and rotary tables stay
fp32. The fused native blocks round the activations of their int8/int4 products to int8 in
groups of 32 (as llama.cpp does; :func:`exitlm.kernels.native.int8_activations`); the products
called from the eager model (batches, prefills of 96+ positions) keep them fp32; the native
runtime's heads (exit heads, LM head, draft chains) follow the same switch as its blocks.

The quantized buffers are ordinary module buffers named ``<module>.q``, ``<module>.scales``
and ``<module>.mins``, so ``state_dict()`` / :func:`~exitlm.io.native.save_native` write a
quantized checkpoint as it is and :func:`~exitlm.io.materialize.model_from_tensors` reads it
back (``exitlm convert --quantize``).

Heads only (:func:`quantize_heads`, ``--head-dtype int8``): on a small model the LM head is a
large part of every step (SmolLM2-135M's tied 49152 x 576 head reads as much as ~8 of its 30
layers), so the output embeddings alone may be quantized: the LM head and the exits' own output
matrices become :class:`QuantizedLinear`; a tied input embedding stays float for its lookups
and gets an int8 output copy (:attr:`~exitlm.model.transformer.EarlyExitLM.tied_head`, 1.125
bytes a weight: +28% of the fp32 embedding's memory, +56% of an fp16 one's).

Exactness: :func:`~exitlm.kernels.quant.qlinear` computes every output row with the same
arithmetic whatever the number of rows multiplied together, so decoders that verify several
tokens at once (self-speculative decoding, PPD, KV recomputation) emit exactly the tokens
plain decoding emits with the same quantized weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exitlm.config import ConfigError
from exitlm.kernels.quant import (
    GROUP,
    QUANT_KINDS,
    QuantizedWeight,
    embedding_rows,
    qlinear,
    quantize,
)
from exitlm.kernels.versions import replace_data, version_of

TIED_HEAD = "tied_head"
"""The module name of a tied input embedding's quantized output copy (its buffers are
``tied_head.q`` / ``tied_head.scales`` in a state dict)."""

SUFFIXES = ("q", "scales", "mins")
"""Buffer names of a quantized module in a state dict (``mins`` for int4 only)."""


def check_kind(kind: str) -> str:
    """``kind`` if it is a supported quantization, else a :class:`ConfigError`."""
    if kind not in QUANT_KINDS:
        raise ConfigError(f"unknown quantization {kind!r}; choose one of {list(QUANT_KINDS)}")
    return kind


class _Quantized(nn.Module):
    """Holds one :class:`QuantizedWeight` as buffers ``q``, ``scales`` (and ``mins``)."""

    kind: str

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.kind = weight.kind
        self.register_buffer("q", weight.q)
        self.register_buffer("scales", weight.scales)
        if weight.mins is not None:
            self.register_buffer("mins", weight.mins)
        else:
            self.mins = None

    @property
    def weight(self) -> QuantizedWeight:
        """The quantized ``(out, in)`` weight (built from the buffers, which ``.to()`` and
        ``load_state_dict`` may have replaced)."""
        w = QuantizedWeight(self.kind, self.q, self.scales, self.mins)
        if self.mins is not None and self.mins.is_cpu:  # whether they are Q4_0's (kernel_mins,
            # for the CPU kernels), found once per buffers
            key = (self.mins.data_ptr(), version_of(self.mins), self.scales.data_ptr(),
                   version_of(self.scales))
            known = getattr(self, "_q4_0", None)
            if known is not None and known[0] == key:
                object.__setattr__(w, "_q4_0", known[1])
            else:
                self._q4_0 = (key, w.kernel_mins() is None)
        return w

    def hold(self, weight: QuantizedWeight) -> None:
        """Hold ``weight`` (of this module's kind) instead of the current one, as buffers of
        the same names: a tensor-parallel shard keeps some of a layer's output rows."""
        if weight.kind != self.kind:
            raise ValueError(f"{type(self).__name__} holds {self.kind} weights, not "
                             f"{weight.kind}")
        self.q, self.scales = weight.q, weight.scales
        if weight.mins is not None:
            self.mins = weight.mins

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"{k} -> {n}, {self.kind}, groups of {GROUP}"


class QuantizedLinear(_Quantized):
    """``y = x W^T (+ b)`` with a weight-only quantized ``W`` (fp32 in and out)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qlinear(x if x.dtype == torch.float32 else x.float(), self.weight)
        return y if self.bias is None else y + self.bias


class QuantizedEmbedding(_Quantized):
    """Token embedding rows dequantized on lookup; as the tied LM head its :attr:`weight`
    goes through :func:`quantized_project`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.weight, ids)


def quantized_project(h: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """The model's output product ``h @ weight.T`` for a plain or a quantized weight."""
    if isinstance(weight, QuantizedWeight):
        return qlinear(h if h.dtype == torch.float32 else h.float(), weight)
    return torch.nn.functional.linear(h, weight)


def cat_rows(parts: list[Any]) -> torch.Tensor | QuantizedWeight:
    """Stack weights along their output rows (q, k, v -> one fused projection): quantized
    parts of one kind stay quantized; a mix is dequantized to fp32 first."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.kind for p in parts}) == 1:
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(parts[0].kind, torch.cat([p.q for p in parts]),
                               torch.cat([p.scales for p in parts]), mins)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float()
                      for p in parts])


def quantized_numel(model: nn.Module) -> int:
    """Number of weights ``model`` holds quantized (not counted by ``parameters()``)."""
    return sum(m.weight.shape.numel() for m in model.modules() if isinstance(m, _Quantized))


def is_quantized(model: nn.Module) -> str | None:
    """The quantization kind of ``model`` (``"int8"``, ``"int4"``, ``"mixed"``) or None."""
    kinds = {m.kind for m in model.modules() if isinstance(m, _Quantized)}
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def install(model: nn.Module, name: str, weight: QuantizedWeight,
            bias: torch.Tensor | None = None) -> None:
    """Replace the linear or embedding module ``name`` of ``model`` by its quantized form
    holding ``weight`` (shape-checked), and route the model's output product through
    :func:`quantized_project`."""
    owner, _, leaf = name.rpartition(".")
    parent = model.get_submodule(owner) if owner else model
    old = getattr(parent, leaf)
    if isinstance(old, nn.Embedding | QuantizedEmbedding):
        new: nn.Module = QuantizedEmbedding(weight)
        expect = (old.num_embeddings, old.embedding_dim) if isinstance(old, nn.Embedding) \
            else tuple(old.weight.shape)
    elif isinstance(old, nn.Linear | QuantizedLinear):
        new = QuantizedLinear(weight, bias)
        expect = (old.out_features, old.in_features)
    else:
        raise TypeError(f"{name} is a {type(old).__name__}, not a linear layer or embedding")
    if tuple(weight.shape) != tuple(expect):
        raise ValueError(f"{name}: quantized weight of shape {tuple(weight.shape)}, "
                         f"the model expects {tuple(expect)}")
    setattr(parent, leaf, new)


def quantizable(model: nn.Module) -> list[str]:
    """Names of the modules :func:`quantize_model` converts: the linear layers of blocks,
    exit heads and the LM head, and the token embedding, where the input width is a multiple
    of the group size (32)."""
    names = []
    for name, mod in model.named_modules():
        if (isinstance(mod, nn.Linear) and mod.in_features % GROUP == 0) or (
                isinstance(mod, nn.Embedding) and name == "embed_tokens"
                and mod.embedding_dim % GROUP == 0):
            names.append(name)
    return names


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str) -> nn.Module:
    """Quantize every still-float linear layer and the token embedding of ``model`` to
    ``kind`` in place (modules already quantized, e.g. loaded from GGUF blocks, are kept as
    they are). Returns ``model`` in eval mode; a quantized model is for inference only."""
    check_kind(kind)

    for name in quantizable(model):
        mod = model.get_submodule(name)
        bias = getattr(mod, "bias", None)
        install(model, name, quantize(mod.weight.detach().float(), kind),
                None if bias is None else bias.detach())
    # what stays float (norms, position embeddings, biases) computes in fp32
    for p in model.parameters():
        p.requires_grad_(False)
        if p.dtype != torch.float32 and p.is_floating_point():
            replace_data(p, torch.Tensor.float)
    return model.eval()


def head_projections(model: nn.Module) -> list[str]:
    """Names of ``model``'s output-embedding linear layers: the untied LM head and the exit
    heads' own output matrices (not their MLPs or blocks)."""
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear | QuantizedLinear) and (
                name == "lm_head" or (name.startswith("exits.") and name.endswith(".proj"))):
            names.append(name)
    return names


def embedding_is_output(model: nn.Module) -> bool:
    """Whether ``model``'s input embedding also serves as an output embedding: a tied LM head,
    or exits configured with ``output="tied_embedding"``."""
    cfg = model.config  # an EarlyExitLM's
    return model.lm_head is None or (cfg.exits.output == "tied_embedding"  # type: ignore[union-attr]
                                     and len(model.exits) > 0)  # type: ignore[arg-type]


def set_tied_head(model: nn.Module, weight: QuantizedWeight) -> None:
    """Give ``model`` the quantized output copy ``weight`` ``(V, D)`` of its input embedding
    (:attr:`~exitlm.model.transformer.EarlyExitLM.tied_head`), shape-checked."""
    cfg = model.config  # an EarlyExitLM's
    expect = (cfg.vocab_size, cfg.dim)  # type: ignore[union-attr]
    if tuple(weight.shape) != expect:
        raise ValueError(f"{TIED_HEAD}: quantized weight of shape {tuple(weight.shape)}, the "
                         f"model expects {expect}")
    setattr(model, TIED_HEAD, QuantizedLinear(weight))


@torch.no_grad()
def quantize_heads(model: nn.Module, kind: str = "int8") -> nn.Module:
    """Quantize only the output embeddings of ``model`` (an
    :class:`~exitlm.model.transformer.EarlyExitLM`) to ``kind``, in place: the untied LM head
    and the exits' own output matrices become :class:`QuantizedLinear`; a float input embedding
    that is also an output embedding keeps its lookups and gets a quantized output copy
    (:func:`set_tied_head`). Blocks, norms and exit MLPs stay as they are; heads already
    quantized (an int8/int4 model's) are kept. Every head's logits then come from the same
    quantized product in every runner, so lossless strategies stay token-identical to plain
    decoding with these heads. Returns ``model`` in eval mode (for inference)."""
    check_kind(kind)
    dim = model.config.dim  # type: ignore[union-attr]
    if dim % GROUP:
        raise ConfigError(f"quantized heads: the model width {dim} is not a multiple of "
                          f"{GROUP} (the quantization group); keep the heads float")
    for name in head_projections(model):
        mod = model.get_submodule(name)
        if isinstance(mod, nn.Linear):
            bias = mod.bias
            install(model, name, quantize(mod.weight.detach().float(), kind),
                    None if bias is None else bias.detach())
    embed = model.embed_tokens  # type: ignore[union-attr]
    if (embedding_is_output(model) and getattr(model, TIED_HEAD) is None
            and isinstance(embed, nn.Embedding)):
        set_tied_head(model, quantize(embed.weight.detach().float(), kind))
    return model.eval()
