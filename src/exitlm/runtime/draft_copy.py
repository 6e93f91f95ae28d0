"""Quantized draft copies: a second runner whose weights are an int8 or int4 copy of a model's.

Self-speculative decoding drafts ``d`` tokens through the first ``E`` layers one position at a
time; on a CPU each draft step streams those layers' weights from memory, and drafting took
two thirds of a round on ``layerskip-code`` (24 layers of dim 256, fp32: 28 MB read per draft
step at ``E = 9``). A copy of the model quantized in groups of 32
(:func:`~exitlm.kernels.quantized.quantize_model`) reads about a quarter (int8) or a fifth
(int4) of those bytes per draft step. Its drafts are not the model's own exit's - the
verifier then runs all ``L`` layers over ``x0, d_1 .. d_n`` in the model's own weights,
overwriting the keys and values the copy wrote for those positions - so the output stays
plain decoding's, exactly; the drafts only decide how many tokens a round keeps (a quantized
draft model of the same network, as QSpec and quantized-draft speculative decoding use; the
copy's exits agree with the model's exits almost always).

The copy runs on the model's own KV cache: every position before a round holds the model's
keys and values (verification wrote them), and the copy's writes at the round's positions
are replaced by verification. That needs the same cache layout in both runners: a float32
model on the CPU's native kernels (the copy computes in float32, as quantized models do).

Copies are built once per model and kind and live as long as the model (held weakly), so
that every engine and ``generate`` call on the model shares them.
"""

from __future__ import annotations

import copy
import weakref
from typing import get_args

import torch
from torch import nn

from exitlm.config import DraftWeights
from exitlm.kernels import native as native_lib
from exitlm.kernels.quantized import GROUP, is_quantized, quantizable, quantize_model
from exitlm.model.layers import Linear
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.native import NativeRunner
from exitlm.runtime.runner import Runner

DRAFT_KINDS: tuple[str, ...] = tuple(w for w in get_args(DraftWeights) if w != "model")
"""The weights a draft copy may have (groups of 32 along the input, as ``--dtype``)."""

_COPIES: weakref.WeakKeyDictionary[EarlyExitLM, dict[str, NativeRunner]] = (
    weakref.WeakKeyDictionary())


def unsupported(runner: Runner, kind: str) -> str | None:
    """Why ``runner`` cannot draft through a ``kind`` copy of its model (a sentence naming
    what is expected), or None when it can."""
    if kind not in DRAFT_KINDS:
        return f"draft weights must be one of {DRAFT_KINDS}, got {kind!r}"
    model = runner.model
    if not isinstance(runner, NativeRunner) or not runner.supports("local"):
        return ("a quantized draft copy runs on the CPU's native kernels "
                f"({native_lib.unavailable_reason() or 'this runner is not the native one'})")
    if runner.dtype is not torch.float32:
        return (f"a quantized draft copy needs a float32 model (this one is "
                f"{str(runner.dtype).removeprefix('torch.')}): the copy computes in float32 "
                "and writes the model's own KV cache")
    already = is_quantized(model)
    if already is not None:
        return f"the model's weights are already {already}"
    if model.config.dim % GROUP:
        return (f"the model width {model.config.dim} is not a multiple of {GROUP} (the "
                "quantization group)")
    if model.output_layout is not None:
        return "a sharded model drafts through its own weights"
    return None


@torch.no_grad()
def quantized_copy(model: EarlyExitLM, kind: str) -> EarlyExitLM:
    """A new model with ``model``'s configuration and weights, its linear layers and token
    embedding quantized to ``kind`` (:func:`~exitlm.kernels.quantized.quantize_model`) and
    the linear layers whose input width is not a multiple of 32 in float16 (``layerskip-code``'s
    MLP output layers, input 688: fp32 they were 60% of an int4 draft step's bytes; the
    kernels multiply them with float32 activations), in eval mode. ``model`` is left exactly
    as it was: the copy owns all its tensors (the float weights it quantizes are read, never
    copied whole)."""
    big = {}
    for name in quantizable(model):
        weight = model.get_submodule(name).weight
        big[id(weight)] = weight  # deepcopy shares these; quantize_model replaces their modules
    out = copy.deepcopy(model, big)
    quantize_model(out, kind)
    for module in out.modules():  # what cannot be quantized (an input width off the group)
        if type(module) is Linear and module.weight.dtype is torch.float32:
            module.weight = nn.Parameter(module.weight.detach().half(), requires_grad=False)
    leftover = {id(p) for p in out.parameters()} & {id(p) for p in model.parameters()}
    if leftover:  # (a weight of a quantizable module always ends up replaced)
        raise RuntimeError("quantized_copy: the copy still shares weights with the model")
    return out


def draft_runner(runner: Runner, kind: str) -> NativeRunner:
    """The runner of ``runner.model``'s ``kind`` copy (:func:`quantized_copy`), built on first
    use and kept while the model lives. Raises ``ValueError`` with :func:`unsupported`'s
    reason where the copy cannot run on ``runner``'s cache."""
    reason = unsupported(runner, kind)
    if reason is not None:
        raise ValueError(reason)
    model = runner.model
    kinds = _COPIES.setdefault(model, {})
    got = kinds.get(kind)
    if got is None:
        lib = native_lib.library()
        assert lib is not None  # (a NativeRunner exists)
        with torch.inference_mode(False):  # the copy's tensors are ordinary ones
            got = kinds[kind] = NativeRunner(quantized_copy(model, kind), lib)
    # a draft vocabulary ranked after the copy was made (rank_draft_vocab) applies to it too
    got.model.token_order = model.token_order
    return got


__all__ = ["DRAFT_KINDS", "draft_runner", "quantized_copy", "unsupported"]
