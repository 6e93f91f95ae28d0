"""Naming the process that stopped: heartbeats and the errors of timed-out collectives.

Every process group exitlm creates carries ``parallel.timeout_s``, so a collective or
transfer that a stopped (``SIGSTOP``), stuck or dead peer never completes fails after that
long instead of hanging. The failure itself rarely says *which* process stopped: in a ring
all-reduce every rank waits on its neighbour. So every process publishes a counter to the
job's rendezvous store once a second from a background thread (:class:`Heartbeat`), and
watches everyone else's; when a collective fails, :func:`guard` turns the error into one
:class:`ParallelError` naming the ranks whose counters stopped moving.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import torch.distributed as dist

from exitlm.errors import ExitlmError


class ParallelError(ExitlmError, RuntimeError):
    """A peer process stopped, died or timed out, or sent something unexpected."""


_CLOSED_WORDS = ("connection reset by peer", "connection closed by peer", "broken pipe",
                 "pair closure")
"""How gloo says the process at the other end of a connection is gone."""

_COMM_WORDS = ("timed out", "timeout", "connection", "gloo", "nccl", "pair closure", "socket",
               "peer", "closed")


class Heartbeat:
    """Publishes this process's liveness counter and tracks when every rank's last moved.

    Counters, not clocks, so hosts need no synchronised time: a rank is *silent* when this
    process has not seen its counter change for a while.
    """

    _running: ClassVar[dict[tuple[str, int, int], Heartbeat]] = {}

    def __init__(self, store: Any, rank: int, world: int, interval_s: float = 1.0) -> None:
        self.store, self.rank, self.world, self.interval = store, rank, world, interval_s
        self.started = time.monotonic()
        self.last_ok = self.started
        self.changed: dict[int, float] = {}
        self._values: dict[int, bytes] = {}
        self._count = 0
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # one connection, two threads
        self._stop = threading.Event()
        self._marks = 0
        self._thread = threading.Thread(target=self._run, name="exitlm-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank: int, world: int) -> Heartbeat | None:
        """The heartbeat of this process in the current job (one per rendezvous store),
        or ``None`` when the job's store is not a TCP store (heartbeats are then off)."""
        try:
            store: Any = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            host, port = store.host, store.port
        except (AttributeError, RuntimeError, ValueError):
            return None
        key = (str(host), int(port), rank)
        hb = cls._running.get(key)
        if hb is None or hb.world != world:
            try:  # a connection of its own: the main thread may be inside a store call
                client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=3))
            except (RuntimeError, ValueError):
                return None
            hb = cls._running[key] = cls(client, rank, world)
        return hb

    def _key(self, rank: int) -> str:
        return f"exitlm/heartbeat/{rank}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._count += 1
                with self._store_lock:
                    self.store.set(self._key(self.rank), str(self._count))
                    present = [r for r in range(self.world)
                               if self.store.check([self._key(r)])]
                    values = self.store.multi_get([self._key(r) for r in present])
                now = time.monotonic()
                with self._lock:
                    for r, v in zip(present, values, strict=True):
                        if self._values.get(r) != v:
                            self._values[r] = v
                            self.changed[r] = now
                    self.last_ok = now
            except Exception:  # the store is gone or stuck: stay silent, retry
                pass
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """End the thread and close its store connection while the process is whole (a
        store client torn down by interpreter exit under a running thread aborts)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self.store = None

    @classmethod
    def stop_all(cls) -> None:
        for hb in cls._running.values():
            hb.stop()
        cls._running.clear()

    def next_mark(self) -> str:
        """A new store key for :meth:`mark` / :meth:`marked` (every process numbers its
        calls alike, so the n-th call of each names the same key)."""
        self._marks += 1
        return f"exitlm/mark/{self._marks}"

    def mark(self, key: str) -> None:
        with self._store_lock:
            self.store.set(key, "1")

    def marked(self, key: str) -> bool:
        with self._store_lock:
            return bool(self.store.check([key]))

    def silent(self, min_s: float | None = None) -> dict[int, float]:
        """Ranks whose counter has not moved for ``min_s`` seconds (default: two intervals
        and a second) -> seconds since it last did (since this heartbeat started if never)."""
        limit = 2 * self.interval + 1.0 if min_s is None else min_s
        now = time.monotonic()
        with self._lock:
            out = {}
            for r in range(self.world):
                if r == self.rank:
                    continue
                age = now - self.changed.get(r, self.started)
                if age > limit:
                    out[r] = age
            return out

    def store_silent_s(self) -> float:
        """Seconds since the rendezvous store last answered this process."""
        with self._lock:
            return time.monotonic() - self.last_ok


def describe_stalled(heartbeat: Heartbeat | None) -> str:
    """Which ranks stopped, in words ('' when none can be named)."""
    if heartbeat is None:
        return ""
    if heartbeat.store_silent_s() > 2 * heartbeat.interval + 1.0:
        return ("the rendezvous store stopped answering (it lives in the torchrun agent, or in "
                "rank 0's process without torchrun: is rank 0 stopped?)")
    silent = heartbeat.silent()
    if not silent:
        return ""
    ranks = sorted(silent)
    names = ", ".join(f"rank {r}" for r in ranks)
    age = max(silent.values())
    return f"{names} stopped responding (no heartbeat for {age:.0f} s: stopped, stuck or dead)"


def is_comm_failure(err: BaseException) -> bool:
    """Whether ``err`` looks like a failed or timed-out collective or transfer."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(w in text for w in _COMM_WORDS)


@contextlib.contextmanager
def guard(what: str, *, rank: int, timeout_s: float,
          heartbeat: Heartbeat | None) -> Iterator[None]:
    """Run a block of collectives; a failed or timed-out one becomes a
    :class:`ParallelError` that names the stopped rank(s) when heartbeats can tell."""
    try:
        yield
    except ParallelError as err:
        who = describe_stalled(heartbeat)
        if who and who not in str(err):
            raise type(err)(f"{err}; {who}", hint=err.hint) from err
        raise
    except RuntimeError as err:
        who = describe_stalled(heartbeat)
        if not who and not is_comm_failure(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not who and any(w in str(err).lower() for w in _CLOSED_WORDS):
            who = "a peer closed its connection (it exited or was killed)"
        lead = f"{who}; " if who else ""
        raise ParallelError(
            f"{what}: {lead}a collective on rank {rank} (this process) failed or did not "
            f"complete within parallel.timeout_s={timeout_s:g} s ({first[:300]})",
            hint="see the other ranks' logs; raise parallel.timeout_s if one is only slow",
        ) from err


atexit.register(Heartbeat.stop_all)
