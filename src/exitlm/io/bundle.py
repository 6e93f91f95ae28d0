"""Exit-head bundles: a few MB of tuned exit heads on top of a named backbone.

A bundle directory holds ``exits.json`` (the backbone's name or path, the
:class:`~exitlm.config.ExitConfig`, how it was trained) and ``exits.safetensors`` (the heads'
own tensors, ``exits.<layer>.*``). A relative ``base`` path is relative to the bundle's own
directory, as a low-rank delta's (:mod:`exitlm.io.delta`), so a bundle loads from any working
directory and moves with its backbone (:func:`base_reference`, :func:`bundle_base`). Exit
tuning with a frozen backbone writes one (``OUT/exits/``); the embedded early-exit default
``default-ee`` is the bundle shipped in ``exitlm/data/default_ee`` - SmolLM2-135M-Instruct
with heads tuned by ``exitlm train --config default-ee``.

:func:`exitlm.io.load_model` consults :func:`find_bundle` first, so ``load_model("default-ee")``
and ``load_model("runs/default-ee/exits")`` both work.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from exitlm.config import ConfigError, ExitConfig
from exitlm.errors import short_repr, warn
from exitlm.io.hf_map import CheckpointError, check_float_weight
from exitlm.io.loaded import LoadedModel, settled
from exitlm.io.st import all_finite, atomic_dir, read_json_object, stream_file
from exitlm.model.transformer import EarlyExitLM
from exitlm.schema import build

BUNDLE_META = "exits.json"
BUNDLE_WEIGHTS = "exits.safetensors"
BUNDLE_FORMAT = 2
"""The format :func:`save_bundle` writes: a path ``base`` is absolute or relative to the
bundle's directory. Format 1 (exitlm before it) recorded ``base`` as given, relative to the
working directory of the run that wrote it; :func:`bundle_base` still reads it."""
READ_FORMATS = (1, 2)
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
NAMED_BUNDLES: dict[str, Path] = {"default-ee": DATA_DIR / "default_ee"}
SHIPPED_MODELS: dict[str, str] = {"layerskip-code": "layerskip_code"}
"""Name -> folder under ``exitlm/data`` of the models shipped whole (or as a delta):
:mod:`exitlm.io.shipped`."""


def find_bundle(name_or_path: str) -> Path | None:
    """The bundle directory for a registered name or a path to a bundle, else ``None``."""
    if name_or_path in NAMED_BUNDLES:
        return NAMED_BUNDLES[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / BUNDLE_META).is_file():
        return path
    return None


def is_package_name(base: str) -> bool:
    """Whether :func:`exitlm.io.load_model` takes ``base`` as the name of a model exitlm ships
    or embeds, even where a path of that name exists."""
    return base == "default" or base in NAMED_BUNDLES or base in SHIPPED_MODELS


def base_reference(base: str, directory: Path) -> str:
    """How a bundle or delta written to ``directory`` records its base ``base`` (a name or a
    path as :func:`exitlm.io.load_model` takes it: relative to the working directory): an
    existing relative path becomes relative to ``directory`` (``./x``, ``../x``), so the
    checkpoint loads from any working directory and keeps working when the two move together;
    a name, an absolute path and a path that does not exist are kept as given."""
    path = Path(base).expanduser()
    if is_package_name(base) or path.is_absolute() or not path.exists():
        return base
    try:
        rel = Path(os.path.relpath(path.resolve(), directory.expanduser().resolve()))
    except ValueError:  # another drive (Windows): no relative path
        return str(path.resolve())
    return rel.as_posix() if rel.parts[:1] == ("..",) else f"./{rel.as_posix()}"


def save_bundle(
    model: EarlyExitLM, path: str | Path, base: str, info: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16, *, overwrite: bool = False,
) -> Path:
    """Write the exit heads of ``model`` (in ``dtype``) as a bundle on top of ``base`` (a name
    or a path as :func:`exitlm.io.load_model` takes it, recorded by :func:`base_reference`;
    ``overwrite`` as in :func:`exitlm.io.save_model`)."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous()
               for k, v in model.state_dict().items() if k.startswith("exits.")}
    exits = model.config.exits
    target = Path(path)
    meta = {
        "format": BUNDLE_FORMAT, "base": base_reference(base, target),
        "exits": {"layers": list(exits.layers), "every_layer": exits.every_layer,
                  "head": exits.head, "norm": exits.norm, "output": exits.output,
                  **({} if exits.draft is None else {"draft": dataclasses.asdict(exits.draft)}),
                  **({} if exits.threshold is None else {"threshold": exits.threshold})},
        "info": info or {},
    }
    with atomic_dir(target, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / BUNDLE_WEIGHTS), metadata={"format": "pt"})
        (tmp / BUNDLE_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return target


def read_bundle(directory: Path) -> tuple[str, ExitConfig]:
    """The backbone a bundle sits on (a name or path :func:`exitlm.io.load_model` takes) and
    its exit configuration, checked."""
    meta_file = directory / BUNDLE_META
    if not meta_file.is_file():
        raise CheckpointError(
            f"exit-head bundle {directory} is missing {BUNDLE_META}; reinstall exitlm or "
            "re-create it with: exitlm train --config default-ee"
        )
    meta = read_json_object(meta_file)
    version = meta.get("format")
    if type(version) is not int or version not in READ_FORMATS:
        raise CheckpointError(f"{meta_file}: bundle format {short_repr(version)} is not one of "
                              f"{', '.join(map(str, READ_FORMATS))} (upgrade exitlm?)")
    base = meta.get("base")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{meta_file}: 'base' (the backbone: 'default', a preset or a "
                              f"checkpoint path) must be a non-empty string, got {base!r}")
    try:
        ex = build(ExitConfig, meta.get("exits"), "exits")
    except ConfigError as err:
        raise CheckpointError(f"{meta_file}: {err}") from None
    base = bundle_base(directory, base, version)
    if find_bundle(base) is not None:
        raise CheckpointError(f"{meta_file}: a bundle's base cannot itself be a bundle")
    return base, ex


def bundle_base(directory: Path, base: str, version: int = BUNDLE_FORMAT) -> str:
    """What to load as the backbone of the bundle in ``directory`` whose ``exits.json`` names
    ``base`` (format ``version``): a name as it is, a relative path relative to the bundle's
    directory.

    A format-1 bundle (older exitlm) recorded a path relative to the working directory of the
    run that wrote it, so where it names nothing beside the bundle but a path of the working
    directory it loads that, with a warning saying so; where it names a path in both places
    and they differ, which one was meant is unknown and the bundle is refused (a bundle has no
    fingerprint of its backbone; the other one would load silently)."""
    file = directory / BUNDLE_META
    path = Path(base).expanduser()
    if is_package_name(base) or path.is_absolute():
        return str(path) if path.is_absolute() else base
    near, far = directory / path, path
    legacy = version == 1 and far.exists()
    if near.exists() and legacy and far.resolve() != near.resolve():
        raise CheckpointError(
            f"{file}: base {base!r} names both {near} (beside the bundle) and {far.absolute()} "
            "(in the working directory); the bundle was written by an older exitlm, whose base "
            "was relative to the working directory of the run that wrote it",
            hint=f"set 'base' in {file} to the absolute path of the backbone the heads were "
                 "tuned on")
    if near.exists():
        return str(near)
    if legacy:
        warn(f"{file}: base {base!r} is not beside the bundle; loading {far.absolute()} from "
             "the working directory, as the older exitlm that wrote the bundle did (set 'base' "
             "to an absolute path, or one relative to the bundle, to load it from anywhere)")
        return str(far)
    if far.exists() or "/" in base:
        raise CheckpointError(
            f"{file}: base {base!r} does not exist relative to the bundle's directory "
            f"{directory} (a bundle's relative base is relative to its own directory)",
            hint=f"set 'base' in {file} to the backbone's absolute path, or to its path "
                 "relative to the bundle's directory")
    return base  # a name: 'default', a shipped model, a preset


def attach_heads(loaded: LoadedModel, directory: Path, *, dtype: torch.dtype = torch.float32,
                 exits: ExitConfig | None = None) -> LoadedModel:
    """The bundle's exit heads on its backbone ``loaded`` (fp32, loaded with the bundle's
    exit configuration, :func:`read_bundle`); ``exits`` then re-configures them like
    ``load_model(..., exits=...)`` does."""
    heads = dict(stream_file(directory / BUNDLE_WEIGHTS))
    own = loaded.model.state_dict()
    expected = {k for k in own if k.startswith("exits.")}
    if set(heads) != expected:
        raise CheckpointError(
            f"{directory}: exit tensors {sorted(set(heads) ^ expected)[:4]} do not match the "
            f"exit configuration {loaded.config.exits}"
        )
    with torch.no_grad():
        for k, t in heads.items():
            if t.shape != own[k].shape:
                raise CheckpointError(f"{directory / BUNDLE_WEIGHTS}: tensor {k!r} has shape "
                                      f"{tuple(t.shape)}, the model {tuple(own[k].shape)}")
            check_float_weight(t, k, str(directory / BUNDLE_WEIGHTS))
            if not all_finite(t):
                warn(f"{directory / BUNDLE_WEIGHTS}: tensor {k!r} holds NaN or infinite values")
            own[k].copy_(t.to(own[k].dtype))
    return settled(loaded, f"bundle:{directory} on {loaded.source}", dtype=dtype, exits=exits)
