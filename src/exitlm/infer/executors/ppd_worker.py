"""PPD's sub-processes as real operating-system processes (PPD Sec. 3, Alg. 2 lines 17-29).

On CPU, PPD branches on Python threads do not overlap with the main token: a small model
spends most of a layer in Python-level op dispatch, which the GIL serialises. Here the
branches run in one **spawned worker process** holding its own copy of the model (the same
parameter storage, shared with the parent), one thread each:

* **Shared KV.** The keys/values of layers ``[0, m)`` (``m = d - d_bar``, the layers a branch
  runs) live in a :class:`BranchCache` in shared memory (``share_memory_()``), one row per
  candidate. The main process reads and writes row 0 of it as its own lower layers (a
  :meth:`~exitlm.model.kv_cache.KVCache.spliced` view: layers ``< m`` from the shared rows,
  the others from the engine's pool), so a confirmed branch's entry needs no copy at all
  when ``k = 1``.
* **Ownership.** During a fork (token ``x_t`` at position ``p``) the worker writes only
  position ``p + 1`` of layers ``< m`` of the rows it evaluates, and reads positions
  ``<= p`` of those layers, which the main process wrote before the fork and does not touch
  during it (it runs layers ``>= d_bar >= m``). The branch's hidden state after layer ``m``
  goes to a shared ``(k, D)`` buffer. After the fork the main process adopts the winning
  entry (PPD Alg. 2 line 12) or simply overwrites it with its own computation of ``p + 1``.
* **Protocol.** One duplex pipe: ``("predict", p, k)`` as soon as the hidden state after
  layer ``d_bar`` is in the shared buffer ``hin``: the worker computes the early prediction
  (exit ``d_bar``'s head, top-``k``) itself, so that projection - for a large vocabulary
  several layers' worth of work - is off the main process's critical path, which Theorem 4.1
  assumes it is; or ``("fork", p, tokens)`` with candidates the main process chose (exits
  with a transformer-block head, whose KV the main process keeps). Either is answered by
  ``("done", ..., tokens)`` when every candidate has run layers ``[0, m)``; the
  main process finishes layers ``[d_bar, d)`` of ``x_t`` meanwhile and only then waits. The
  per-token messages are packed with ``struct`` (no pickling); a round trip costs ~0.1 ms on
  a busy 2-core machine, against ~4 ms for ``torch.distributed`` gloo send/recv over
  127.0.0.1 (``benchmarks/ppd_processes.py --handoff``); busy-waiting on shared-memory flags
  answers in ~2 us but keeps a core spinning, which a shared CPU cannot spare.
  Candidates run one after another as batch-1 forwards, so every row's arithmetic is
  exactly that of plain greedy decoding (token-identical output).
* **Lifetime.** The worker is spawned (never forked: a forked copy of a process running
  OpenMP / BLAS threads can deadlock), daemonic, stopped by :meth:`BranchWorker.close`; it
  exits by itself when its parent's end of the pipe closes, and at once when the parent dies,
  during start-up too (:mod:`~exitlm.comm.lifeline`), removing the parent's temporary
  directory (the shared tensors were handed over through a socket there). Every wait has a
  timeout, and a worker that fails, dies or does not answer is terminated and reported as
  :class:`BranchWorkerError`, never waited on forever.
"""

from __future__ import annotations

import contextlib
import statistics
import struct
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as tmp

from exitlm.comm.lifeline import (
    EOF_GRACE_S,
    adopt_tempdir,
    leave_orphaned,
    parent_tempdir,
    watch_parent,
)
from exitlm.config import ConfigError, ModelConfig
from exitlm.errors import ExitlmError
from exitlm.infer.decoder import Decoder
from exitlm.infer.executor import Executor
from exitlm.infer.ppd import PPDDecoder
from exitlm.infer.ppd_branches import Branches, branch
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner

if TYPE_CHECKING:
    from exitlm.infer.strategies import Strategy

READY_TIMEOUT_S = 180.0
"""How long a spawned worker may take to import torch and build its model."""
STEP_TIMEOUT_S = 60.0
"""How long the main process waits for one fork's branches (a layer takes milliseconds)."""
STOP_TIMEOUT_S = 5.0
"""How long :meth:`BranchWorker.close` waits for a clean exit before terminating."""


class BranchWorkerError(ExitlmError, RuntimeError):
    """The PPD branch worker process failed, died or did not answer in time (one line on the
    command line, like every :class:`~exitlm.errors.ExitlmError`)."""


_FORK, _PREDICT, _DONE, _PING, _PONG = b"F", b"R", b"D", b"P", b"Q"


def _pack(msg: tuple[Any, ...]) -> bytes:
    """Per-token messages as raw bytes, anything else pickled (pickles start with 0x80)."""
    kind = msg[0]
    if kind == "fork":
        return _FORK + struct.pack(f"<{1 + len(msg[2])}q", msg[1], *msg[2])
    if kind == "predict":
        return _PREDICT + struct.pack("<2q", msg[1], msg[2])
    if kind == "done":
        return _DONE + struct.pack(f"<2d{len(msg[3])}q", msg[1], msg[2], *msg[3])
    if kind in ("ping", "pong"):
        return _PING if kind == "ping" else _PONG
    return bytes(ForkingPickler.dumps(msg))


def _unpack(buf: bytes) -> tuple[Any, ...]:
    tag = buf[:1]
    if tag == _FORK:
        p, *tokens = struct.unpack(f"<{(len(buf) - 1) // 8}q", buf[1:])
        return ("fork", p, tokens)
    if tag == _PREDICT:
        return ("predict", *struct.unpack("<2q", buf[1:]))
    if tag == _DONE:
        wall, cpu, *tokens = struct.unpack(f"<2d{(len(buf) - 17) // 8}q", buf[1:])
        return ("done", wall, cpu, tokens)
    if tag in (_PING, _PONG):
        return ("ping",) if tag == _PING else ("pong",)
    return tuple(ForkingPickler.loads(buf))


class BranchCache:
    """Keys/values of layers ``[0, m)`` for ``k`` candidate rows, in shared memory, and the
    ``(k, D)`` buffer the branches' hidden states come back in."""

    def __init__(self, m: int, k: int, capacity: int, cfg: ModelConfig,
                 dtype: torch.dtype) -> None:
        self.cache = KVCache(m, k, capacity, cfg.n_kv_heads, cfg.hdim, dtype=dtype)
        for t in (*self.cache.keys, *self.cache.values):
            t.share_memory_()
        self.out = torch.zeros(k, cfg.dim, dtype=dtype).share_memory_()
        self.hin = torch.zeros(1, 1, cfg.dim, dtype=dtype).share_memory_()
        """The hidden state after layer ``d_bar`` the worker predicts from (``predict``)."""
        self.m, self.k, self.capacity = m, k, capacity

    def main_view(self, pool: KVCache) -> KVCache:
        """The main process's cache for one step: layers ``< m`` from row 0 here, the others
        (and the bookkeeping) from the engine's pool row ``pool``."""
        return pool.spliced(self.cache.rows(0, 1), self.m)

    def load_prefix(self, pool: KVCache, n: int) -> None:
        """Copy positions ``[0, n)`` of layers ``< m`` from ``pool`` into every row."""
        for i in range(self.m):
            self.cache.keys[i][:, :, :n] = pool.keys[i][:, :, :n]
            self.cache.values[i][:, :, :n] = pool.values[i][:, :, :n]

    def broadcast(self, src: int, p: int) -> None:
        """Copy position ``p`` of layers ``< m`` from row ``src`` into the other rows (after
        the main process wrote row 0 there, or a candidate ``src`` was confirmed)."""
        if self.k == 1:
            return
        others = [r for r in range(self.k) if r != src]
        for t in (*self.cache.keys, *self.cache.values):
            t[others, :, p] = t[src, :, p]


def _serve(conn: Connection, cfg: ModelConfig, params: dict[str, torch.Tensor], m: int,
           threads: int, draft: tuple[int, int] | None, order: torch.Tensor | None) -> None:
    """The worker process: build the model on the parent's parameters and token order (and,
    with ``draft`` = ``(d_bar, vocab)``, the early prediction's head), then run forks. The
    first message names the parent's temporary directory, removed if the parent dies first
    ("attach" hands the shared tensors over through a socket there)."""
    try:
        adopt_tempdir(_unpack(conn.recv_bytes())[1])
    except (EOFError, OSError):  # the parent died at once
        return
    watch_parent()  # a parent killed while this builds its model: end now, not at "ready"
    torch.set_num_threads(threads)
    try:
        model = rebuild_model(cfg, params, "the PPD parent process")
        if order is not None:
            model.set_token_order(order)
        runner = prepare(model)
        conn.send_bytes(_pack(("ready",)))
    except BaseException as err:
        _report(conn, err)
        return
    cache: KVCache | None = None
    out = hin = None
    with torch.inference_mode():
        while True:
            try:
                msg = _unpack(conn.recv_bytes())
            except (EOFError, OSError):  # the parent closed the pipe or is gone
                leave_orphaned(EOF_GRACE_S)  # gone: its temporary directory goes too
                return
            try:
                if msg[0] == "stop":
                    return
                if msg[0] == "ping":
                    conn.send_bytes(_PONG)
                elif msg[0] == "attach":
                    keys, values, out, hin = msg[1], msg[2], msg[3], msg[4]
                    cache = KVCache.__new__(KVCache)
                    cache.keys, cache.values = list(keys), list(values)
                    cache.batch_size, cache.max_seq_len = keys[0].shape[0], keys[0].shape[2]
                    cache._lengths = torch.zeros(cache.batch_size, dtype=torch.long)
                    cache._fill = torch.zeros(len(keys), cache.batch_size, dtype=torch.long)
                    conn.send_bytes(_pack(("attached",)))
                elif msg[0] in ("fork", "predict"):
                    assert cache is not None and out is not None, "fork before attach"
                    t0, c0 = time.perf_counter(), time.thread_time()
                    if msg[0] == "predict":  # the early prediction, off the main's path
                        assert draft is not None and hin is not None, "no draft head"
                        p, k = msg[1], msg[2]
                        logits = runner.logits(hin, draft[0], vocab=draft[1])[0, -1]
                        cands = runner.draft_tokens(torch.topk(logits, k).indices, draft[1])
                    else:
                        p, cands = msg[1], torch.tensor(msg[2])
                    tokens = cands.tolist()
                    for j in range(len(tokens)):
                        out[j] = branch(runner, cache.rows(j, j + 1), cands[j : j + 1], p,
                                        m)[0, 0]
                    conn.send_bytes(_pack(("done", time.perf_counter() - t0,
                                           time.thread_time() - c0, tokens)))
                else:
                    raise ValueError(f"unknown message {msg[0]!r}")
            except BaseException as err:
                _report(conn, err)
                return


def _report(conn: Connection, err: BaseException) -> None:
    """Hand the worker's failure to the parent; a broken pipe means a dead parent (end
    quietly then) or one stopping this worker (nothing to tell)."""
    leave_orphaned(EOF_GRACE_S if isinstance(err, (OSError, EOFError)) else 0.0)
    with contextlib.suppress(OSError, ValueError):
        conn.send_bytes(_pack(("error", traceback.format_exc())))


class BranchWorker:
    """The parent's handle to one branch worker process (see the module docstring)."""

    def __init__(self, model: EarlyExitLM, m: int, threads: int = 1,
                 draft: tuple[int, int] | None = None) -> None:
        """``draft`` = ``(d_bar, vocab)``: the worker also makes the early predictions
        (:meth:`predict`) with exit ``d_bar``'s head over a draft vocabulary of ``vocab`` ids
        (the model's ranked ids, :meth:`~exitlm.model.transformer.EarlyExitLM.draft_ids`)."""
        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        params = model_tensors(model)
        self.proc = ctx.Process(target=_serve,
                                args=(child, model.config, params, m, threads, draft,
                                      None if model.token_order is None
                                      else model.token_order.cpu()),
                                daemon=True, name="exitlm-ppd-branch")
        self.proc.start()
        child.close()  # the worker's end: our copy closed, so its death reads as EOF here
        # created only now, and named at once: a worker that outlives us removes it
        self._send(("tempdir", parent_tempdir()), "start-up")
        self.ready = False
        self.attached: BranchCache | None = None
        self.pending = False
        self.tokens: list[int] = []
        """The candidates of the fork joined last (the worker's own top-k after a predict)."""
        self.joins = 0
        self.waited_s = 0.0  # diagnostics: time the main process spent blocked in join,
        self.branch_s = 0.0  # the worker's time per fork (wall clock and CPU: their ratio
        self.branch_cpu_s = 0.0  # is the share of a core it got), over `joins` forks

    # ----- waiting ---------------------------------------------------------------------------
    def _recv(self, timeout: float, what: str) -> tuple[Any, ...]:
        try:
            if not self.conn.poll(timeout):
                self._kill()
                raise BranchWorkerError(f"PPD branch worker did not answer {what} within "
                                        f"{timeout:.0f} s; it was terminated")
            msg = _unpack(self.conn.recv_bytes())
        except (EOFError, OSError) as err:
            self._kill()
            raise BranchWorkerError(f"PPD branch worker exited during {what} (exit code "
                                    f"{self.proc.exitcode})") from err
        if msg[0] == "error":
            self._kill()
            raise BranchWorkerError(f"PPD branch worker failed during {what}:\n{msg[1]}")
        return msg

    def _send(self, msg: tuple[Any, ...], what: str) -> None:
        try:
            self.conn.send_bytes(_pack(msg))
        except (OSError, ValueError) as err:  # broken pipe: the worker is gone
            self._kill()
            raise BranchWorkerError(f"PPD branch worker is gone ({what}; exit code "
                                    f"{self.proc.exitcode})") from err

    def wait_ready(self) -> None:
        """Block until the worker has built its model (spawning takes seconds)."""
        if not self.ready:
            self._recv(READY_TIMEOUT_S, "start-up")
            self.ready = True

    def attach(self, branches: BranchCache) -> None:
        """Hand the worker the shared cache and output buffer it writes into."""
        self.wait_ready()
        if self.attached is not branches:
            self._send(("attach", branches.cache.keys, branches.cache.values,
                        branches.out, branches.hin), "attach")
            self._recv(STEP_TIMEOUT_S, "attach")
            self.attached = branches

    # ----- one fork --------------------------------------------------------------------------
    def fork(self, p: int, tokens: list[int]) -> None:
        """Start the candidates ``tokens`` at position ``p`` (returns at once)."""
        self.join()  # a fork whose step raised before joining is collected first
        self._send(("fork", p, tokens), "a fork")
        self.pending = True

    def predict(self, p: int, k: int) -> None:
        """Make the early prediction from the shared ``hin`` (top-``k`` of the draft head)
        and start those candidates at position ``p`` (returns at once; :meth:`join`, then
        :attr:`tokens` names them)."""
        self.join()
        self._send(("predict", p, k), "a prediction")
        self.pending = True

    def join(self) -> None:
        """Wait for the fork started last; its hidden states are in the output buffer."""
        if self.pending:
            self.pending = False
            t0 = time.perf_counter()
            msg = self._recv(STEP_TIMEOUT_S, "a fork")
            self.waited_s += time.perf_counter() - t0
            self.branch_s += msg[1]
            self.branch_cpu_s += msg[2]
            self.tokens = msg[3]
            self.joins += 1

    def ping(self, n: int = 200) -> float:
        """Median round trip of an empty message (the per-token hand-off cost), seconds."""
        self.wait_ready()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._send(("ping",), "a ping")
            self._recv(STEP_TIMEOUT_S, "a ping")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    # ----- shutdown --------------------------------------------------------------------------
    def _kill(self) -> None:
        """End a worker that failed or does not answer (SIGKILL: it holds nothing to clean
        up, the shared memory is the parent's) and close the pipe."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(STOP_TIMEOUT_S)
        self.conn.close()

    def close(self) -> None:
        """Stop the worker: a clean exit if it answers, else terminate / kill."""
        if self.conn.closed:
            return
        try:
            self.conn.send_bytes(_pack(("stop",)))
            self.proc.join(STOP_TIMEOUT_S)
        except (OSError, ValueError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(STOP_TIMEOUT_S)
        self._kill()

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()


class ProcessBranches(Branches):
    """Branches in one spawned worker process (:class:`~exitlm.infer.executors.ppd_worker.
    BranchWorker`) on keys/values in shared memory: the main token reads and writes row 0
    of them as its own lower layers, so a confirmed branch's entry needs no copy when
    ``k = 1``."""

    def __init__(self, runner: Runner, m: int, k: int, head: tuple[int, int], *,
                 predicts: bool) -> None:
        super().__init__(runner, m, k, head)
        self.predicts = predicts
        self.worker: BranchWorker | None = None
        self.shared: BranchCache | None = None
        self.startup_s = 0.0
        """Seconds spent spawning the worker and waiting for it to build its model."""

    def start(self, main: KVCache, prompt: int, capacity: int) -> None:
        if self.worker is None or not self.worker.alive:
            if self.worker is not None:  # it failed in an earlier step: start afresh
                self.worker.close()
            t0 = time.perf_counter()
            self.worker = BranchWorker(self.runner.model, self.m, threads=1,
                                       draft=(self.d_bar, self.vocab) if self.predicts
                                       else None)
            self.worker.wait_ready()
            self.startup_s += time.perf_counter() - t0
        if self.shared is None or self.shared.capacity < capacity:
            self.shared = BranchCache(self.m, self.k, max(capacity, 256), self.runner.config,
                                      main.dtype)
        self.shared.load_prefix(main, prompt)  # the prompt's entries, once
        self.worker.attach(self.shared)

    def main_view(self, main: KVCache) -> KVCache:
        assert self.shared is not None
        return self.shared.main_view(main)

    def share(self, main: KVCache, p: int) -> None:
        assert self.shared is not None
        self.shared.broadcast(0, p)

    def adopt(self, j: int, main: KVCache, p: int) -> None:
        assert self.shared is not None  # main's layers < m are row 0 of the shared rows
        self.shared.broadcast(j, p)

    def fork(self, cands: torch.Tensor, p: int) -> None:
        assert self.worker is not None
        self.worker.fork(p, cands.tolist())

    def predict(self, hm: torch.Tensor, p: int) -> None:
        assert self.worker is not None and self.shared is not None
        self.shared.hin.copy_(hm)
        self.worker.predict(p, self.k)

    def join(self) -> tuple[list[int], list[torch.Tensor]]:
        assert self.worker is not None and self.shared is not None
        self.worker.join()
        # the shared output rows are overwritten by the next fork: the caller keeps copies
        return self.worker.tokens, [self.shared.out[j].view(1, 1, -1).clone()
                                    for j in range(len(self.worker.tokens))]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class BranchWorkerExecutor(Executor):
    """PPD with its branches in a worker process (``ppd_workers='process'``, CPU): the
    executor whose decoders run their branches on :class:`ProcessBranches` (the worker is
    spawned at a sequence's prefill and stopped with the decoder)."""

    name = "ppd-worker"

    def decoder(self, strategy: Strategy, options: Any) -> Decoder:
        if strategy.name != "ppd":
            raise ConfigError(f"the PPD branch worker runs --strategy ppd, not "
                              f"{strategy.name}")
        if self.runner.device.type != "cpu":
            raise ConfigError("ppd_workers='process' is for CPU; on a GPU the branches run on "
                              "CUDA streams (--ppd-workers thread)")
        return PPDDecoder(self.runner, options, branches=ProcessBranches)
