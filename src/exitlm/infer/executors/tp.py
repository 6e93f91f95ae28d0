"""Tensor-parallel decoding and serving: :class:`TPExecutor`.

Tensor-parallel decoding (:mod:`~exitlm.infer.executors.tp_shard`) needs every rank to run the
same steps on the same rows: the collectives inside each layer pair them up. An engine,
though, admits requests as they arrive and drops them when clients go away, at whatever step
that happens. So the ranks replicate rank 0's engine:

* rank 0 runs the :class:`~exitlm.infer.engine.Engine` (``generate``, the server, lm-eval)
  on its shard, over a :class:`TPExecutor`. The engine applies submissions and cancellations
  only at the start of a step, and the executor sends them there - in order - with the step
  command (:meth:`TPExecutor.before_step`);
* ranks ``1..T-1`` run :func:`follow`: an ordinary engine on their shard (the same strategy,
  options, tokenizer and limits, :class:`~exitlm.infer.executor.EngineSpec`, sent when rank
  0's engine starts) that applies the same submissions and cancellations and steps when
  told. One executor serves several engines one after the other (a benchmark's calls): each
  new engine replaces the followers' previous one. The engine is deterministic given
  its inputs and the collectives give every rank the same bits, so every rank admits,
  decodes, stops (end tokens, stop strings, lengths) and frees rows exactly as rank 0 does.
  Sampling without a seed gets one drawn by rank 0 (:meth:`TPExecutor.admit`).

Messages are an int64 header (kind, payload bytes) and a JSON payload (never pickle) over
gloo; a follower waits for the next one without a deadline, as a server may idle for hours,
and every other wait is bounded by ``--dist-timeout``. Echo log-probabilities (a forward of
the prompt between steps) are mirrored the same way. A rank that fails marks the shared
collectives aborted, so rank 0's step fails at once with a message rather than at a timeout;
the engine then refuses further work (:attr:`TPExecutor.fatal_failures`).

The followers are spawned by the executor (``exitlm generate --tp T``, ``exitlm serve --tp
T``) or started by ``torchrun`` (``joined``: every rank ran the same command; ranks ``>= 1``
call :func:`follow_joined`).
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
from exitlm.comm.launch import DEFAULT_TIMEOUT_S, Workers, leave_group, start_workers
from exitlm.comm.p2p import IDLE_WAIT
from exitlm.config import ConfigError, ModelConfig
from exitlm.infer.engine import Engine
from exitlm.infer.executor import Cancel, EngineSpec, Event, Executor
from exitlm.infer.executors.tp_shard import (
    VocabParallel,
    check_quantized,
    check_strategy,
    rank_shard,
    shard_model,
)
from exitlm.infer.options import SamplingOptions
from exitlm.infer.strategies import get_strategy
from exitlm.io.materialize import model_tensors
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.sharding import check_whole_heads
from exitlm.runtime import prepare

log = logging.getLogger("exitlm.tp")

STEP, SCORE, STOP, ENGINE = 1, 2, 3, 4


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


def draw_seed() -> int:
    """A sampling seed from torch's global generator, as one process draws one for a
    sequence without a seed (:func:`~exitlm.infer.sampling.make_generator`)."""
    return int(torch.randint(0, 2**32, (1,)).item())


def _event(ev: Event, per_request: frozenset[str]) -> dict[str, Any]:
    """One submission or cancellation as the followers get it (JSON): a submission carries
    its request's ``per_request`` strategy options."""
    if isinstance(ev, Cancel):
        return {"op": "cancel", "id": ev.request_id}
    req = ev.request
    own = {name: getattr(req.options, name) for name in per_request}
    return {"op": "submit", "id": req.id, "ids": req.prompt_ids,
            "sampling": _to_json(dataclasses.asdict(req.sampling)),
            "options": _to_json(own)}


class TPExecutor(Executor):
    """Rank 0 of ``tp`` tensor-parallel ranks holding shards of ``model`` (see the module
    docstring). The followers replay its engine's steps; engines built on it run one after
    the other, with the same tokenizer."""

    name = "tensor-parallel"
    fatal_failures = True

    def __init__(self, model: EarlyExitLM, tp: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads: int = 1, joined: bool = False) -> None:
        check_whole_heads(model.config, tp)
        check_quantized(model, tp)
        if tp < 2:
            raise ConfigError(f"--tp {tp}: tensor parallelism needs at least 2 processes")
        self.model, self.tp, self.timeout_s, self.threads = model, tp, timeout_s, threads
        self.joined = joined
        self.mirror = Mirror(tp)
        self.workers: Workers | None = None
        self.per_request: frozenset[str] = frozenset()
        self.tokenizer: Any = None
        self._started = self._closed = False

    def start(self, spec: EngineSpec) -> None:
        """Spawn the followers (the first engine) and tell them the engine to replay."""
        check_strategy(spec.strategy, {"kv": getattr(spec.options, "kv", "recompute")})
        if not self._started:
            self._started, self.tokenizer = True, spec.tokenizer
            if not self.joined:
                self.workers = start_workers(
                    follow, (self.model.config, model_tensors(self.model), spec.tokenizer,
                             self.timeout_s), self.tp, timeout_s=self.timeout_s,
                    threads=self.threads)
            try:
                self.runner = prepare(shard_model(self.model, 0, self.tp,
                                                  timeout_s=self.timeout_s))
            except BaseException:
                self._stop_workers()
                raise
        elif spec.tokenizer is not self.tokenizer:
            raise ConfigError("the engines of one TPExecutor share its first engine's tokenizer")
        self.per_request = get_strategy(spec.strategy).per_request
        self.mirror.send(ENGINE, [{"strategy": spec.strategy,
                                   "options": _to_json(dataclasses.asdict(spec.options)),
                                   "max_batch": spec.max_batch,
                                   "max_seq_len": spec.max_seq_len,
                                   "threads": self.threads,
                                   "prefill_chunk": spec.prefill_chunk,
                                   "share_prompts": spec.share_prompts}])

    def admit(self, sampling: SamplingOptions) -> SamplingOptions:
        """Sampling without a seed gets one here, the same on every rank."""
        if not sampling.greedy and sampling.seed is None:
            return sampling.replace(seed=draw_seed())
        return sampling

    def before_step(self, events: list[Event]) -> None:
        self.mirror.send(STEP, [_event(ev, self.per_request) for ev in events])

    def before_score(self, ids: list[int], top: int) -> None:
        self.mirror.send(SCORE, [{"ids": list(ids), "top": top}])

    def failure(self, wait_s: float = 1.0) -> str | None:
        """A follower that exited, allowing it ``wait_s`` to be reaped: its sockets close
        (and fail this rank's transfers) a moment before the OS reports it gone."""
        if self.workers is None:
            return None
        end = time.monotonic() + wait_s
        while True:
            msg = self.workers.failed()
            if msg or time.monotonic() > end:
                return msg
            time.sleep(0.02)

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if error is None and self._started:
                self.mirror.send(STOP, [])
                if self.workers is not None:
                    self.workers.join(self.timeout_s)
        except Exception as err:  # shutting down: say it, stop the workers regardless
            log.warning("tensor-parallel workers did not stop cleanly: %s", err)
        finally:
            self._stop_workers()

    def _stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.kill()
            leave_group()


def follow(rank: int, world: int, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
           tokenizer: Any, timeout_s: float) -> None:
    """Entry of a spawned follower rank: rank 0's engines, replayed on this rank's shard."""
    _replay(rank_shard(cfg, tensors, rank, world, timeout_s), tokenizer, timeout_s)


def follow_joined(model: EarlyExitLM, tokenizer: Any, rank: int, world: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A follower rank of a ``torchrun`` job (every rank loaded ``model`` and ``tokenizer``
    from the same command line): rank 0's engines, replayed on this rank's shard."""
    _replay(shard_model(model, rank, world, timeout_s=timeout_s), tokenizer, timeout_s)


def _replay(shard: EarlyExitLM, tokenizer: Any, timeout_s: float) -> None:
    """Build the engines rank 0 builds and apply their submissions, cancellations, steps and
    scoring forwards, in order, until rank 0 says stop."""
    runner = prepare(shard)
    engine: Engine | None = None
    try:
        while True:
            kind, events = receive(timeout_s)
            if kind == STOP:
                return
            if kind == ENGINE:
                if engine is not None:
                    engine.close()
                (spec,) = events
                strategy = get_strategy(spec["strategy"])
                engine = Engine(runner, tokenizer, strategy.name,
                                strategy.options(None, **_from_json(spec["options"])),
                                max_batch=spec["max_batch"], max_seq_len=spec["max_seq_len"],
                                threads=spec["threads"], prefill_chunk=spec["prefill_chunk"],
                                share_prompts=spec["share_prompts"])
                continue
            assert engine is not None, "rank 0 steps before it starts an engine"
            if kind == SCORE:
                for ev in events:  # a bad request fails on rank 0 too, which tells the client
                    with contextlib.suppress(ConfigError):
                        engine.score(ev["ids"], ev["top"])
                continue
            for ev in events:
                if ev["op"] == "submit":
                    opts = engine.request_options(None, _from_json(ev["options"]))
                    engine.enqueue(engine.build_request(
                        ev["ids"], SamplingOptions(**_from_json(ev["sampling"])), opts, None,
                        ev["id"]))
                else:
                    engine.cancel(ev["id"])
            engine.step()
    except BaseException:
        layout = shard.output_layout
        if isinstance(layout, VocabParallel) and layout.reducer is not None:
            layout.reducer.abort()  # rank 0 fails its step at once instead of at the timeout
        raise
    finally:
        if engine is not None:
            engine.close()
