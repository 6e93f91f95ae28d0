"""Exit-head bundles: a few MB of tuned exit heads on top of a named backbone.

A bundle directory holds ``exits.json`` (the backbone's name or path, the
:class:`~exitlm.config.ExitConfig`, how it was trained) and ``exits.safetensors`` (the heads'
own tensors, ``exits.<layer>.*``). Exit tuning with a frozen backbone writes one
(``OUT/exits/``); the embedded early-exit default ``default-ee`` is the bundle shipped in
``exitlm/data/default_ee`` - SmolLM2-135M-Instruct with heads tuned by
``exitlm train --config default-ee``.

:func:`exitlm.io.load_model` consults :func:`find_bundle` first, so ``load_model("default-ee")``
and ``load_model("runs/default-ee/exits")`` both work.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from exitlm.config import ConfigError, ExitConfig
from exitlm.errors import warn
from exitlm.io.hf_map import CheckpointError
from exitlm.io.loaded import LoadedModel, settled
from exitlm.io.st import all_finite, atomic_dir, read_json_object, stream_file
from exitlm.model.transformer import EarlyExitLM
from exitlm.schema import build

BUNDLE_META = "exits.json"
BUNDLE_WEIGHTS = "exits.safetensors"
BUNDLE_FORMAT = 1
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
NAMED_BUNDLES: dict[str, Path] = {"default-ee": DATA_DIR / "default_ee"}


def find_bundle(name_or_path: str) -> Path | None:
    """The bundle directory for a registered name or a path to a bundle, else ``None``."""
    if name_or_path in NAMED_BUNDLES:
        return NAMED_BUNDLES[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / BUNDLE_META).is_file():
        return path
    return None


def save_bundle(
    model: EarlyExitLM, path: str | Path, base: str, info: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16, *, overwrite: bool = False,
) -> Path:
    """Write the exit heads of ``model`` (in ``dtype``) as a bundle on top of ``base``
    (``overwrite`` as in :func:`exitlm.io.save_model`)."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous()
               for k, v in model.state_dict().items() if k.startswith("exits.")}
    exits = model.config.exits
    meta = {
        "format": BUNDLE_FORMAT, "base": base,
        "exits": {"layers": list(exits.layers), "every_layer": exits.every_layer,
                  "head": exits.head, "norm": exits.norm, "output": exits.output,
                  **({} if exits.draft is None else {"draft": dataclasses.asdict(exits.draft)}),
                  **({} if exits.threshold is None else {"threshold": exits.threshold})},
        "info": info or {},
    }
    target = Path(path)
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
    if meta.get("format") != BUNDLE_FORMAT:
        raise CheckpointError(f"{meta_file}: bundle format {meta.get('format')!r} is not "
                              f"{BUNDLE_FORMAT}")
    base = meta.get("base")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{meta_file}: 'base' (the backbone: 'default', a preset or a "
                              f"checkpoint path) must be a non-empty string, got {base!r}")
    try:
        ex = build(ExitConfig, meta.get("exits"), "exits")
    except ConfigError as err:
        raise CheckpointError(f"{meta_file}: {err}") from None
    if find_bundle(base) is not None:
        raise CheckpointError(f"{meta_file}: a bundle's base cannot itself be a bundle")
    return base, ex


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
            if not all_finite(t):
                warn(f"{directory / BUNDLE_WEIGHTS}: tensor {k!r} holds NaN or infinite values")
            own[k].copy_(t.to(own[k].dtype))
    return settled(loaded, f"bundle:{directory} on {loaded.source}", dtype=dtype, exits=exits)
