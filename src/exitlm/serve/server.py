"""uvicorn's server as ``exitlm serve`` runs it: it announces when it listens and when a
drain starts, a drained server exits with status 0, and its connections are guarded
(:class:`GuardedH11`): a client has a deadline to send a whole request, and connections
beyond a cap are closed as soon as they are accepted, so that idle or half-sent connections
can neither pile up until the process runs out of file descriptors nor hold the server
forever."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import resource
except ImportError:  # pragma: no cover - Windows: no open-file limit to raise
    resource = None  # type: ignore[assignment]

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


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with two guards (the class attributes, set by
    :func:`guarded_protocol`):

    * ``request_timeout``: seconds a client has to send a whole request - its head and its
      body - from the moment it connects, or sends the first bytes of its next request on a
      kept-alive connection; then the connection is closed (a request whose body was being
      read ends as a client disconnect). Between requests uvicorn's keep-alive timeout
      applies. Generation itself has no deadline: it starts once the request is in.
    * ``max_connections``: a connection accepted while this many are open is closed at once
      (warned about at most every 10 s), so descriptors stay free for the ones served.
    """

    request_timeout: float = 60.0
    max_connections: int = 1024
    _last_warning = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            now = time.monotonic()
            if now - GuardedH11._last_warning > 10:
                GuardedH11._last_warning = now
                log.warning("%d connections open (--max-connections): closing new ones until "
                            "some end", len(self.connections) - 1)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._disarm()  # the whole request is in
        elif self._deadline is None and not self.transport.is_closing():
            self._arm()

    def on_response_complete(self) -> None:
        self._disarm()  # idle until the next request: uvicorn's keep-alive timeout
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            return  # the request arrived meanwhile
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(request_timeout: float, max_connections: int) -> type[GuardedH11]:
    """:class:`GuardedH11` with these guards, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11", (GuardedH11,), {"request_timeout": request_timeout,
                                              "max_connections": max_connections})


def raise_open_files_limit(want: int) -> int:
    """Raise this process's soft limit of open files towards ``want`` (within the hard
    limit); returns the soft limit now in force (``want`` where there is none)."""
    if resource is None:
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return want
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


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
