"""Point-to-point transfers between pipeline stages with timeouts.

Every ``isend``/``irecv`` returns a work object that is waited on (gloo returns one per
operation). Receives are waited on at once, with ``timeout_s``; sends are waited on at the end
of the step. A peer that died or stalls therefore ends the step with :class:`PipelineError`
naming the peer and the message, instead of hanging forever. Tags identify the message
(microbatch, slice, direction), so gloo can match out of order; the schedule checker also
keeps the order equal at both ends, which NCCL needs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exitlm.comm.health import ParallelError

IDLE_WAIT = timedelta(days=365)
"""The deadline of an idle wait (:meth:`P2P.recv`): none in practice."""


class PipelineError(ParallelError):
    """A pipeline peer failed, timed out, or sent something unexpected."""


def message_tag(mb: int, slice_index: int, num_slices: int, grad: bool) -> int:
    """A tag unique within a step for (microbatch, slice, direction)."""
    return ((mb * num_slices + slice_index) << 1) | int(grad)


def transfer_timed_out(what: str, timeout_s: float, setting: str) -> PipelineError:
    """The error of a transfer of ``what`` that missed its ``timeout_s`` deadline (gloo here,
    shared-memory channels in :mod:`exitlm.comm.shm_p2p`)."""
    return PipelineError(
        f"pipeline transfer of {what} did not complete within {timeout_s:g} s ({setting}): "
        "is that rank stopped or stuck?",
        hint=f"see that rank's log; raise {setting} if it is only slow")


def transfer_failed(what: str, err: Exception) -> PipelineError:
    """The error of a transfer of ``what`` whose peer went away (``err`` says how)."""
    return PipelineError(f"pipeline transfer of {what} failed; did that rank die? "
                         f"(see its log): {err}")


class P2P:
    """Sends and receives of one stage, to global ranks."""

    def __init__(self, timeout_s: float, device: torch.device,
                 setting: str = "parallel.timeout_s") -> None:
        """``setting`` names the option that sets ``timeout_s`` in error messages."""
        self.timeout = timedelta(seconds=timeout_s)
        self.setting = setting
        self.device = device
        self.pending: list[tuple[Any, torch.Tensor, str]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        t = tensor.detach().contiguous()
        try:
            work = dist.isend(t, dst=dst, tag=tag)
        except RuntimeError as err:
            raise PipelineError(f"sending {what} to rank {dst} failed: {err}") from err
        self.pending.append((work, t, f"{what} to rank {dst}"))
        self._reap()

    def _reap(self) -> None:
        """Forget sends that completed, so their buffers are freed before the step ends."""
        keep = []
        for work, t, what in self.pending:
            if work.is_completed():
                self._wait(work, what)  # returns at once; raises if the send failed
            else:
                keep.append((work, t, what))
        self.pending = keep

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
             what: str, *, idle: bool = False) -> torch.Tensor:
        """Receive ``what`` from ``src`` within the timeout; with ``idle`` (a server waiting
        for its next command) without a deadline: only the peer closing its connection (it
        died or was killed) ends the wait, since gloo drops every connection of a process
        once one of its transfers timed out and an idle process must stay usable."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, src=src, tag=tag)
        except RuntimeError as err:
            raise PipelineError(f"receiving {what} from rank {src} failed (did that rank "
                                f"die?): {err}") from err
        self._wait(work, f"{what} from rank {src}", IDLE_WAIT if idle else None)
        return buf

    def flush(self, *, idle: bool = False) -> None:
        """Wait for every send of this step (``idle``: without a deadline, see :meth:`recv`)."""
        pending, self.pending = self.pending, []
        for work, _t, what in pending:
            self._wait(work, what, IDLE_WAIT if idle else None)

    def _wait(self, work: Any, what: str, timeout: timedelta | None = None) -> None:
        try:
            ok = work.wait(timeout or self.timeout)
        except RuntimeError as err:
            if "timed out" in str(err).lower():
                raise self._timed_out(what) from err  # gloo's text stays in the chain
            raise transfer_failed(what, err) from err
        if ok is False:
            raise self._timed_out(what)

    def _timed_out(self, what: str) -> PipelineError:
        return transfer_timed_out(what, self.timeout.total_seconds(), self.setting)
