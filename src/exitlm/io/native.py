"""exitlm's own checkpoint directory: ``config.json`` + ``model.safetensors`` + tokenizer.

``config.json`` is :meth:`ModelConfig.to_dict` plus ``"exitlm_format_version"`` (the marker
that tells it apart from a Hugging Face ``config.json``). ``model.safetensors`` holds every
parameter, exit heads included; tied tensors are stored once and listed in the file's
``exitlm_aliases`` metadata. Writes go to a temporary directory that replaces the target in
one ``os.replace``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from exitlm.config import ConfigError, ModelConfig
from exitlm.errors import ExitlmError
from exitlm.io.hf_map import CheckpointError
from exitlm.io.st import (
    atomic_dir,
    open_safetensors,
    read_json,
    read_tensor,
    tensors_for_saving,
    write_safetensors,
)
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

FORMAT_KEY = "exitlm_format_version"
FORMAT_VERSION = 1
EXITS_WEIGHTS = "exitlm_exits.safetensors"
"""A Hugging Face export's exit heads, beside the backbone's weights (:mod:`exitlm.io.save`)."""
EXITS_CONFIG = "exitlm_exits.json"
WEIGHTS = "model.safetensors"


def is_native_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_native`."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return FORMAT_KEY in json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, OSError):  # JSON, UTF-8, too deep, unreadable
        return False


def save_native(model: EarlyExitLM, path: str | Path, tokenizer: Tokenizer | None = None,
                *, overwrite: bool = False) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``path`` atomically; returns the path. An
    existing ``path`` holding files exitlm did not write is refused unless ``overwrite``."""
    target = Path(path)
    tensors, aliases = tensors_for_saving(model.state_dict())
    cfg = model.config.to_dict()
    cfg[FORMAT_KEY] = FORMAT_VERSION
    with atomic_dir(target, overwrite=overwrite) as tmp:
        write_safetensors(
            tmp / WEIGHTS, tensors,
            {FORMAT_KEY: str(FORMAT_VERSION), "exitlm_aliases": json.dumps(aliases)},
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp)
    return target


def native_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of an exitlm directory."""
    file = path / "config.json"
    d = read_json(file)
    if not isinstance(d, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    version = d.pop(FORMAT_KEY, None)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: exitlm format version {version!r}; this exitlm reads version "
            f"{FORMAT_VERSION} (upgrade exitlm or re-convert the checkpoint)"
        )
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as err:
        raise CheckpointError(f"{file}: invalid model configuration: {err}") from None


def native_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(exitlm_name, tensor)`` pairs of an exitlm directory, tied aliases included."""
    file = path / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{file}: weight file is missing (an exitlm directory needs it)")
    return native_tensors_of(file)


def native_tensors_of(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(exitlm_name, tensor)`` pairs of a safetensors file in exitlm naming."""
    with open_safetensors(file) as f:
        meta = f.metadata() or {}
        try:
            aliases: dict[str, str] = json.loads(meta.get("exitlm_aliases", "{}"))
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{file}: invalid exitlm_aliases metadata ({err})") from err
        by_source: dict[str, list[str]] = {}
        for alias, src in aliases.items():
            by_source.setdefault(src, []).append(alias)
        for name in list(f.keys()):
            t = read_tensor(f, file, name)
            yield name, t
            for alias in by_source.get(name, ()):
                yield alias, t


def load_tokenizer_dir(path: Path) -> Tokenizer | None:
    """The tokenizer saved in ``path`` (``None`` when there is no ``tokenizer.json``)."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.load(path)
    except ExitlmError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path / 'tokenizer.json'}: cannot load tokenizer: {err}") from err
