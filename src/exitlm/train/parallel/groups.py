"""Process groups, the tensor-parallel device mesh and the device of one training process.

:meth:`ProcessGroups.create` turns validated :class:`~exitlm.train.parallel.dims.ParallelDims`
into the groups a layout talks over - all processes, this pipeline, this stage's data-parallel
replicas, this stage's tensor-parallel shards (and its DTensor mesh) - every one created with
``parallel.timeout_s``, so no collective can hang longer than that (:mod:`.health` names the
rank that stopped). Without ``torch.distributed`` (one process) every group is ``None`` and
every collective helper does nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exitlm.comm.health import Heartbeat, ParallelError, guard
from exitlm.comm.launch import init_torchrun_group
from exitlm.config import ConfigError
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims


def choose_device(spec: str) -> torch.device:
    """``train.device``: ``auto`` (this process's GPU under torchrun, else the CPU), ``cpu``,
    ``cuda`` or ``cuda:N``; errors name the setting."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        return torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={spec!r} but no CUDA device is available here",
                          hint="use train.device=auto or train.device=cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"train.device={spec!r} but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def init_distributed(device: torch.device, timeout_s: float) -> tuple[int, int]:
    """Join the job ``torchrun`` started (``WORLD_SIZE`` > 1) unless already joined: NCCL on
    GPUs, gloo on CPUs, with ``timeout_s`` on the default group. Returns (rank, world)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_torchrun_group(backend, timeout_s, setting="parallel.timeout_s")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class ProcessGroups:
    """This process's groups of a ``dp x pp x tp`` job (``None``: a group of one)."""

    dims: ParallelDims
    device: torch.device
    timeout_s: float
    world: Any = None
    pipe: Any = None
    """The stages of this process's pipeline (same replica, same tensor-parallel shard)."""
    dp: Any = None
    """This stage shard's data-parallel replicas."""
    tp: Any = None
    tp_mesh: Any = None
    """1-D ``DeviceMesh`` named ``tp`` over :attr:`tp` (DTensor placements live on it)."""
    heartbeat: Heartbeat | None = None
    owned: list[Any] = field(default_factory=list)

    @classmethod
    def create(cls, pcfg: ParallelConfig, device_spec: str = "auto") -> ProcessGroups:
        """Choose the device, join the job, validate ``pp x dp x tp`` against it and build
        every group (collective: all processes call this in the same order)."""
        device = choose_device(device_spec)
        rank, world = init_distributed(device, pcfg.timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL object collectives use the current device
        dims = ParallelDims.build(world, rank, pcfg.pp, pcfg.dp, pcfg.tp)
        return cls.for_dims(dims, device, pcfg.timeout_s)

    @classmethod
    def for_dims(cls, dims: ParallelDims, device: torch.device,
                 timeout_s: float) -> ProcessGroups:
        """The groups of ``dims`` in a job already joined (or of one process)."""
        g = cls(dims, device, timeout_s)
        if not (dist.is_available() and dist.is_initialized()) or dims.world_size == 1:
            return g
        g.world = g.new_group(range(dims.world_size))
        for r in range(dims.dp):
            for t in range(dims.tp):
                grp = g.new_group(dims.pipeline_ranks(r, t))
                if (r, t) == (dims.replica, dims.tp_rank):
                    g.pipe = grp
        for s in range(dims.pp):
            for t in range(dims.tp):
                grp = g.new_group(dims.dp_ranks(s, t))
                if (s, t) == (dims.stage, dims.tp_rank):
                    g.dp = grp
        for r in range(dims.dp):
            for s in range(dims.pp):
                grp = g.new_group(dims.tp_ranks(s, r))
                if (r, s) == (dims.replica, dims.stage):
                    g.tp = grp
        if g.tp is not None:
            from torch.distributed.device_mesh import DeviceMesh

            g.tp_mesh = DeviceMesh.from_group(g.tp, device.type, mesh_dim_names=("tp",))
        g.heartbeat = Heartbeat.start(dims.rank, dims.world_size)
        return g

    def new_group(self, ranks: Sequence[int] | range) -> Any:
        """A group with ``parallel.timeout_s`` (collective: every process calls it); ``None``
        for a group of one process."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return None
        grp = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s))
        self.owned.append(grp)
        return grp

    def close(self) -> None:
        """Destroy the groups created here (several layouts built in one process)."""
        for grp in self.owned:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(grp)
        self.owned = []
        self.world = self.pipe = self.dp = self.tp = self.tp_mesh = None

    # ----- collectives -------------------------------------------------------------------
    def guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn a failed or timed-out collective inside the block into a
        :class:`~exitlm.comm.health.ParallelError` naming the stopped rank."""
        return guard(what, rank=self.dims.rank, timeout_s=self.timeout_s,
                     heartbeat=self.heartbeat)

    def barrier(self) -> None:
        if self.world is not None:
            with self.guard("waiting for every process"):
                dist.barrier(group=self.world)

    def wait_for_rank0(self, what: str) -> None:
        """Every process waits here until rank 0 arrives too, for as long as rank 0 works
        (tokenizing the corpus, evaluating, writing a checkpoint can outlast
        ``parallel.timeout_s``): the others poll a store key and give up only when rank 0's
        heartbeat stops. Then a barrier."""
        hb = self.heartbeat
        if self.world is None:
            return
        if hb is not None:
            key = hb.next_mark()
            if self.dims.rank == 0:
                hb.mark(key)
            else:
                while not self._marked(hb, key, what):
                    if 0 in hb.silent(max(self.timeout_s, 2 * hb.interval + 1.0)):
                        raise ParallelError(f"{what}: rank 0 stopped responding (no "
                                            f"heartbeat for more than {self.timeout_s:g} s: "
                                            "stopped, stuck or dead)")
                    time.sleep(0.2)
        self.barrier()

    @staticmethod
    def _marked(hb: Heartbeat, key: str, what: str) -> bool:
        try:
            return hb.marked(key)
        except RuntimeError as err:
            raise ParallelError(f"{what}: the rendezvous store stopped answering (it lives in "
                                "the torchrun agent, or in rank 0's process without torchrun: "
                                f"is rank 0 stopped?): {err}") from err

    def all_reduce(self, t: torch.Tensor, group: Any = "world") -> torch.Tensor:
        """Sum ``t`` (any device) over ``group`` (default: every process); returns a tensor
        on ``t``'s device."""
        grp = self.world if group == "world" else group
        if grp is None:
            return t
        x = t.to(self.device)
        dist.all_reduce(x, group=grp)
        return x.to(t.device)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src`` on every process."""
        if self.world is None:
            return obj
        box = [obj]
        with self.guard("sharing a setting from rank 0"):
            dist.broadcast_object_list(box, src=src, group=self.world)
        return box[0]

    def gather_object(self, obj: Any, ranks: list[int], group: Any) -> list[Any] | None:
        """One object from every rank of ``ranks`` (the members of ``group``, in order) on
        ``ranks[0]``; ``None`` elsewhere."""
        if group is None:
            return [obj]
        out: list[Any] | None = [None] * len(ranks) if self.dims.rank == ranks[0] else None
        dist.gather_object(obj, out, dst=ranks[0], group=group)
        return out
