"""Serving over tensor-parallel processes: ``exitlm serve MODEL --tp T`` (:func:`tp_engine`).

Tensor-parallel decoding (:mod:`~exitlm.infer.executors.tp_shard`) needs every rank to run
the same steps on the same rows: the collectives inside each layer pair them up. For one
``generate`` call that holds by construction; a server's engine, though, admits requests as
they arrive and drops them when clients go away, at whatever step that happens. So the ranks
replicate rank 0's engine:

* rank 0 runs the server with a :class:`TPEngine` on its shard. Submissions and
  cancellations are staged (validated at once, so a bad request still fails on its caller)
  and take effect only at the start of the next step, when rank 0 sends them - in order -
  with the step command;
* ranks ``1..T-1`` run :func:`follow`: an ordinary :class:`~exitlm.infer.engine.Engine` on
  their shard that applies the same submissions and cancellations and steps when told. The
  engine is deterministic given its inputs and the collectives give every rank the same
  bits, so every rank admits, decodes, stops (end tokens, stop strings, lengths) and frees
  rows exactly as rank 0 does. Sampling without a seed gets one drawn by rank 0.

Messages are an int64 header (kind, payload bytes) and a JSON payload (never pickle) over
gloo; a follower waits for the next one without a deadline, as a server may idle for hours,
and every other wait is bounded by ``--dist-timeout``. Echo log-probabilities (a forward of
the prompt between steps) are mirrored the same way. A rank that fails marks the shared
collectives aborted, so rank 0's step fails at once with a message rather than at a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exitlm.comm.health import ParallelError
from exitlm.comm.launch import (
    DEFAULT_TIMEOUT_S,
    Workers,
    leave_group,
    start_workers,
)
from exitlm.comm.p2p import IDLE_WAIT
from exitlm.config import ConfigError, ModelConfig
from exitlm.infer.engine import Engine, EngineBroken, Request, Update
from exitlm.infer.executors.tp_shard import (
    VocabParallel,
    check_quantized,
    check_strategy,
    check_tp,
    draw_seed,
    rank_shard,
    shard_model,
)
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import TokenLogprob
from exitlm.io.materialize import model_tensors
from exitlm.model.transformer import EarlyExitLM

log = logging.getLogger("exitlm.tp")

STEP, SCORE, STOP = 1, 2, 3


class Mirror:
    """Rank 0's side of the command channel to ranks ``1..world-1``."""

    def __init__(self, world: int) -> None:
        self.world = world

    def send(self, kind: int, events: list[dict[str, Any]]) -> None:
        payload = json.dumps(events).encode() if events else b""
        head = torch.tensor([kind, len(payload)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
        for rank in range(1, self.world):
            dist.send(head, rank)
            if body is not None:
                dist.send(body, rank)


def receive(timeout_s: float) -> tuple[int, list[dict[str, Any]]]:
    """A follower's next command from rank 0: waits for the header without a deadline (an
    idle server sends nothing), for the payload at most ``timeout_s``."""
    head = torch.zeros(2, dtype=torch.int64)
    dist.irecv(head, 0).wait(IDLE_WAIT)
    kind, size = int(head[0]), int(head[1])
    if size == 0:
        return kind, []
    body = torch.empty(size, dtype=torch.uint8)
    if not dist.irecv(body, 0).wait(timedelta(seconds=timeout_s)):
        raise ParallelError(f"rank 0 sent a command header but not its {size} bytes within "
                            f"{timeout_s:g} s")
    return kind, json.loads(bytes(body.tolist()))


def _to_json(d: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON values (tuples and sets as lists; :func:`_from_json` turns back)."""
    return {k: list(v) if isinstance(v, tuple | frozenset) else v for k, v in d.items()}


def _from_json(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


class TPEngine(Engine):
    """Rank 0's engine of a tensor-parallel server (see the module docstring): an
    :class:`~exitlm.infer.engine.Engine` on rank 0's shard whose submissions, cancellations
    and echo scoring reach the followers in step order. Build it with :func:`tp_engine`."""

    def __init__(self, model: EarlyExitLM, tokenizer: Any, strategy: str, options: Any, *,
                 mirror: Mirror, workers: Workers, timeout_s: float, **engine_kw: Any) -> None:
        super().__init__(model, tokenizer, strategy, options, **engine_kw)
        self.mirror = mirror
        self.workers = workers
        self.timeout_s = timeout_s
        self._staged: list[Request] = []  # submitted since the last step
        self._events: list[dict[str, Any]] = []  # their submits and the cancels, in order
        self._broken: str | None = None
        self._closed = False

    def submit(self, prompt: Any, sampling: SamplingOptions | None = None, *args: Any,
               **kwargs: Any) -> Request:
        """:meth:`Engine.submit`, staged until the next step (:meth:`_enqueue`); unseeded
        sampling gets a seed here, the same on every rank."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        sampling = sampling or SamplingOptions()
        if not sampling.greedy and sampling.seed is None:
            sampling = sampling.replace(seed=draw_seed())
        return super().submit(prompt, sampling, *args, **kwargs)

    def _enqueue(self, req: Request) -> None:
        """Stage ``req`` and its submit event for the next step (not the waiting queue: a
        step running now must not admit it before the followers know of it)."""
        own = {name: getattr(req.options, name) for name in self.strategy.per_request}
        with self._lock:
            self._check_room()
            self._staged.append(req)
            self._events.append({"op": "submit", "id": req.id, "ids": req.prompt_ids,
                                 "sampling": _to_json(dataclasses.asdict(req.sampling)),
                                 "options": _to_json(own)})

    def cancel(self, request: Request) -> None:
        with self._lock:
            self._events.append({"op": "cancel", "id": request.id})

    def has_work(self) -> bool:
        if self._broken is not None:
            return False
        with self._lock:
            return bool(self._waiting or self.running or self._events)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._staged)  # staged ones wait for the next step

    @property
    def broken(self) -> str | None:
        return self._broken

    def step(self) -> list[Update]:
        if self._broken is not None:
            raise EngineBroken(self._broken)
        with self._lock:
            events, self._events = self._events, []
            staged, self._staged = self._staged, []
            self._waiting.extend(staged)
            self._cancel |= {ev["id"] for ev in events if ev["op"] == "cancel"}
        try:
            self.mirror.send(STEP, events)
            return super().step()
        except Exception as err:
            msg = self._dead_follower()  # a dead follower explains any error of the step
            if msg:
                raise ParallelError(f"tensor-parallel {msg}") from err
            raise

    def _dead_follower(self, wait_s: float = 1.0) -> str | None:
        """A follower that exited, allowing it ``wait_s`` to be reaped: its sockets close
        (and fail this rank's transfers) a moment before the OS reports it gone."""
        end = time.monotonic() + wait_s
        while True:
            msg = self.workers.failed()
            if msg or time.monotonic() > end:
                return msg
            time.sleep(0.02)

    def score(self, ids: list[int], top: int = 0) -> list[TokenLogprob | None]:
        if self._broken is not None:
            raise EngineBroken(self._broken)
        self.mirror.send(SCORE, [{"ids": list(ids), "top": top}])
        return super().score(ids, top)

    def abort_running(self) -> list[Request]:
        """After a failed step the ranks' engines may disagree: end the running requests and
        the queued ones, and refuse further work (the server has to be restarted)."""
        self._broken = ("the tensor-parallel ranks failed during a step; restart the server "
                        "(see its log)")
        msg = self._dead_follower()
        if msg:
            self._broken += f": {msg}"
        with self._lock:
            queued = [*self._waiting, *self._staged]
            self._waiting.clear()
            self._staged.clear()
            self._events.clear()
        now = time.perf_counter()
        for r in queued:
            r.status, r.finish_reason, r.t_end = "finished", "error", now
        return super().abort_running() + queued

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._broken is None:
                self.mirror.send(STOP, [])
                self.workers.join(self.timeout_s)
        except Exception as err:  # shutting down: say it, stop the workers regardless
            log.warning("tensor-parallel workers did not stop cleanly: %s", err)
        finally:
            self.workers.kill()
            leave_group()
            super().close()


def follow(rank: int, world: int, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
           tokenizer: Any, strategy: str, options: Any, engine_kw: dict[str, Any],
           timeout_s: float) -> None:
    """Entry of a follower rank: rank 0's engine, replayed on this rank's shard."""
    shard = rank_shard(cfg, tensors, rank, world, timeout_s)
    engine = Engine(shard, tokenizer, strategy, options, **engine_kw)
    try:
        while True:
            kind, events = receive(timeout_s)
            if kind == STOP:
                return
            if kind == SCORE:
                for ev in events:  # a bad request fails on rank 0 too, which tells the client
                    with contextlib.suppress(ConfigError):
                        engine.score(ev["ids"], ev["top"])
                continue
            for ev in events:
                if ev["op"] == "submit":
                    opts = engine._request_options(None, _from_json(ev["options"]))
                    req = engine._build(ev["ids"], SamplingOptions(**_from_json(ev["sampling"])),
                                        opts, None, ev["id"])
                    engine._waiting.append(req)
                else:
                    engine._cancel.add(ev["id"])
            engine.step()
    except BaseException:
        layout = shard.output_layout
        reducer = layout.reducer if isinstance(layout, VocabParallel) else None
        if reducer is not None:
            reducer.abort()  # rank 0 fails its step at once instead of at the timeout
        raise
    finally:
        engine.close()


def tp_engine(model: EarlyExitLM, tokenizer: Any, strategy: str, options: Any, *, tp: int,
              threads: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
              **engine_kw: Any) -> TPEngine:
    """Start ``tp - 1`` follower processes holding shards of ``model`` and return rank 0's
    :class:`TPEngine` (``engine_kw``: :class:`~exitlm.infer.engine.Engine`'s ``max_batch``,
    ``max_seq_len``, ``max_queue``). :meth:`TPEngine.close` stops the followers."""
    check_tp(model.config, tp)
    check_quantized(model, tp)
    check_strategy(strategy, {"kv": getattr(options, "kv", "recompute")})
    if tp < 2:
        raise ConfigError(f"--tp {tp}: a tensor-parallel server needs at least 2 processes")
    follower_kw = {k: v for k, v in engine_kw.items() if k != "max_queue"}
    follower_kw["threads"] = threads
    workers = start_workers(follow, (model.config, model_tensors(model), tokenizer, strategy,
                                     options, follower_kw, timeout_s), tp,
                            timeout_s=timeout_s, threads=threads)
    try:
        shard = shard_model(model, 0, tp, timeout_s=timeout_s)
        return TPEngine(shard, tokenizer, strategy, options, mirror=Mirror(tp),
                        workers=workers, timeout_s=timeout_s, threads=threads, **engine_kw)
    except BaseException:
        workers.kill()
        leave_group()
        raise
