"""Build a model from a stream of named tensors without a second copy of the weights.

The model is created on the ``meta`` device (no storage), then every incoming tensor is
checked against the parameter it replaces and assigned in place. Whatever is still on
``meta`` at the end is missing from the checkpoint and reported by name. Messages name the
checkpoint's own file and tensors (an ``origin``: ``model.layers.0.self_attn.q_proj.weight``
..., not exitlm's fused ``layers.0.attn.wqkv.weight``).
"""


from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from exitlm.config import ModelConfig
from exitlm.errors import warn
from exitlm.io.hf_map import CheckpointError, check_float_weight
from exitlm.io.st import all_finite
from exitlm.kernels.quant import QuantizedWeight
from exitlm.kernels.quantized import TIED_HEAD, install, set_tied_head
from exitlm.model.layers import rope_inv_freq
from exitlm.model.transformer import EarlyExitLM

Origin = Callable[[str], tuple[str, list[str]]]
"""Where the tensor of an exitlm name came from: the file, and the checkpoint's names of the
tensors it is made of (several for a fused one)."""


def model_from_tensors(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    *,
    source: str,
    dtype: torch.dtype = torch.float32,
    allow_missing_exits: bool = False,
    origin: Origin | None = None,
) -> EarlyExitLM:
    """Create an :class:`EarlyExitLM` for ``cfg`` whose parameters come from ``tensors``.

    Args:
        tensors: ``(exitlm_name, tensor)`` pairs, consumed lazily. A linear or embedding
            weight may come quantized: as a :class:`~exitlm.kernels.quant.QuantizedWeight`
            under the weight's name (GGUF blocks) or as the buffers ``<module>.q``,
            ``.scales`` (and ``.mins``) of a saved quantized model; its module is replaced by
            the quantized one (:func:`exitlm.kernels.quantized.install`).
        source: file or directory named in error messages.
        allow_missing_exits: exit-head parameters absent from the stream are freshly
            initialised (a backbone checkpoint loaded with new exits) instead of an error.
        origin: how messages name a tensor (:data:`Origin`); default: ``source`` and exitlm's
            name, which is the checkpoint's own in exitlm's format.
    """
    def named(name: str) -> tuple[str, list[str], str]:
        """The file, the checkpoint's names and ``"tensor 'x'"`` / ``"tensors 'q', 'k', 'v'"``
        for exitlm's tensor ``name``."""
        where, names = origin(name) if origin is not None else (source, [name])
        names = names or [name]  # a name the checkpoint's naming does not know
        plural = "s" if len(names) > 1 else ""
        return where, names, f"tensor{plural} {', '.join(repr(n) for n in names)}"

    with torch.device("meta"), _no_init():
        model = EarlyExitLM(cfg)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    non_finite: list[str] = []
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        owner, _, leaf = name.rpartition(".")
        if leaf in _QUANT_BUFFERS and (f"{owner}.weight" in params or owner == TIED_HEAD):
            got = parts.setdefault(owner, {})
            got[leaf] = tensor
            qw = _assembled(got, f"{source}: {owner}")
            if qw is None:
                continue
            del parts[owner]
            if owner == TIED_HEAD:  # an int8 head's copy of the input embedding
                _set_tied_head(model, qw, source)
                continue
            name, tensor = f"{owner}.weight", qw
        if name not in params:
            where, _, what = named(name)
            raise CheckpointError(
                f"{where}: {what} does not belong to this model configuration "
                f"(architecture {cfg.name!r}, exits {list(cfg.exits.layers)})"
            )
        expected = tuple(params[name].shape)
        if tuple(tensor.shape) != expected:
            where, names, what = named(name)
            joint = " together" if len(names) > 1 else ""
            raise CheckpointError(
                f"{where}: {what} has{joint} shape {tuple(tensor.shape)}, the configuration "
                f"expects {expected}"
            )
        if isinstance(tensor, QuantizedWeight):
            _install_quantized(model, name, tensor)
            seen.add(name)
            continue
        where, names, _ = named(name)
        check_float_weight(tensor, "/".join(names), where)
        if not all_finite(tensor):
            non_finite.append(name)
        _set_param(model, name, tensor.to(dtype))
        seen.add(name)
    if non_finite:
        files = sorted({named(n)[0] for n in non_finite})
        groups = [named(n)[1] for n in non_finite]  # a fused weight: one or more of its parts
        shown = "; ".join(", ".join(map(repr, g)) if len(g) == 1 else
                          f"one or more of {', '.join(map(repr, g))}" for g in groups[:5])
        warn(f"{', '.join(files)}: tensor(s) {shown}{' ...' if len(groups) > 5 else ''} hold "
             f"NaN or infinite values ({len(groups)} weight(s)); the model's outputs will not "
             "be finite")
    if parts:
        owner, got = next(iter(parts.items()))
        raise CheckpointError(f"{source}: quantized weight {owner!r} is incomplete (has "
                              f"{sorted(got)}, needs q, scales and, for int4, mins)")
    missing = [n for n in params if n not in seen]
    exit_missing = [n for n in missing if n.startswith("exits.")]
    if allow_missing_exits and exit_missing:
        _init_fresh(model, exit_missing, dtype)
        missing = [n for n in missing if not n.startswith("exits.")]
    if missing:
        names = [n for name in missing for n in named(name)[1]]
        shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        raise CheckpointError(f"{source}: missing tensors {shown} ({len(names)} in all)")
    if model.rope_inv_freq is not None:
        model.rope_inv_freq = rope_inv_freq(cfg.hdim, cfg.rope_theta, cfg.rope_scaling)
    return model.eval()


_QUANT_BUFFERS = ("q", "scales", "mins")
_INIT_FUNCTIONS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s functions as no-ops while a model is built on ``meta`` (its
    parameters are all replaced): on ``meta`` they run through ``torch._refs``, whose first use
    imports ``torch._dynamo`` - ~2 s of every process that loads a model, a pipeline stage's
    start-up included. Module-wide while it lasts (as ``transformers``' loader does it)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def skip(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, skip)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def model_tensors(model: EarlyExitLM) -> dict[str, torch.Tensor]:
    """What :func:`rebuild_model` needs to make ``model`` again in another process: its
    parameters and the buffers of its quantized modules (``<module>.q``, ``.scales``,
    ``.mins``), detached, on their own storage (which ``torch.multiprocessing`` moves to shared
    memory when they are sent to a spawned process: no copy)."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    out.update({name: b.detach() for name, b in model.named_buffers()
                if name.rpartition(".")[2] in _QUANT_BUFFERS})
    return out


def rebuild_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str
                  ) -> EarlyExitLM:
    """The model :func:`model_tensors` described, on those very tensors (float parameters
    keep their dtype, quantized weights stay quantized)."""
    dtype = next((t.dtype for name, t in tensors.items()
                  if t.is_floating_point() and name.rpartition(".")[2] not in _QUANT_BUFFERS),
                 torch.float32)
    return model_from_tensors(cfg, tensors.items(), source=source, dtype=dtype)


def _assembled(got: dict[str, torch.Tensor], what: str) -> QuantizedWeight | None:
    """The quantized weight made of a saved module's buffers once they are all there."""
    q, scales = got.get("q"), got.get("scales")
    if q is None or scales is None:
        return None
    if q.dtype == torch.int8:
        kind = "int8"
    elif q.dtype == torch.uint8:
        kind = "int4"
        if "mins" not in got:
            return None
    else:
        raise CheckpointError(f"{what}.q has dtype {q.dtype}; expected int8 or uint8")
    if scales.dtype != torch.float32 or scales.dim() != 2 or q.dim() != 2:
        raise CheckpointError(f"{what}: quantized buffers of unexpected dtype/shape")
    return QuantizedWeight(kind, q, scales, got.get("mins"))


def _install_quantized(model: nn.Module, name: str, weight: QuantizedWeight) -> None:
    owner = name.rpartition(".")[0]
    module = model.get_submodule(owner)
    bias = getattr(module, "bias", None)
    keep = None if bias is None or bias.device.type == "meta" else bias
    install(model, owner, weight, keep)


def _set_tied_head(model: EarlyExitLM, weight: QuantizedWeight, source: str) -> None:
    try:
        set_tied_head(model, weight)
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    # a tensor made under torch.inference_mode (a decoding model's re-strided weights, which
    # rebuild_model may be handed in-process) cannot require grad
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=not tensor.is_inference()))


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
