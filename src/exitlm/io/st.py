"""Safetensors streaming and atomic writes shared by every checkpoint format.

Nothing here unpickles: tensors come from ``safetensors.safe_open`` one at a time, and every
failure (truncated file, bad header, unreadable tensor) becomes a
:class:`~exitlm.io.hf_map.CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exitlm.errors import ExitlmError
from exitlm.io.dirs import creating
from exitlm.io.hf_map import CheckpointError
from exitlm.paths import remove_stale_temps, temp_prefix
from exitlm.textfile import read_text_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def refuse_pickle(path: Path) -> CheckpointError:
    """The error for a pickled PyTorch checkpoint, which exitlm never loads."""
    return CheckpointError(
        f"{path}: pickled PyTorch checkpoints are not loaded (unpickling runs arbitrary code); "
        "convert it to safetensors first, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)"
    )


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open(path)`` whose failures name the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file is missing")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:
        raise CheckpointError(
            f"{path}: not a valid safetensors file (truncated or corrupt header?): {err}"
        ) from err
    with handle as f:
        yield f


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of a safetensors file (header only, no data read)."""
    with open_safetensors(path) as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def read_tensor(f: Any, path: Path, name: str) -> torch.Tensor:
    """One tensor of an open safetensors file, errors naming file and tensor."""
    try:
        return f.get_tensor(name)
    except Exception as err:
        raise CheckpointError(f"{path}: cannot read tensor {name!r}: {err}") from err


def stream_file(path: Path, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from one safetensors file, one tensor at a time."""
    with open_safetensors(path) as f:
        for name in names if names is not None else list(f.keys()):
            yield name, read_tensor(f, path, name)


MAX_JSON_BYTES = 64 * 2**20
"""Config-like JSON files (config.json, indexes, exits.json) larger than this are refused."""


def read_json(path: Path) -> Any:
    """Parse a JSON file, errors naming the file; only a regular file of at most
    ``MAX_JSON_BYTES`` is read (a ``config.json`` that is a device would never end)."""
    if not path.exists():
        raise CheckpointError(f"{path}: file is missing")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a JSON file")
    try:
        text = read_text_file(path, MAX_JSON_BYTES, expected="a JSON file")
    except ExitlmError as err:
        raise CheckpointError(str(err)) from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, too deep, ...
        raise CheckpointError(f"{path}: invalid JSON ({err})") from err


def read_json_object(path: Path) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold one JSON object (config.json, delta.json,
    exits.json); anything else is a :class:`CheckpointError` naming the file."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating-point ``tensor`` is finite (a fast sum first, the
    element-wise test only when the sum is not finite)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def tensors_for_saving(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU copies of ``tensors``, each storage saved once.

    Returns the tensors to write and ``{alias: stored_name}`` for names that share a stored
    tensor (tied weights). Parameters may be non-contiguous (a layout optimisation re-strides
    weights), so everything goes through ``.contiguous()``.
    """
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, t in tensors.items():
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t.to("cpu").contiguous()
    return out, aliases


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write tensors with ``format=pt`` metadata (what ``transformers`` expects)."""
    save_file(tensors, str(path), metadata={"format": "pt", **meta})


# Files exitlm's checkpoint writers produce. A directory holding only these may be replaced;
# anything else in it was put there by someone else and is never deleted without --overwrite.
EXITLM_FILES = frozenset({
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "exitlm_exits.safetensors", "exitlm_exits.json", "exits.json", "exits.safetensors",
    "exitlm_train.json", "optimizer.safetensors", "state.json",
    "delta.json", "delta.safetensors",
})
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
"""A shard of a sharded exitlm directory (:mod:`exitlm.io.native`): 1-based index, count."""


FORMAT_KEY = "exitlm_format_version"
"""The key of an exitlm directory's ``config.json`` holding its format version
(:mod:`exitlm.io.native`): the marker that tells it apart from a Hugging Face one."""

EXPORT_KEY = "exitlm_export"
"""Written into the ``config.json`` of a Hugging Face export (transformers keeps unknown keys
as attributes): how a later write knows the directory is exitlm's to replace."""

_MARKER_FILES = ("exitlm_exits.json", "exitlm_train.json", "delta.json", "exits.json",
                 "state.json")
"""Files only exitlm writes under these names (exit heads of an export, a training run's
model, a delta, a bundle, a checkpoint)."""


def written_by_exitlm(target: Path) -> bool:
    """Whether directory ``target`` holds what an exitlm write left: one of
    :data:`_MARKER_FILES`, or a ``config.json`` carrying exitlm's format or export key
    (file names alone do not say: a user's own checkpoint has a ``config.json`` too)."""
    if any((target / name).is_file() for name in _MARKER_FILES):
        return True
    try:
        config = read_json(target / "config.json")
    except CheckpointError:
        return False
    return isinstance(config, dict) and (
        FORMAT_KEY in config or EXPORT_KEY in config)


def check_replaceable(target: Path, overwrite: bool = False) -> None:
    """Refuse to replace ``target`` unless it is missing, empty, or holds only files exitlm
    writes, one of them marking it as exitlm's (:func:`written_by_exitlm`); a symbolic link is
    not replaced either (``overwrite=True`` accepts any directory or link)."""
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_symlink() and not overwrite:
        raise CheckpointError(f"{target} is a symbolic link; refusing to replace it",
                              hint="choose another output path, or pass --overwrite to "
                                   "replace the link (not what it points to)")
    if not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory",
                              hint="remove it or choose another output path")
    if overwrite:
        return
    try:
        entries = sorted(os.listdir(target))
    except OSError as err:
        raise CheckpointError(f"{target}: cannot list the directory ({err.strerror})") from err
    foreign = [e for e in entries
               if not (e in EXITLM_FILES or SHARD_NAME.fullmatch(e)) or not (target / e).is_file()]
    if entries and not foreign and not written_by_exitlm(target):
        foreign = [f"{e} (no exitlm marker)" for e in entries[:5]]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5
                                          else "")
        raise CheckpointError(
            f"{target} is not empty and holds files exitlm did not write ({shown}); "
            "refusing to replace it",
            hint="choose a new or empty directory, or pass --overwrite to replace the "
                 "directory and everything in it",
        )


@contextlib.contextmanager
def atomic_dir(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``target``; on success it replaces ``target``.

    The new directory appears under its final name in one ``os.replace``; a previous
    ``target`` is moved aside first and removed after. On error the temporary directory is
    deleted, as are the folders created on the way to it (while empty), and ``target`` is
    untouched. A ``target`` holding files exitlm did not write is refused unless
    ``overwrite`` (:func:`check_replaceable`); temporaries a killed writer left are removed
    first (:func:`remove_stale_temps`); a ``target`` that cannot be created
    (a read-only file system, a file where a folder should be) is an
    :class:`~exitlm.io.dirs.PathError` naming it.
    """
    target = Path(target)
    check_replaceable(target, overwrite)
    made = [p for p in reversed(target.absolute().parents) if not p.exists()]  # outermost first
    with creating(target):  # a path that cannot be created: one line naming it and why
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(target)
            tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name, "tmp"),
                                        dir=target.parent))
        except BaseException:
            _remove_empty(made)
            raise
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should not be
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o666 & ~umask)
        old = None
        if target.exists():
            check_replaceable(target, overwrite)  # it may have changed while we wrote
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name, "old"),
                                        dir=target.parent))
            os.replace(target, old / "d")
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise


def _remove_empty(folders: list[Path]) -> None:
    """Remove the ``folders`` (outermost first) a failed write created on the way to its
    target, innermost first, while they are empty (anything put there since is kept)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return
