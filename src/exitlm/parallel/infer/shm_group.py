"""Setting up the shared-memory collectives of a tensor-parallel group:
:func:`shm_reducer`.

Rank 0 creates a zero-filled file under ``/dev/shm`` (the temporary directory where there is
none) with a name of its own making and a random token in it; the name and token travel to
the other ranks over ``torch.distributed``; each rank that finds the file with that token maps
it (:class:`~exitlm.backend.native_reduce.ShmReducer`). The ranks then agree (one gloo
all-reduce) whether every one of them succeeded - ranks on other machines do not find the file
- and rank 0 removes the file, which only it wrote: the mappings stay valid, and nothing is
left behind if a rank dies later.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from exitlm.backend import native
from exitlm.backend.native_reduce import DEFAULT_CAPACITY, ShmReducer, region_bytes

_NAME_BYTES = 512
_OFF = ("0", "false", "no", "off")


def _shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _create(world: int, capacity: int) -> tuple[Path, int]:
    """A new zero-filled region file for ``world`` ranks and the token written into it."""
    token = secrets.randbits(62) | 1
    path = _shm_dir() / f"exitlm-tp-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, region_bytes(world, capacity))
        os.pwrite(fd, token.to_bytes(8, "little"), 8)  # flags[1]: unused by the protocol
    finally:
        os.close(fd)
    return path, token


def shm_reducer(rank: int, world: int, group: Any = None, *, timeout_s: float = 300.0,
                capacity: int = DEFAULT_CAPACITY) -> ShmReducer | None:
    """Every rank of ``group`` calls this together; each gets its
    :class:`~exitlm.backend.native_reduce.ShmReducer`, or all get ``None`` (ranks on several
    machines, no native kernels, ``EXITLM_TP_SHM=0``): then the collectives stay on gloo."""
    want = (os.environ.get("EXITLM_TP_SHM", "1").strip().lower() not in _OFF
            and native.library() is not None)
    msg = torch.zeros(_NAME_BYTES + 8, dtype=torch.uint8)
    path: Path | None = None
    if rank == 0 and want:
        try:
            path, token = _create(world, capacity)
            name = str(path).encode()
            if len(name) <= _NAME_BYTES:
                msg[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
                msg[_NAME_BYTES:] = torch.tensor(list(token.to_bytes(8, "little")),
                                                 dtype=torch.uint8)
        except OSError:
            path = None
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(msg, src=src, group=group)
    reducer: ShmReducer | None = None
    raw = bytes(msg[:_NAME_BYTES].tolist()).rstrip(b"\0")
    token_got = int.from_bytes(bytes(msg[_NAME_BYTES:].tolist()), "little")
    if want and raw:
        found = Path(raw.decode())
        try:
            if found.is_file() and found.stat().st_size == region_bytes(world, capacity):
                with open(found, "rb") as f:
                    f.seek(8)
                    if int.from_bytes(f.read(8), "little") == token_got:
                        reducer = ShmReducer(found, rank, world, capacity=capacity,
                                                 timeout_s=timeout_s)
        except (OSError, RuntimeError):
            reducer = None
    ok = torch.tensor([1 if reducer is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if path is not None:
        path.unlink(missing_ok=True)
    if int(ok) != 1:
        return None
    assert reducer is not None
    reducer.watch_peers()  # every rank wrote its process id before the all-reduce
    return reducer
