"""One-way shared-memory byte channels between two processes of one machine (``channel.c``).

A :class:`ShmChannel` is one end (sending or receiving) of a ring buffer that lives in a
mapped file: :meth:`~ShmChannel.send` copies a tensor's bytes in, :meth:`~ShmChannel.recv`
fills a new tensor of a shape and dtype both ends know. Pipeline-based early-exit inference
sends its per-token messages this way between the stages of one machine
(:class:`exitlm.infer.executors.pipeline_stage.Links`); setting the file up across processes is
:func:`exitlm.comm.shm.shm_channels`'s job, this module only maps and calls.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from exitlm.kernels import abi, native

HEADER_BYTES = 4 * 128
"""Bytes before each channel's ring (``channel.c``: four 128-byte lines)."""
DEFAULT_CAPACITY = 1 << 20
"""Bytes of each ring: a larger message goes through in pieces while the receiver reads."""
_SENDER_PID, _RECEIVER_PID = 1, 16 + 1  # int64 words of the header (channel.c)

TIMEOUT, PEER, ARGS, DEAD = -20, -21, -22, -23
"""Error codes of ``channel.c``."""


def channel_bytes(capacity: int = DEFAULT_CAPACITY) -> int:
    """Bytes one channel takes in the shared file (header + ring)."""
    return HEADER_BYTES + capacity


class ChannelError(RuntimeError):
    """A channel wait ended without its bytes; :attr:`code` says why (``TIMEOUT``, ``PEER``:
    the other end aborted, ``DEAD``: the other end's process is gone)."""

    def __init__(self, code: int) -> None:
        super().__init__({TIMEOUT: "timed out", PEER: "the other end gave up",
                          DEAD: "the other end's process exited",
                          ARGS: "bad arguments"}.get(code, f"failed ({code})"))
        self.code = code


class ShmChannel:
    """One end of channel ``index`` in the shared file ``path`` (laid out as consecutive
    :func:`channel_bytes` blocks, zero-filled by its creator). ``sender`` says which end."""

    def __init__(self, path: str | Path, index: int, *, sender: bool,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        lib = native.library()
        if lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
        if lib.exitlm_chan_header_bytes() != HEADER_BYTES:
            raise RuntimeError("channel.c and native_channel.py disagree on the header size")
        self.lib, self.sender, self.capacity = lib, sender, capacity
        self.path = Path(path)
        size = channel_bytes(capacity)
        whole = torch.from_file(str(path), shared=True, size=os.path.getsize(path),
                                dtype=torch.uint8)
        self._map = whole[index * size:(index + 1) * size]
        if self._map.numel() != size:
            raise ValueError(f"{path}: no channel {index} of {capacity} bytes in it")
        header = self._map[:HEADER_BYTES].view(torch.int64)
        self._header = header
        self._end = abi.Chan(self._map.data_ptr(), self._map.data_ptr() + HEADER_BYTES, capacity,
                         int(sender), 0)
        header[_SENDER_PID if sender else _RECEIVER_PID] = os.getpid()
        self._ptr = ctypes.addressof(self._end)

    def peer_pid(self) -> int:
        """The other end's process id (0 until it has mapped the channel)."""
        return int(self._header[_RECEIVER_PID if self.sender else _SENDER_PID])

    def watch_peer(self) -> None:
        """Let waits notice that the other end's process is gone (call once both ends have
        mapped the channel, in one process namespace)."""
        self._end.watch = 1

    def send(self, tensor: torch.Tensor, timeout_s: float | None) -> None:
        """Copy ``tensor``'s bytes into the channel (``timeout_s`` ``None``: no deadline)."""
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        nbytes = t.numel() * t.element_size()
        self._check(self.lib.exitlm_chan_send(self._ptr, t.data_ptr(), nbytes,
                                              -1.0 if timeout_s is None else timeout_s))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype,
             timeout_s: float | None) -> torch.Tensor:
        """The next message: a new tensor of ``shape`` and ``dtype`` filled from the channel
        (``timeout_s`` ``None``: wait without a deadline)."""
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        self._check(self.lib.exitlm_chan_recv(self._ptr, out.data_ptr(), nbytes,
                                              -1.0 if timeout_s is None else timeout_s))
        return out

    def drain(self, timeout_s: float | None) -> None:
        """Wait until the receiver has taken everything sent (a sending end)."""
        self._check(self.lib.exitlm_chan_drain(self._ptr, -1.0 if timeout_s is None
                                               else timeout_s))

    def abort(self) -> None:
        """Mark this end failed: the other end's waits end at once."""
        self.lib.exitlm_chan_abort(self._ptr)

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise ChannelError(rc)
