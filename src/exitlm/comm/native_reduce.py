"""Shared-memory collectives for the tensor-parallel ranks of one machine (``reduce.c``).

:class:`ShmReducer` is one rank's handle on a region that every rank of a tensor-parallel
group maps: :meth:`~ShmReducer.sum_` adds a tensor over the ranks in rank order (every rank
gets the same bits), :meth:`~ShmReducer.gather` concatenates the ranks' tensors. The native
block (``block.c``) calls the same sum between its partial products, so a sharded layer is
still one native call. Setting the region up across processes (its file name travels over
``torch.distributed``) is :func:`exitlm.comm.shm.shm_reducer`'s job; this
module only maps a file and calls the kernels.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from exitlm.comm.health import ParallelError
from exitlm.kernels import abi, native

FLAG_STRIDE = 16
"""int64 entries per rank's flag (``reduce.c``: one 128-byte line each)."""
PID_SLOT = 2
"""Where in its flag's line each rank writes its process id (``reduce.c``)."""
DEFAULT_CAPACITY = 1 << 16
"""Floats per rank and buffer: a round moves at most this much; larger tensors take several
rounds (a 64-row verification of a 576-wide model is 36864 floats, one round)."""

_ERRORS = {-20: "a tensor-parallel peer did not reach the collective within {t:g} s",
           -21: "a tensor-parallel peer failed (it marked the shared collective aborted)",
           -22: "bad arguments to the shared-memory collective",
           -23: "a tensor-parallel peer's process exited"}


def region_bytes(world: int, capacity: int = DEFAULT_CAPACITY) -> int:
    """Size of the shared file for ``world`` ranks: the flags, then two buffers of slots."""
    return 8 * world * FLAG_STRIDE + 2 * world * capacity * 4


def processes_visible(pids: Iterable[int]) -> bool:
    """Whether every process of ``pids`` can be seen from here (the same process namespace):
    only then may a wait watch a peer's process (``reduce.c``, ``channel.c``)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists
    return True


class ShmReducer:
    """Rank ``rank``'s handle on the shared region in ``path`` (``region_bytes(world,
    capacity)`` bytes, zero-filled by its creator). The file may be unlinked once every rank
    has mapped it; the mapping lives as long as this object."""

    def __init__(self, path: str | Path, rank: int, world: int, *,
                 capacity: int = DEFAULT_CAPACITY, timeout_s: float = 300.0) -> None:
        lib = native.library()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside [0, {world})")
        self.lib, self.rank, self.world, self.capacity = lib, rank, world, capacity
        self.timeout_s = timeout_s
        self.path = str(path)
        words = region_bytes(world, capacity) // 8
        self._map = torch.from_file(str(path), shared=True, size=words, dtype=torch.int64)
        flags = world * FLAG_STRIDE
        data = self._map[flags:].view(torch.float32)
        self._region = abi.Reduce(self._map.data_ptr(), data.data_ptr(), capacity, rank, world, 0,
                               float(timeout_s), 0)
        self._map[rank * FLAG_STRIDE + PID_SLOT] = os.getpid()
        self.pointer = ctypes.addressof(self._region)
        """The ``exitlm_reduce *`` the native block takes."""

    def watch_peers(self) -> bool:
        """Once every rank has mapped the region: let waits notice a peer whose process is
        gone (SIGKILL, a crash) at once instead of at the timeout. Only where every peer's
        process is visible from here (same process namespace); returns whether it is on."""
        if not processes_visible(int(self._map[r * FLAG_STRIDE + PID_SLOT])
                                 for r in range(self.world)):
            return False
        self._region.watch = 1
        return True

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise ParallelError(_ERRORS.get(rc, "shared-memory collective failed ({rc})").format(
                t=self.timeout_s, rc=rc))

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (contiguous float32, CPU) summed over the ranks in rank order, in place."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("ShmReducer.sum_ takes a contiguous float32 CPU tensor")
        self._check(self.lib.exitlm_reduce_sum(self.pointer, x.data_ptr(), x.numel()))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: ``(world, *x.shape)``."""
        x = x.contiguous()
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("ShmReducer.gather takes a float32 CPU tensor")
        out = torch.empty((self.world, *x.shape), dtype=torch.float32)
        self._check(self.lib.exitlm_reduce_gather(self.pointer, x.data_ptr(), x.numel(),
                                                  out.data_ptr()))
        return out

    def abort(self) -> None:
        """Mark this rank failed: peers waiting in a collective stop with an error."""
        self.lib.exitlm_reduce_abort(self.pointer)
