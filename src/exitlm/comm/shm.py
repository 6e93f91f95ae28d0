"""Shared memory between the decoding processes of one machine: the tensor-parallel sums
(:func:`shm_reducer`, ``reduce.c``) and the pipeline stages' message channels
(:func:`shm_channels`, ``channel.c``).

Both are set up the same way (:func:`_shared_file`). Rank 0 creates a zero-filled file under
``/dev/shm`` (the temporary directory where there is none) with a name of its own making and
a random token in its first line; the name and token travel to the other ranks over
``torch.distributed``; each rank that finds the file with that token maps it. The ranks then
agree (one gloo all-reduce) whether every one of them succeeded - ranks on other machines do
not find the file - and rank 0 removes the file, which only it wrote: the mappings stay valid,
and nothing is left behind if a rank dies later. ``EXITLM_SHM=0`` (or the older
``EXITLM_TP_SHM=0``) keeps everything on gloo.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from exitlm.comm.native_channel import DEFAULT_CAPACITY as CHANNEL_CAPACITY
from exitlm.comm.native_channel import ShmChannel, channel_bytes
from exitlm.comm.native_reduce import (
    DEFAULT_CAPACITY,
    ShmReducer,
    processes_visible,
    region_bytes,
)
from exitlm.env import switched_off
from exitlm.kernels import native

_NAME_BYTES = 512
_TOKEN_AT = 64  # byte offset of the token: a word that neither protocol uses (reduce.c's
# flags[8], channel 0's header word 8)
T = TypeVar("T")


def shm_wanted() -> bool:
    """Whether shared memory may be used: the native library loads and neither
    ``EXITLM_SHM`` nor ``EXITLM_TP_SHM`` says off."""
    for name in ("EXITLM_SHM", "EXITLM_TP_SHM"):
        if switched_off(name):
            return False
    return native.library() is not None


def _shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _create(nbytes: int, kind: str) -> tuple[Path, int]:
    """A new zero-filled file of ``nbytes`` and the token written into it."""
    token = secrets.randbits(62) | 1
    path = _shm_dir() / f"exitlm-{kind}-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.pwrite(fd, token.to_bytes(8, "little"), _TOKEN_AT)
    finally:
        os.close(fd)
    return path, token


def _shared_file(rank: int, nbytes: int, kind: str, group: Any,
                 open_it: Callable[[Path], T]) -> T | None:
    """Every rank of ``group`` calls this together: rank 0 creates the file, every rank that
    finds it (right size, right token) returns ``open_it(path)``; all get ``None`` unless all
    succeeded."""
    want = shm_wanted()
    msg = torch.zeros(_NAME_BYTES + 8, dtype=torch.uint8)
    path: Path | None = None
    if rank == 0 and want:
        try:
            path, token = _create(nbytes, kind)
            name = str(path).encode()
            if len(name) <= _NAME_BYTES:
                msg[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
                msg[_NAME_BYTES:] = torch.tensor(list(token.to_bytes(8, "little")),
                                                 dtype=torch.uint8)
        except OSError:
            path = None
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(msg, src=src, group=group)
    handle: T | None = None
    raw = bytes(msg[:_NAME_BYTES].tolist()).rstrip(b"\0")
    token_got = int.from_bytes(bytes(msg[_NAME_BYTES:].tolist()), "little")
    if want and raw:
        found = Path(raw.decode())
        try:
            if found.is_file() and found.stat().st_size == nbytes:
                with open(found, "rb") as f:
                    f.seek(_TOKEN_AT)
                    if int.from_bytes(f.read(8), "little") == token_got:
                        handle = open_it(found)
        except (OSError, RuntimeError, ValueError):
            handle = None
    ok = torch.tensor([1 if handle is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if path is not None:
        path.unlink(missing_ok=True)
    return handle if int(ok) == 1 else None


def shm_reducer(rank: int, world: int, group: Any = None, *, timeout_s: float = 300.0,
                capacity: int = DEFAULT_CAPACITY) -> ShmReducer | None:
    """Every rank of ``group`` calls this together; each gets its
    :class:`~exitlm.comm.native_reduce.ShmReducer`, or all get ``None`` (ranks on several
    machines, no native kernels, ``EXITLM_SHM=0``): then the collectives stay on gloo."""
    reducer = _shared_file(
        rank, region_bytes(world, capacity), "tp", group,
        lambda p: ShmReducer(p, rank, world, capacity=capacity, timeout_s=timeout_s))
    if reducer is not None:
        reducer.watch_peers()  # every rank wrote its process id before the all-reduce
    return reducer


def pipeline_pairs(world: int) -> list[tuple[int, int]]:
    """The one-way channels of a ``world``-stage pipeline, in file order: each stage to the
    next (commands and hidden states), then each later stage back to stage 0 (decisions)."""
    return [(s, s + 1) for s in range(world - 1)] + [(s, 0) for s in range(1, world)]


def shm_channels(rank: int, world: int, group: Any = None, *,
                 capacity: int = CHANNEL_CAPACITY) -> dict[tuple[int, int], ShmChannel] | None:
    """Every rank of a ``world``-stage pipeline calls this together; each gets its ends of
    the :func:`pipeline_pairs` channels, keyed ``(src, dst)``, or all get ``None`` (then the
    messages stay on gloo)."""
    pairs = pipeline_pairs(world)

    def open_ends(path: Path) -> dict[tuple[int, int], ShmChannel]:
        return {(a, b): ShmChannel(path, i, sender=a == rank, capacity=capacity)
                for i, (a, b) in enumerate(pairs) if rank in (a, b)}

    ends = _shared_file(rank, len(pairs) * channel_bytes(capacity), "pp", group, open_ends)
    if ends is not None and processes_visible(end.peer_pid() for end in ends.values()):
        for end in ends.values():
            end.watch_peer()
    return ends
