"""The engine's own thread, and how the asyncio side talks to it.

One thread does all the model work (:meth:`Engine.step`, and prompt scoring between steps);
the event loop never runs a forward pass. HTTP handlers submit a :class:`RequestGroup` (the
engine requests of one HTTP request, one per choice) and read its updates from an
``asyncio.Queue``, which the engine thread fills through ``loop.call_soon_threadsafe``.

Failures: a step that raises ends the requests it was running
(:meth:`~exitlm.infer.engine.Engine.abort_running`) - their groups receive an
:class:`EngineFailure` - and the thread goes on with the queued requests. A client that goes
away cancels its group; the engine frees the rows at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from exitlm.infer.engine import Engine, EngineFull
from exitlm.infer.options import SamplingOptions
from exitlm.infer.request import Request, Update

log = logging.getLogger("exitlm.serve")
T = TypeVar("T")


class EngineFailure(Exception):
    """The engine step decoding this request raised (the request is over)."""


@dataclass
class _Job:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]


class RequestGroup:
    """The engine requests of one HTTP request and the queue of their updates."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.requests: list[Request] = []
        self.queue: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()
        self._open: set[int] = set()

    def _sink(self, index: int) -> Callable[[Update], None]:
        """The engine's ``on_update`` for choice ``index`` (runs on the engine thread)."""
        def on_update(update: Update) -> None:
            self.runner.post(self.queue.put_nowait, (index, update))
        return on_update

    async def updates(self) -> AsyncIterator[tuple[int, Update]]:
        """``(choice index, update)`` as the engine produces them, until every choice is
        finished; raises :class:`EngineFailure` when the engine failed one of them."""
        while self._open:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._open.discard(index)
            yield index, item

    def cancel(self) -> None:
        """Stop every choice that is not finished (thread-safe, idempotent)."""
        for r in self.requests:
            if not r.done:
                self.runner.cancel(r)


class EngineRunner:
    """Runs ``engine`` on a background thread (see the module docstring).

    Args:
        engine: the engine; only this runner's thread steps it.
        on_update: called on the engine thread with every update (metrics).
    """

    def __init__(self, engine: Engine, on_update: Callable[[Update], None] | None = None
                 ) -> None:
        self.engine = engine
        self.on_update = on_update
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failures = 0
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._live: dict[int, tuple[RequestGroup, int]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ----- lifecycle (event loop side) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="exitlm-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left, let the thread reap it and end, close the engine."""
        with self._cond:
            self._stopping = True
            live = [g.requests[i] for g, i in self._live.values()]
            self._cond.notify()
        for r in live:
            self.engine.cancel(r)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self.engine.close()

    # ----- requests (event loop side) -----------------------------------------------------------
    def submit(self, prompts: Sequence[list[int]], sampling: Sequence[SamplingOptions],
               options: dict[str, Any]) -> RequestGroup:
        """Queue one engine request per ``(prompt, sampling)`` pair as one group. The engine's
        :class:`~exitlm.config.ConfigError` / :class:`~exitlm.infer.engine.EngineFull`
        propagate, after the group's earlier requests are cancelled. A group the queue has
        no room for as a whole raises :class:`EngineFull` before any of it is queued (so a
        refused request leaves nothing behind for the next one)."""
        queue, waiting = self.engine.max_queue, self.engine.num_waiting
        if queue is not None and waiting + len(prompts) > queue:
            raise EngineFull(f"the queue is full ({waiting} of {queue} places taken, this "
                             f"request needs {len(prompts)})")
        group = RequestGroup(self)
        try:
            for index, (ids, samp) in enumerate(zip(prompts, sampling, strict=True)):
                # registered under the lock: the engine thread forgets a finished request
                # under it too, so a request never finishes before it is known
                with self._cond:
                    req = self.engine.submit(ids, samp, on_update=group._sink(index),
                                             **options)
                    group.requests.append(req)
                    group._open.add(index)
                    self._live[req.id] = (group, index)
                    self._cond.notify()
        except BaseException:
            group.cancel()
            raise
        return group

    def cancel(self, request: Request) -> None:
        self.engine.cancel(request)
        with self._cond:
            self._cond.notify()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        assert self.loop is not None
        future: asyncio.Future[T] = self.loop.create_future()
        with self._cond:
            self._jobs.append(_Job(fn, future))
            self._cond.notify()
        return await future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the event loop (from the engine thread)."""
        if self.loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(fn, *args)

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> int:
        return self.engine.num_waiting

    # ----- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._jobs or self._stopping or engine.has_work()):
                    self._cond.wait()
                jobs, self._jobs = self._jobs, []
                if self._stopping and not jobs and not engine.has_work():
                    return
            for job in jobs:
                self._run_job(job)
            if engine.has_work():
                self._step()

    def _run_job(self, job: _Job) -> None:
        try:
            with self.engine.threads.split("torch"):
                result = job.fn()
        except BaseException as err:  # handed to the caller
            self.post(_settle, job.future, None, err)
        else:
            self.post(_settle, job.future, result, None)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as err:
            self.failures += 1
            log.exception("engine step failed; ending the requests it was decoding")
            self._fail(EngineFailure(f"the engine failed while decoding this request "
                                     f"({type(err).__name__}: {err})"))
            return
        for u in updates:
            if self.on_update is not None:
                try:
                    self.on_update(u)
                except Exception:  # metrics must never stop the engine thread
                    log.exception("update callback failed")
            if u.finished:
                with self._cond:
                    self._live.pop(u.request.id, None)

    def _fail(self, error: EngineFailure) -> None:
        """Tell the owners of the requests a failed step ended (and of any finished request
        whose last update the failed step never delivered)."""
        failed = {r.id for r in self.engine.abort_running()}
        with self._cond:
            ended = [rid for rid, (g, i) in self._live.items()
                     if rid in failed or g.requests[i].done]
            owners = [self._live.pop(rid) for rid in ended]
        for group, index in owners:
            self.post(group.queue.put_nowait, (index, error))


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
