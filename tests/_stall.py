"""Stopping (``SIGSTOP``) a stage of a pipeline-based early-exit job from inside stage 0's
decoder, for the stalled-stage tests."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import pytest


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists any more (a stopped or zombie one still does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stall_at(monkeypatch: pytest.MonkeyPatch, call: int, rank: int) -> list[int]:
    """Make stage 0's ``call``-th decoder call (1: the prefill, n: step n - 1) first stop
    (``SIGSTOP``) the process of stage ``rank`` of its pipeline: it stays alive, holds
    its sockets and says nothing. Returns the list the stage processes' ids are put in."""
    from exitlm.infer.executors import pipeline as pipeline_ee

    pids: list[int] = []
    calls = [0]

    def stalling(method: Any) -> Any:
        def wrapped(self: pipeline_ee.PipelineDecoder, batch: object) -> object:
            calls[0] += 1
            if calls[0] == call:
                group = self.group
                assert group.workers is not None
                pids.extend(p.pid for p in group.workers.ctx.processes)
                os.kill(pids[rank - 1], signal.SIGSTOP)
            return method(self, batch)
        return wrapped

    for name in ("prefill", "step"):
        monkeypatch.setattr(pipeline_ee.PipelineDecoder, name,
                            stalling(getattr(pipeline_ee.PipelineDecoder, name)))
    return pids


def kill_all(pids: list[int]) -> list[int]:
    """SIGKILL every process of ``pids`` still there; returns those that were."""
    left = [pid for pid in pids if not _gone(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
