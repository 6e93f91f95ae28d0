"""Starting, joining and stopping the processes of a decoding job.

Two ways in:

* **self-started** (:func:`start_workers`): the calling process becomes rank 0 and spawns
  ranks ``1..world-1`` with ``torch.multiprocessing`` (``spawn``); all join one gloo group
  on 127.0.0.1 at a free port. :class:`Workers` kills the children when the job ends or
  fails, so nothing outlives it.
* **torchrun** (:func:`join_torchrun`): ``WORLD_SIZE``/``RANK`` come from the environment and
  the default group is created with gloo (NCCL is not used for decoding: every transfer here
  is a few kilobytes, latency-bound, and the decoders' tensors live on the CPU).

Every group is created with ``timeout_s``; transfers wait with it too, so a peer that died or
stalls ends the job with a :class:`~exitlm.comm.health.ParallelError` instead of a hang.
Self-started ranks meet first with a longer deadline (:data:`RENDEZVOUS_S`): starting a
process that imports torch is not a transfer. Rendezvous are bounded and quiet
(:mod:`.rendezvous`); spawned ranks end by themselves when rank 0's process dies
(:mod:`.lifeline`) and leave no files: they are started with :mod:`multiprocessing` directly,
not ``torch.multiprocessing.start_processes``, whose error files (``pytorch-errorfile-*``)
only a parent that outlives its children removes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the reductions that share tensors with a child

from exitlm.comm.health import ParallelError
from exitlm.comm.lifeline import leave_orphaned, watch_parent
from exitlm.comm.rendezvous import (
    bounded,
    deadline_s,
    quiet_c10d,
    rendezvous_failed,
    store_unanswered,
)
from exitlm.config import ConfigError
from exitlm.env import debug

DEFAULT_TIMEOUT_S = 300.0
"""How long a transfer may wait for a peer (seconds)."""
RENDEZVOUS_S = 120.0
"""How long the ranks of a self-started job wait for each other to start, at least."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join (create) the default gloo group of ``world`` processes on 127.0.0.1:``port``.

    The ranks first meet at a TCP store that waits :data:`RENDEZVOUS_S` (or ``timeout_s``
    when longer) for all of them: a spawned rank imports torch before it can join, seconds on a
    loaded machine, which is not a stalled transfer. The group itself - every transfer - waits
    ``timeout_s``. (Rank 0 notices a child that dies before joining at once, see
    :func:`start_workers`.)"""
    meet = timedelta(seconds=max(timeout_s, RENDEZVOUS_S))
    where = f"127.0.0.1:{port}"
    try:
        with quiet_c10d():
            store = dist.TCPStore("127.0.0.1", port, world, rank == 0, meet,
                                  wait_for_workers=True)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
    except dist.DistError as err:
        raise rendezvous_failed(err, rank, world, where, meet.total_seconds()) from err


def torchrun_world() -> int:
    """``WORLD_SIZE`` of a job ``torchrun`` started (1 outside one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join_torchrun(timeout_s: float) -> tuple[int, int]:
    """Join the job ``torchrun`` started (gloo, ``timeout_s``); returns (rank, world)."""
    if not dist.is_initialized():
        init_torchrun_group("gloo", timeout_s)
    return dist.get_rank(), dist.get_world_size()


def init_torchrun_group(backend: str, timeout_s: float,
                        setting: str = "--dist-timeout") -> None:
    """``init_process_group`` from torchrun's environment; a rank that cannot meet the others
    (one stopped or failed during start-up) is one :class:`ParallelError` naming this rank and
    the store, instead of torch's ``DistStoreError``, and so is one whose store connection
    never answers (another program on ``MASTER_PORT``: torch would wait forever) after
    :func:`~exitlm.comm.rendezvous.deadline_s` (``setting`` names ``timeout_s``)."""
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    rank, world = int(env.get("RANK", "-1")), int(env.get("WORLD_SIZE", "0"))
    limit = deadline_s(timeout_s)

    def init() -> None:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))

    try:
        with quiet_c10d():
            bounded(init, limit, lambda: store_unanswered(rank, world, where, limit, setting))
    except dist.DistError as err:
        raise rendezvous_failed(err, rank, world, where, timeout_s) from err


def _child(index: int, fn: Callable[..., None], world: int, port: int, timeout_s: float,
           threads: int, args: tuple[Any, ...]) -> None:
    """Entry of a spawned worker: rank ``index + 1`` joins the group and runs ``fn``.

    Workers ignore SIGINT and SIGTERM: a terminal's Ctrl-C (and systemd's stop) reaches every
    process of the job, and a server's rank 0 must be able to drain its requests through
    them. Rank 0 ends them (a stop command, or ``Workers.kill``); if rank 0's process dies,
    they end at once, during start-up too (:func:`~exitlm.comm.lifeline.watch_parent`). A
    failure ends the worker with status 1 (its traceback printed under ``EXITLM_DEBUG``):
    rank 0 reports it."""
    watch_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    rank = index + 1
    try:
        join_group(rank, world, port, timeout_s)
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        leave_orphaned()  # rank 0 is gone: nobody to tell, nothing to print
        if debug():
            traceback.print_exc()
        raise SystemExit(1) from None


class Spawned:
    """The processes of one :func:`start_workers` call (``processes[i]`` is rank ``i + 1``)."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes


class Workers:
    """The spawned ranks ``1..world-1`` of a self-started job (see :func:`start_workers`)."""

    def __init__(self, ctx: Spawned, world: int) -> None:
        self.ctx = ctx
        self.world = world

    def failed(self) -> str | None:
        """A description of a child that exited with an error, if one did."""
        for i, p in enumerate(self.ctx.processes):
            if not p.is_alive() and p.exitcode not in (0, None):
                return f"decoding worker rank {i + 1} exited with status {p.exitcode}"
        return None

    def stopped(self) -> list[int]:
        """The ranks of the children the OS reports stopped (``SIGSTOP``, a debugger; read
        from ``/proc`` where there is one): alive, silent, and the likely cause of a timeout."""
        return [i + 1 for i, p in enumerate(self.ctx.processes)
                if p.is_alive() and _stopped(p.pid)]

    def describe_running(self) -> str:
        """The children still running, in words, the stopped ones said so."""
        stopped = self.stopped()
        parts = [f"rank {i + 1}" + (" (stopped)" if i + 1 in stopped else "")
                 for i, p in enumerate(self.ctx.processes) if p.is_alive()]
        return (", ".join(parts) or "none") + " still running"

    def join(self, timeout_s: float) -> None:
        """Wait for the children to finish; kill them after ``timeout_s`` or on a failure."""
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in self.ctx.processes):
                if time.monotonic() > deadline:
                    raise ParallelError(f"decoding workers did not stop within {timeout_s:g} s: "
                                        f"{self.describe_running()}")
                time.sleep(0.02)
            msg = self.failed()
            if msg:
                raise ParallelError(msg)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every child still running (idempotent)."""
        for p in self.ctx.processes:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in self.ctx.processes:
            if p.pid is not None:
                p.join(5)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T``/``t`` in ``/proc/<pid>/stat``; ``False``
    where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def start_workers(fn: Callable[..., None], args: tuple[Any, ...], world: int, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> Workers:
    """Become rank 0 of a ``world``-process gloo job and spawn ranks ``1..world-1``, each
    running ``fn(rank, world, *args)`` with ``threads`` torch threads. Returns once every
    rank has joined (the children are killed if that fails)."""
    if dist.is_available() and dist.is_initialized():
        raise ConfigError("a torch.distributed job is already running in this process; "
                          "self-started decoding processes need a process without one "
                          "(under torchrun, launch with --nproc-per-node instead)")
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    ctx = Spawned([spawn.Process(target=_child, name=f"exitlm-rank-{i + 1}",
                                 args=(i, fn, world, port, timeout_s, threads, args))
                   for i in range(world - 1)])
    workers = Workers(ctx, world)
    try:
        for p in ctx.processes:
            p.start()
    except BaseException:
        workers.kill()
        raise
    errors: list[BaseException] = []

    def join() -> None:
        try:
            join_group(0, world, port, timeout_s)
        except BaseException as err:  # handed to the caller below
            errors.append(err)

    joiner = threading.Thread(target=join, daemon=True, name="exitlm-rendezvous")
    joiner.start()
    try:  # a child that dies before joining must not leave rank 0 waiting for timeout_s
        while joiner.is_alive():
            msg = workers.failed()
            if msg:
                raise ParallelError(f"{msg} before joining the job (rerun with --debug to "
                                    "see its error)")
            joiner.join(0.05)
        if errors:
            raise ParallelError(f"decoding processes could not join: {errors[0]}")
    except BaseException:
        workers.kill()
        raise
    return workers


def leave_group() -> None:
    """Destroy the default group if this process has one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
