"""uvicorn's server as ``exitlm serve`` runs it: it announces when it listens and when a
drain starts, and a drained server exits with status 0."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from exitlm.serve.state import ServerState

log = logging.getLogger("exitlm.serve")


class Server(uvicorn.Server):
    """uvicorn's server; ``ready()`` is called once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[], None],
                 state: ServerState) -> None:
        super().__init__(config)
        self._ready = ready
        self._state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self._ready()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            log.info("shutting down: no new connections; waiting up to %.0fs for %d running "
                     "and %d queued requests", self._state.drain_timeout,
                     self._state.runner.running, self._state.runner.waiting)
        super().handle_exit(sig, frame)


@contextmanager
def signals_end_quietly() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it once it has drained; inside this block
    that signal does nothing, so that a drained server exits with status 0."""
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
