"""The pipeline stages' point-to-point messages through shared-memory channels.

:class:`ChannelP2P` has the interface of :class:`~exitlm.comm.p2p.P2P` (``send``,
``recv``, ``flush``, ``timeout``) that :class:`~exitlm.infer.executors.pipeline_stage.Links`
uses, over the one-way channels of :func:`~exitlm.comm.shm.shm_channels`
(``channel.c``) instead of gloo: a message is copied into a ring that the receiving stage
maps, so a token's four to six messages cost microseconds instead of the 0.1-0.5 ms each that
gloo over 127.0.0.1 took here. Messages between two stages arrive in the order they were sent
(the pipeline's protocol never reorders them), so tags are not needed; sizes are known at both
ends.

Failures read as they do over gloo: a receive that misses its deadline names the message and
the rank and says which setting raises the limit; a peer whose process exited (its pid is
watched) or that gave up ends the wait at once. A send blocks only while the receiver's ring
(1 MiB) is full; :meth:`ChannelP2P.flush` (each step's start) waits until the receivers took
the previous step's messages, so a stage runs at most one step ahead of the next, as with
gloo. Stage 0's waits keep the deadline, later stages' sends wait without one (a stage held up
by a stalled one after it must not fail first: stage 0 names the stalled stage).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from exitlm.comm.native_channel import DEAD, PEER, TIMEOUT, ChannelError, ShmChannel
from exitlm.comm.p2p import PipelineError, transfer_failed, transfer_timed_out


class ChannelP2P:
    """Rank ``rank``'s sends and receives over its channel ends ``ends`` (keyed ``(src,
    dst)``)."""

    def __init__(self, rank: int, ends: dict[tuple[int, int], ShmChannel], timeout_s: float,
                 setting: str = "--dist-timeout") -> None:
        self.rank = rank
        self.ends = ends
        self.timeout = timedelta(seconds=timeout_s)
        self.setting = setting
        self.last_sent: dict[int, str] = {}
        """Per destination rank, what the newest send carried (named if it is not taken)."""

    def _end(self, src: int, dst: int) -> ShmChannel:
        try:
            return self.ends[(src, dst)]
        except KeyError:
            raise PipelineError(f"pipeline protocol: no channel from rank {src} to rank "
                                f"{dst}") from None

    def _limit(self, idle: bool) -> float | None:
        return None if idle else self.timeout.total_seconds()

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        """Copy ``tensor`` to rank ``dst`` (``tag`` is unused: messages keep their order)."""
        del tag
        self.last_sent[dst] = what
        try:
            self._end(self.rank, dst).send(tensor, self._limit(self.rank > 0))
        except ChannelError as err:
            raise self._error(err, f"{what} to rank {dst}") from err

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
             what: str, *, idle: bool = False) -> torch.Tensor:
        """The next message from rank ``src``: ``shape`` and ``dtype`` as the sender's; with
        ``idle`` (a stage waiting for its next command) no deadline."""
        del tag
        try:
            return self._end(src, self.rank).recv(shape, dtype, self._limit(idle))
        except ChannelError as err:
            raise self._error(err, f"{what} from rank {src}") from err

    def flush(self, *, idle: bool = False) -> None:
        """Wait until every receiver has taken what this rank sent it (``idle``: without a
        deadline). Called at the start of a step, this keeps a stage at most one step ahead
        of the next one, as gloo's completed sends did."""
        for (src, dst), end in self.ends.items():
            if src == self.rank and dst in self.last_sent:
                try:
                    end.drain(self._limit(idle))
                except ChannelError as err:
                    raise self._error(err, f"{self.last_sent[dst]} to rank {dst}") from err

    def _error(self, err: ChannelError, what: str) -> PipelineError:
        if err.code == TIMEOUT:
            return transfer_timed_out(what, self.timeout.total_seconds(), self.setting)
        if err.code in (PEER, DEAD):
            return transfer_failed(what, err)
        return PipelineError(f"pipeline transfer of {what} failed: {err}")
