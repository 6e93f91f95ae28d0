"""Build a model from a stream of named tensors without a second copy of the weights.

The model is created on the ``meta`` device (no storage), then every incoming tensor is
checked against the parameter it replaces and assigned in place. Whatever is still on
``meta`` at the end is missing from the checkpoint and reported by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from exitlm.config import ModelConfig
from exitlm.errors import warn
from exitlm.io.hf_map import CheckpointError
from exitlm.io.st import all_finite
from exitlm.model.layers import rope_inv_freq
from exitlm.model.transformer import EarlyExitLM


def model_from_tensors(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source: str,
    dtype: torch.dtype = torch.float32,
    allow_missing_exits: bool = False,
) -> EarlyExitLM:
    """Create an :class:`EarlyExitLM` for ``cfg`` whose parameters come from ``tensors``.

    Args:
        tensors: ``(exitlm_name, tensor)`` pairs, consumed lazily.
        source: file or directory named in error messages.
        allow_missing_exits: exit-head parameters absent from the stream are freshly
            initialised (a backbone checkpoint loaded with new exits) instead of an error.
    """
    with torch.device("meta"):
        model = EarlyExitLM(cfg)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    non_finite: list[str] = []
    for name, tensor in tensors:
        if name not in params:
            raise CheckpointError(
                f"{source}: tensor {name!r} does not belong to this model configuration "
                f"(architecture {cfg.name!r}, exits {list(cfg.exits.layers)})"
            )
        expected = tuple(params[name].shape)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the configuration "
                f"expects {expected}"
            )
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{source}: tensor {name!r} has non-float dtype {tensor.dtype}")
        if not all_finite(tensor):
            non_finite.append(name)
        _set_param(model, name, tensor.to(dtype))
        seen.add(name)
    if non_finite:
        shown = ", ".join(non_finite[:5]) + (" ..." if len(non_finite) > 5 else "")
        warn(f"{source}: tensor(s) {shown} hold NaN or infinite values ({len(non_finite)} "
             "tensor(s)); the model's outputs will not be finite")
    missing = [n for n in params if n not in seen]
    exit_missing = [n for n in missing if n.startswith("exits.")]
    if allow_missing_exits and exit_missing:
        _init_fresh(model, exit_missing, dtype)
        missing = [n for n in missing if not n.startswith("exits.")]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: missing tensors {shown} ({len(missing)} in all)")
    if model.rope_inv_freq is not None:
        model.rope_inv_freq = rope_inv_freq(cfg.hdim, cfg.rope_theta, cfg.rope_scaling)
    return model.eval()


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=True))


def _init_fresh(model: EarlyExitLM, names: list[str], dtype: torch.dtype) -> None:
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        meta = getattr(module, leaf)
        fresh = torch.empty(meta.shape, dtype=dtype)
        if leaf == "bias":
            nn.init.zeros_(fresh)
        elif isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(fresh, std=0.02)
        else:  # norm weights
            nn.init.ones_(fresh)
        setattr(module, leaf, nn.Parameter(fresh))
