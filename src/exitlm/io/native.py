"""exitlm's own checkpoint directory: ``config.json`` + ``model.safetensors`` + tokenizer.

``config.json`` is :meth:`ModelConfig.to_dict` plus ``"exitlm_format_version"`` (the marker
that tells it apart from a Hugging Face ``config.json``). ``model.safetensors`` holds every
parameter, exit heads included; tied tensors are stored once and listed in the file's
``exitlm_aliases`` metadata. A directory written with a shard size holds
``model-00001-of-0000N.safetensors`` ... instead (each shard lists the aliases of the tensors
it stores; the names say how many shards make the model, so a missing one is reported by
name). Writes go to a temporary directory that replaces the target in one ``os.replace``.
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
    FORMAT_KEY,
    SHARD_NAME,
    atomic_dir,
    open_safetensors,
    read_json,
    read_json_object,
    read_tensor,
    tensors_for_saving,
    write_safetensors,
)
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

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
        data = read_json(cfg)  # bounded: a 1.5 GB config.json is refused, not read
    except CheckpointError:  # JSON, UTF-8, too deep, too large, unreadable
        return False
    # not an object (a list, a string, null, a number): not ours; the loader that reads the
    # file next reports "expected a JSON object"
    return isinstance(data, dict) and FORMAT_KEY in data


def save_native(model: EarlyExitLM, path: str | Path, tokenizer: Tokenizer | None = None,
                *, overwrite: bool = False, dtype: torch.dtype | None = None,
                max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``path`` atomically; returns the path. An
    existing ``path`` holding files exitlm did not write is refused unless ``overwrite``.

    ``dtype``: store floating tensors in this dtype (integer buffers, quantized blocks, stay
    as they are). ``max_shard_bytes``: split the weights into shards of at most this many
    bytes of tensor data each (a tensor larger than that gets a shard of its own)."""
    target = Path(path)
    tensors, aliases = tensors_for_saving(model.state_dict())
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    shards = shard_tensors(tensors, max_shard_bytes)
    with atomic_dir(target, overwrite=overwrite) as tmp:
        for i, part in enumerate(shards):
            name = WEIGHTS if len(shards) == 1 else shard_name(i + 1, len(shards))
            mine = {a: src for a, src in aliases.items() if src in part}
            write_safetensors(tmp / name, part,
                              {FORMAT_KEY: str(FORMAT_VERSION), "exitlm_aliases": json.dumps(mine)})
        write_native_config(tmp, model.config)
        if tokenizer is not None:
            tokenizer.save(tmp)
    return target


def write_native_config(directory: Path, cfg: ModelConfig) -> None:
    """``config.json`` of an exitlm directory: ``cfg`` and the format version."""
    data = {**cfg.to_dict(), FORMAT_KEY: FORMAT_VERSION}
    (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def shard_name(index: int, count: int) -> str:
    """``model-0000I-of-0000N.safetensors`` (1-based ``index``)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def shard_tensors(tensors: dict[str, torch.Tensor],
                  max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` in order into groups of at most ``max_bytes`` bytes each (one group
    when ``max_bytes`` is ``None``; a tensor over the limit alone in its group)."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def weight_files(path: Path) -> list[Path]:
    """The weight files of an exitlm directory: ``model.safetensors``, or every shard in
    order; a :class:`CheckpointError` names a missing or inconsistent shard."""
    single = path / WEIGHTS
    if single.is_file():
        return [single]
    found: dict[int, int] = {}
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as err:
        raise CheckpointError(f"{path}: cannot list the directory ({err.strerror})") from None
    for name in names:
        m = SHARD_NAME.fullmatch(name)
        if m is not None:
            found[int(m.group(1))] = int(m.group(2))
    if not found:
        raise CheckpointError(f"{single}: weight file is missing (an exitlm directory needs it, "
                              "or shards model-00001-of-0000N.safetensors)")
    counts = sorted(set(found.values()))
    if len(counts) > 1:
        listed = ", ".join(shard_name(i, n) for i, n in sorted(found.items()))
        raise CheckpointError(f"{path}: shards of different models ({listed}); keep one set")
    count = counts[0]
    missing = [shard_name(i, count) for i in range(1, count + 1) if i not in found]
    if missing:
        raise CheckpointError(f"{path}: shard {missing[0]} is missing "
                              f"({len(found)} of {count} shards present)")
    extra = [i for i in found if not 1 <= i <= count]
    if extra:
        raise CheckpointError(f"{path}: {shard_name(extra[0], count)} is not one of the "
                              f"{count} shards")
    return [path / shard_name(i, count) for i in range(1, count + 1)]


def native_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of an exitlm directory."""
    file = path / "config.json"
    d = read_json_object(file)
    version = d.pop(FORMAT_KEY, None)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: exitlm format version {version!r}; this exitlm reads version "
            f"{FORMAT_VERSION} (upgrade exitlm or re-convert the checkpoint)"
        )
    return config_from_dict(d, file)


def config_from_dict(d: dict, file: Path) -> ModelConfig:
    """:meth:`ModelConfig.from_dict` of ``d``, read from ``file``; an invalid configuration is
    a :class:`CheckpointError` naming the file."""
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as err:
        raise CheckpointError(f"{file}: invalid model configuration: {err}") from None


def native_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(exitlm_name, tensor)`` pairs of an exitlm directory (every shard), tied
    aliases included; a name stored (or aliased) twice is a :class:`CheckpointError`."""
    files = weight_files(path)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        seen: dict[str, Path] = {}
        for file in files:
            for name, t in native_tensors_of(file):
                if name in seen:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} is also stored in {seen[name].name} "
                        "(as a tensor or an exitlm_aliases entry); each name must occur once")
                seen[name] = file
                yield name, t

    return stream()


ALIASES_KEY = "exitlm_aliases"


def _aliases_of(file: Path, meta: dict[str, str], names: set[str]) -> dict[str, list[str]]:
    """The ``exitlm_aliases`` metadata of ``file`` as source -> aliases, checked: a JSON
    object of alias name -> stored tensor name, no alias naming a stored tensor."""
    what = f"{file}: invalid {ALIASES_KEY} metadata"
    try:
        aliases = json.loads(meta.get(ALIASES_KEY, "{}"))
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{what} ({err})") from None
    if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and isinstance(src, str) for a, src in aliases.items()):
        raise CheckpointError(f"{what}: expected a JSON object of alias name -> stored tensor "
                              f"name (strings), got {meta.get(ALIASES_KEY)[:80]!r}")
    by_source: dict[str, list[str]] = {}
    for alias, src in aliases.items():
        if alias in names:
            raise CheckpointError(f"{what}: alias {alias!r} names a tensor the file stores; an "
                                  "alias must name a tensor that is not stored")
        by_source.setdefault(src, []).append(alias)
    return by_source


def native_tensors_of(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(exitlm_name, tensor)`` pairs of a safetensors file in exitlm naming."""
    with open_safetensors(file) as f:
        names = list(f.keys())
        by_source = _aliases_of(file, f.metadata() or {}, set(names))
        for name in names:
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
