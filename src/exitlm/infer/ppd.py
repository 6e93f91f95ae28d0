"""Predictive Pipelined Decoding (PPD Sec. 3, Alg. 1, and the general case Alg. 2 / App. C).

A model has ``d`` layers; the early prediction is made at exit ``d_bar`` (``d/2 <= d_bar <
d``). Per generated token ``x_t`` at position ``p`` (one :meth:`PPDDecoder.step`):

* **main** (sequential): run ``x_t`` up to layer ``d_bar`` - from layer 1, or, when the last
  early prediction was confirmed, from layer ``d - d_bar`` on the hidden state the matching
  branch produced (Alg. 2 line 12). The top-``k`` tokens of exit ``d_bar`` (the early
  prediction) are taken on the branch's side - the pool thread or the worker process - so
  that projection, several layers' worth of work over a large vocabulary, is not on the main
  token's path, where Theorem 4.1 does not count it; exits with a transformer-block head
  (whose KV cache slot the main thread fills) and CUDA streams take it on the main thread.
* **in parallel** (Alg. 2 lines 17-29): the main thread runs layers ``d_bar..d`` of ``x_t``
  while ``k`` worker threads each run one candidate ``x_hat_j`` at position ``p + 1`` through
  layers ``1..d - d_bar``. On CUDA every branch runs on its own stream; with the model's
  CUDA graphs (:mod:`exitlm.backend.cuda_graphs`) the whole token is replayed from this
  thread, the branches on their streams beside the main token's last layers. With
  ``ppd_workers="process"`` (CPU) the candidates run in one spawned worker process instead,
  on keys/values in shared memory (:mod:`exitlm.infer.ppd_workers`): threads share the GIL,
  so on CPU only processes overlap the branch with the main token.
* if the final layer's argmax equals a candidate, that branch's hidden state and its new
  keys/values are kept and the next token starts at layer ``d - d_bar``; otherwise every
  branch is discarded and the next token starts from layer 1.

**KV sharing.** Branches read the prefix keys/values of layers ``1..d - d_bar``, which the
main thread has already written for every position ``<= p`` before the fork and never touches
during it (it writes only layers ``> d_bar >= d - d_bar``). Each branch owns a cache of just
those ``d - d_bar`` layers; after every token the new prefix entry (position ``p``, or the
winning branch's ``p + 1``) is copied into the other caches: ``O(d - d_bar)`` small copies per
token, no prefix is ever copied twice. Every token goes through exactly the same single-row
computations as plain greedy decoding, so the output is token-identical to greedy decoding.

PPD holds one sequence at a time (``max_batch = 1``: the engine queues the others) and is
defined for greedy decoding only. :class:`PPDStats` reports the measured ``p_correct`` and
:meth:`PPDStats.theory` PPD Theorem 4.1's prediction for it (:mod:`exitlm.plan.ppd_theory`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from exitlm.backend.cuda_graphs import StaticSteps, static_steps
from exitlm.config import ConfigError
from exitlm.infer.decoder import (
    Batch,
    Decoder,
    DraftHead,
    Emit,
    Seq,
    last_positions,
    prefill_hidden,
)
from exitlm.infer.options import option
from exitlm.infer.ppd_workers import BranchCache, BranchWorker, branch_forward
from exitlm.infer.result import DecodeStats
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan import ppd_theory
from exitlm.schema import PositiveInt, check


@dataclass(frozen=True)
class PPDOptions:
    """Options of the ``ppd`` strategy."""

    ppd_layer: PositiveInt | None = option(
        None, "d_bar, the exit whose top-k predictions start the next token (d/2 <= d_bar < d; "
        "default: the deepest exit head >= d/2, else d/2)")
    ppd_k: PositiveInt = option(1, "k, the number of candidate branches")
    parallel: bool = option(
        True, "run branches concurrently with the main thread (threads / CUDA streams); "
        "--no-parallel runs them one after the other (same tokens)")
    ppd_workers: Literal["thread", "process"] = option(
        "thread", "where the branches run: 'thread' (worker threads; CUDA streams on a GPU) or "
        "'process' (CPU: one spawned worker process, KV cache in shared memory, one thread "
        "per process; overlaps where threads are serialised by the GIL)")
    draft_vocab: PositiveInt | None = option(
        None, "take the top-k among the first N token ids only (a cheaper early projection "
        "on the critical path); output unchanged")

    def __post_init__(self) -> None:
        check(self)
        if self.draft_vocab is not None and self.draft_vocab < self.ppd_k:
            raise ConfigError(f"draft_vocab must be >= ppd_k, got {self.draft_vocab}")
        if self.ppd_workers == "process" and not self.parallel:
            raise ConfigError("ppd_workers='process' runs the branches in parallel; drop "
                              "--no-parallel (or use --ppd-workers thread)")


@dataclass
class PPDStats(DecodeStats):
    """Per-sequence counters of PPD: forks (early predictions made) and matches (confirmed)."""

    forks: int = 0
    matches: int = 0

    @property
    def p_correct(self) -> float:
        return self.matches / self.forks if self.forks else 0.0

    def derived(self) -> dict[str, float]:
        return {"p_correct": self.p_correct}

    def describe(self) -> str:
        return f"p_correct {self.p_correct:.1%}"

    def theory(self, d: int, d_bar: int, k: int, tokens: int) -> dict[str, float]:
        """PPD Theorem 4.1 for the measured ``p_correct`` over ``tokens`` decoded tokens."""
        return ppd_theory.predict(d, d_bar, k, tokens, self.p_correct)


def resolve_ppd_layer(model: EarlyExitLM, ppd_layer: int | None) -> int:
    """``d_bar`` (see :attr:`PPDOptions.ppd_layer`), checked against Theorem 4.1's range."""
    d = model.num_layers
    cfg = model.config
    if ppd_layer is None:
        deep = [x for x in cfg.exits.layers if 2 * x >= d]
        if deep:
            ppd_layer = deep[-1]
        elif cfg.exits.every_layer:
            ppd_layer = (d + 1) // 2
        else:
            raise ConfigError(
                "PPD needs an early exit at a layer >= num_layers / 2 (set ppd_layer, or load "
                "the model with exits, e.g. ExitConfig(every_layer=True))"
            )
    if not (2 * ppd_layer >= d and ppd_layer < d):
        raise ConfigError(
            f"ppd_layer (d_bar) must satisfy d/2 <= d_bar < d (PPD App. C), got {ppd_layer} "
            f"for d={d}"
        )
    model.exit_route(ppd_layer, setting="ppd_layer")
    return ppd_layer


class PPDDecoder(Decoder):
    """Greedy decoding with PPD (see the module docstring); one sequence at a time."""

    name = "ppd"
    stats_type = PPDStats
    max_batch = 1

    def __init__(self, model: EarlyExitLM, options: PPDOptions) -> None:
        super().__init__(model, options)
        self.d = model.num_layers
        self.d_bar = resolve_ppd_layer(model, options.ppd_layer)
        self.k = min(options.ppd_k, model.config.vocab_size)
        self.m = self.d - self.d_bar  # layers a branch runs before the main thread needs it
        vocab = model.config.vocab_size
        self.head = DraftHead(model, self.d_bar, vocab if options.draft_vocab is None
                              else min(options.draft_vocab, vocab))
        self.block = model.exit_route(self.d_bar).has_block
        self.process = options.ppd_workers == "process"
        if self.process and self.device.type != "cpu":
            raise ConfigError("ppd_workers='process' is for CPU; on a GPU the branches run on "
                              "CUDA streams (--ppd-workers thread)")
        threaded = options.parallel and not self.process
        cuda = self.device.type == "cuda"
        # the early prediction itself runs in the branch (thread or worker process), so the
        # draft head is off the main path; exits with a block head keep it on the main
        # thread, which owns that block's KV
        self.offload = not self.block and (self.process or (threaded and not cuda))
        # offloaded, one pool thread predicts and waits while k more run the branches
        self.pool = (ThreadPoolExecutor(max_workers=self.k + int(self.offload)) if threaded
                     else None)
        self.streams = ([torch.cuda.Stream(device=self.device) for _ in range(self.k)]
                        if cuda and threaded else None)
        self.branches: list[KVCache] = []
        self.worker: BranchWorker | None = None  # process mode: started at the first prefill
        self.shared: BranchCache | None = None  # process mode: layers < m, shared memory
        self.carried: torch.Tensor | None = None  # branch state after layer m, when matched

    def resolved_options(self) -> dict[str, Any]:
        return {**super().resolved_options(), "ppd_layer": self.d_bar, "ppd_k": self.k,
                "draft_vocab": self.head.vocab}

    def lookahead(self, seq: Seq) -> int:
        """A confirmed branch's entry lands one position past the token being decoded."""
        return 2

    @property
    def max_lookahead(self) -> int:
        return 2

    def check(self, seq: Seq) -> None:
        if not seq.sampling.greedy:
            raise ConfigError("ppd is exact greedy decoding; use temperature=0")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def prefill(self, batch: Batch) -> list[Emit]:
        if self.process and (self.worker is None or not self.worker.alive):
            if self.worker is not None:  # it failed in an earlier step: start afresh
                self.worker.close()
            self.worker = BranchWorker(  # spawning overlaps the prefill
                self.model, self.m, threads=1,
                draft=(self.d_bar, self.head.vocab) if self.offload else None)
        h, lens = prefill_hidden(self.model, batch, exits=(self.d_bar,) if self.block else ())
        seq, main = batch.seqs[0], batch.cache
        cfg = self.model.config
        capacity = len(seq.prompt) + seq.sampling.max_new_tokens + 2
        if self.worker is not None:
            if self.shared is None or self.shared.capacity < capacity:
                self.shared = BranchCache(self.m, self.k, max(capacity, 256), cfg, main.dtype)
            self.shared.load_prefix(main, int(lens[0]))  # the prompt's entries, once
            self.worker.attach(self.shared)
        else:
            static = self._static() is not None
            if static:  # graph programs keep their branch caches: as long as the pool
                capacity = main.max_seq_len
            if not (static and len(self.branches) == self.k
                    and self.branches[0].max_seq_len == capacity):
                self.branches = self._new_branches(capacity, main.dtype)
            for c in self.branches:  # the prompt's prefix entries, once
                c.copy_from(main, self.m, slice(0, int(lens[0])))
        self.carried = None
        x = batch.choose(self.model.final_logits(last_positions(h, lens)))[0]  # greedy
        return [Emit([x], [self.d], self.d)]

    def step(self, batch: Batch) -> list[Emit]:
        """One token: main thread to ``d_bar``, fork ``k`` branches for the next token while
        the main thread finishes, keep the branch the final layer confirms (Alg. 2)."""
        model, seq = self.model, batch.seqs[0]
        steps = self._static()
        if steps is not None and seq.remaining > 1 and not seq.wants_logprobs:
            return self._step_static(batch, steps)
        # process mode: layers < m live in the shared rows the worker reads
        main = batch.cache if self.shared is None else self.shared.main_view(batch.cache)
        p = int(main.lengths[0])
        pos = torch.full((1, 1), p, dtype=torch.long, device=self.device)
        ctx = model.context(pos, main)
        if self.carried is None:  # Alg. 2 line 10: from the first layer
            h0 = model.embed(batch.lasts(self.device), pos)
            hm = model.run_layers(h0, 0, self.d_bar, cache=main, ctx=ctx)
            evals = self.d_bar
            if self.shared is not None:
                self.shared.broadcast(0, p)
            for c in self.branches:
                c.copy_from(main, self.m, p)
        else:  # line 12: continue the matching branch from layer d - d_bar
            hm = model.run_layers(self.carried, self.m, self.d_bar, cache=main, ctx=ctx)
            evals = self.d_bar - self.m
        cands: list[int] = []
        fork = seq.remaining > 1
        predicted = fork and self.offload  # the branch side makes the early prediction
        if predicted:
            jobs = self._predict(hm, p + 1)
        else:
            if fork:
                cands = torch.topk(self.head(hm, ctx, main)[0, -1], self.k).indices.tolist()
            elif self.block:
                model.exit_features(hm, self.d_bar, cache=main, ctx=ctx)
            jobs = self._start_branches(cands, p + 1)
        hf = model.run_layers(hm, self.d_bar, self.d, cache=main, ctx=ctx)  # main, in parallel
        x = batch.choose(model.final_logits(hf[:, -1]))[0]  # greedy
        if predicted:
            cands, states = self._finish_predicted(jobs)
        else:
            states = self._finish_branches(jobs)
        evals += self.m + len(cands) * self.m
        self.carried = self._resolve(seq, main, cands, states, x, p + 1)
        main.lengths = torch.tensor([p + 1])
        return [Emit([x], [self.d], evals)]

    def _new_branches(self, capacity: int, dtype: torch.dtype) -> list[KVCache]:
        """``k`` one-row caches of layers ``[0, m)`` for the branches."""
        cfg = self.model.config
        return [KVCache(self.m, 1, capacity, cfg.n_kv_heads, cfg.hdim, dtype=dtype,
                        device=self.device) for _ in range(self.k)]

    def _static(self) -> StaticSteps | None:
        """The model's static programs (CUDA graphs on a GPU), where this decoder can use
        them: branches in this process, an early exit without a block of its own."""
        if self.process or self.block:
            return None
        return static_steps(self.model)

    def _step_static(self, batch: Batch, steps: StaticSteps) -> list[Emit]:
        """:meth:`step` as graph replays from this thread
        (:meth:`~exitlm.backend.cuda_graphs.StaticSteps.ppd_step`): the branches run on
        their CUDA streams while the main token finishes, with no thread hand-off."""
        seq, main = batch.seqs[0], batch.cache
        p = int(main.lengths[0])
        if self.branches[0].max_seq_len < main.max_seq_len:  # the pool grew: so do they
            self.branches = self._new_branches(main.max_seq_len, main.dtype)
            for c in self.branches:
                c.copy_from(main, self.m, slice(0, p + 1))
        evals = self.d_bar if self.carried is None else self.d_bar - self.m
        x, cands, states = steps.ppd_step(seq.last, main, self.branches, self.carried,
                                          self.d_bar, lambda h: self.head(h, None, None),
                                          self.streams)
        evals += self.m + len(cands) * self.m
        self.carried = self._resolve(seq, main, cands, states, x, p + 1)
        main.lengths = torch.tensor([p + 1])
        return [Emit([x], [self.d], evals)]

    # ----- branches ---------------------------------------------------------------------------
    def _resolve(self, seq: Seq, main: KVCache, cands: list[int],
                 states: list[torch.Tensor], x: int, p: int) -> torch.Tensor | None:
        """Count the fork; on a confirmed candidate its entry at ``p`` becomes everyone's
        and its state carries into the next token."""
        if not cands:
            return None
        st: PPDStats = seq.stats  # type: ignore[assignment]
        st.forks += 1
        if x not in cands:
            return None
        st.matches += 1
        j = cands.index(x)
        if self.shared is not None:  # main's layers < m are row 0 of the shared rows
            self.shared.broadcast(j, p)
            return states[j].clone()
        win = self.branches[j]
        for c in (main, *(c for c in self.branches if c is not win)):
            c.copy_from(win, self.m, p)
        return states[j]

    def _predict(self, hm: torch.Tensor, p: int) -> list[Future[Any]]:
        """Start the early prediction from ``hm`` (the state after layer ``d_bar``) and its
        candidates' branches at position ``p`` in the worker process or on a pool thread
        (returns at once): PPD Alg. 2 lines 14-29 off the main thread's path."""
        if self.worker is not None:
            assert self.shared is not None
            self.shared.hin.copy_(hm)
            self.worker.predict(p, self.k)
            return []
        assert self.pool is not None
        return [self.pool.submit(self._predict_here, hm.clone(), p)]

    def _predict_here(self, hm: torch.Tensor, p: int) -> tuple[list[int], list[torch.Tensor]]:
        """A pool thread's early prediction: top-``k`` of the draft head, then the candidates'
        branches on the rest of the pool."""
        with torch.inference_mode():
            cands = torch.topk(self.head(hm, None, None)[0, -1], self.k).indices.tolist()
            return cands, self._finish_branches(self._start_branches(cands, p))

    def _finish_predicted(self, jobs: list[Future[Any]]
                          ) -> tuple[list[int], list[torch.Tensor]]:
        """Wait for :meth:`_predict`'s work: the candidates and their branch states."""
        if self.worker is not None:
            self.worker.join()
            assert self.shared is not None
            return self.worker.tokens, [self.shared.out[j].view(1, 1, -1)
                                        for j in range(self.k)]
        return jobs[0].result()

    def _start_branches(self, cands: list[int], p: int) -> list[Future[torch.Tensor] |
                                                                 torch.Tensor]:
        """Launch one branch per candidate; with no pool they run here, one after another;
        in process mode the worker gets them all in one message."""
        if self.worker is not None:
            if cands:
                self.worker.fork(p, cands)
            return []
        ready = None
        if self.streams is not None and cands:
            ready = torch.cuda.Event()
            ready.record()  # branches wait for the main stream's writes (prefix entries)
        jobs: list[Future[torch.Tensor] | torch.Tensor] = []
        for j, tok in enumerate(cands):
            stream = self.streams[j] if self.streams is not None else None
            args = (self.branches[j], tok, p, stream, ready)
            jobs.append(self._branch(*args) if self.pool is None
                        else self.pool.submit(self._branch, *args))
        return jobs

    def _finish_branches(self, jobs: list[Future[torch.Tensor] | torch.Tensor]
                         ) -> list[torch.Tensor]:
        """Wait for every branch (and its CUDA stream) and return their states."""
        if self.worker is not None:
            self.worker.join()
            assert self.shared is not None
            return [self.shared.out[j].view(1, 1, -1) for j in range(self.k)]
        out = [j.result() if isinstance(j, Future) else j for j in jobs]
        if self.streams is not None:
            cur = torch.cuda.current_stream()
            for st in self.streams[: len(jobs)]:
                cur.wait_stream(st)
        return out

    def _branch(self, cache: KVCache, token: int, p: int, stream: torch.cuda.Stream | None,
                ready: torch.cuda.Event | None) -> torch.Tensor:
        """One PPD sub-process (Alg. 2 line 23): candidate ``token`` at position ``p`` through
        layers ``[0, m)`` on the branch's own cache; returns the hidden state ``(1, 1, D)``."""
        with torch.inference_mode():
            if stream is not None:
                assert ready is not None
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    return self._branch_forward(cache, token, p)
            return self._branch_forward(cache, token, p)

    def _branch_forward(self, cache: KVCache, token: int, p: int) -> torch.Tensor:
        return branch_forward(self.model, cache, token, p, self.m)
