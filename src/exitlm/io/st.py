"""Safetensors streaming and atomic writes shared by every checkpoint format.

Nothing here unpickles: tensors come from ``safetensors.safe_open`` one at a time, and every
failure (truncated file, bad header, unreadable tensor) becomes a
:class:`~exitlm.io.hf_map.CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exitlm.io.hf_map import CheckpointError

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


def read_json(path: Path) -> Any:
    """Parse a JSON file, errors naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: file is missing") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: invalid JSON ({err})") from err


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


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary directory next to ``target``; on success it replaces ``target``.

    The new directory appears under its final name in one ``os.replace``; a previous
    ``target`` is moved aside first and removed after. On error the temporary directory is
    deleted and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
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
            if not target.is_dir():
                raise FileExistsError(f"{target} exists and is not a directory")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "d")
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file through a temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
