"""Helpers for tests that spawn gloo processes (importable from every test directory: pytest
puts ``tests/`` on ``sys.path`` for its conftest)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now (for ``init_method=tcp://127.0.0.1:PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                  timeout: float = 240.0, what: str = "workers") -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; raise if one fails or they
    are not done within ``timeout`` seconds (stragglers are killed either way)."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
