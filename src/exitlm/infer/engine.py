"""The decoding engine: continuous batching of requests over one decoder and a pool of KV rows.

    engine = Engine(model, tokenizer, "self-spec", SelfSpecOptions(exit_layer=8), max_batch=8)
    req = engine.submit("def f(x):", SamplingOptions(max_new_tokens=64))
    while engine.has_work():
        for update in engine.step():
            print(update.request.id, update.text)

Every :meth:`Engine.step` (vLLM's scheduler loop, gpt-fast's ``generate`` loop):

1. drops cancelled requests (freeing their rows);
2. admits waiting requests while rows are free and prefills them in padded batches of
   similar prompt lengths (:func:`prefill_groups`; their first token comes out of the
   prefill);
3. runs one decoder step over every running sequence - each accepts, exits and stops on
   its own - and records the tokens: stop tokens, stop strings and ``max_new_tokens`` end a
   request, which leaves the pool at once (:mod:`exitlm.infer.pool` compacts its rows).

The engine owns everything around the decoder: ``inference_mode``, stop conditions,
streaming (per-request :class:`Update` objects and callbacks), timing and results. Each
request has its own sampling options, random generator, stop conditions and per-request
strategy options (threshold, speculations, ...), so a seeded request gets the same tokens
whatever else shares the batch. :meth:`submit` and :meth:`cancel` may be called from other
threads while one thread steps.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from exitlm.config import ConfigError
from exitlm.infer.decoder import Decoder, Emit, Seq
from exitlm.infer.options import SamplingOptions
from exitlm.infer.pool import SlotPool
from exitlm.infer.result import DecodeStats, FinishReason, SequenceResult, TokenLogprob
from exitlm.infer.sampling import make_generator
from exitlm.infer.score import score_tokens
from exitlm.infer.stopping import TextTracker
from exitlm.infer.strategies import get_strategy
from exitlm.infer.threads import ThreadPolicy
from exitlm.kernels.blas import gemv_bound
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner
from exitlm.tokenizer import Tokenizer

PREFILL_PADDING = 1.25
"""Prompts prefilled together may hold at most this many padded positions per real one."""


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING
                   ) -> list[tuple[int, int]]:
    """Split prompts sorted by length into ranges ``[a, b)`` prefilled as one right-padded
    batch each: a range grows while its padded size (count x longest) stays within
    ``padding`` x its real tokens. Mixed lengths would otherwise pay for the longest prompt in
    every row (e.g. 14, 67, 424 and 17 tokens: 1696 positions for 522 real ones)."""
    groups: list[tuple[int, int]] = []
    a, total = 0, 0
    for i, n in enumerate(lengths):
        if i > a and (i - a + 1) * n > padding * (total + n):
            groups.append((a, i))
            a, total = i, 0
        total += n
    if lengths:
        groups.append((a, len(lengths)))
    return groups


class EngineBroken(RuntimeError):
    """The engine cannot serve any more requests (an engine over several processes whose
    ranks failed, :class:`~exitlm.infer.executors.tp.TPEngine`); the message says why
    and what to do."""


class EngineFull(ConfigError):
    """The waiting queue is full (``max_queue``); try again later."""


Status = Literal["waiting", "running", "finished"]


@dataclass
class Update:
    """What one step did for one request: the tokens it kept, their exit layers, the text that
    became final (``pieces``: text with the exit layer of the token that completed it), and
    whether the request is done."""

    request: Request
    token_ids: list[int]
    exit_layers: list[int]
    pieces: list[tuple[str, int]]
    finished: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)


@dataclass(eq=False)
class Request:
    """A handle to one submitted request (created by :meth:`Engine.submit`)."""

    id: int
    prompt_ids: list[int]
    sampling: SamplingOptions
    options: Any
    seq: Seq
    stop_ids: frozenset[int]
    on_update: Callable[[Update], None] | None = None
    status: Status = "waiting"
    finish_reason: FinishReason | None = None
    exit_layers: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    layer_evaluations: int = 0
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    _pieces: list[tuple[str, int]] = field(default_factory=list)
    _layer: int = 0
    tracker: TextTracker = field(init=False)
    """Generated tokens and text (stop strings, incremental decoding)."""

    @property
    def token_ids(self) -> list[int]:
        return self.tracker.ids

    @property
    def text(self) -> str:
        return self.tracker.text

    @property
    def done(self) -> bool:
        return self.status == "finished"

    @property
    def stats(self) -> DecodeStats:
        return self.seq.stats

    def result(self, num_layers: int) -> SequenceResult:
        """The request's :class:`SequenceResult` (call once it is done)."""
        return SequenceResult(
            token_ids=list(self.tracker.ids), text=self.tracker.finish(),
            exit_layers=list(self.exit_layers), finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids), layer_evaluations=self.layer_evaluations,
            stats=self.seq.stats, num_layers=num_layers,
            logprobs=list(self.logprobs) if self.sampling.logprobs is not None else None,
        )


class Engine:
    """Continuous batching over one decoding strategy (see the module docstring).

    Args:
        model: the model (its device and dtype are used as they are), or the runner that
            computes its forwards (:func:`~exitlm.runtime.prepare`; prepared here for a
            model - pass a runner to share one between engines).
        tokenizer: encodes text prompts, decodes outputs and stop strings (``None``: token
            ids only).
        strategy: a key of :data:`~exitlm.infer.strategies.STRATEGIES`.
        options: the strategy's options dataclass; requests may override its per-request
            fields (:attr:`~exitlm.infer.strategies.Strategy.per_request`).
        max_batch: the most sequences decoded at once (PPD holds one).
        max_seq_len: the longest prompt + ``max_new_tokens`` accepted (default and upper
            bound: the model's context, ``config.max_seq_len``).
        max_queue: the most requests waiting for a row; :meth:`submit` raises
            :class:`EngineFull` beyond it (``None``: unbounded).
        threads: CPU threads per step; ``None`` lets :class:`~exitlm.infer.threads.
            ThreadPolicy` measure what is fastest on this machine right now.
    """

    def __init__(
        self,
        model: EarlyExitLM | Runner,
        tokenizer: Tokenizer | None = None,
        strategy: str = "ar",
        options: Any = None,
        *,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        max_queue: int | None = None,
        threads: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self._own_runner = not isinstance(model, Runner)
        self.runner = model if isinstance(model, Runner) else prepare(model)
        self.model = model = self.runner.model
        self.tokenizer = tokenizer
        self.strategy = get_strategy(strategy)
        self.options = self.strategy.options(options)
        self.decoder: Decoder = self.strategy.decoder(self.runner, self.options)
        self.max_batch = min(max_batch, self.decoder.max_batch or max_batch)
        if self.max_batch > 1 or self.decoder.multi_row:
            # steps multiply several rows: packed copies of fp32 weights for few-row
            # products (twice the weight memory)
            self.runner.enable_row_products()
        context = model.config.max_seq_len
        if max_seq_len is not None and not 1 <= max_seq_len <= context:
            raise ConfigError(f"max_seq_len must lie in [1, {context}] (the model's context), "
                              f"got {max_seq_len}")
        self.max_seq_len = max_seq_len or context
        self.max_queue = max_queue
        self.pool = self._new_pool()
        self.eos_ids = frozenset(model.config.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else ())
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._cancel: set[int] = set()
        self.running: list[Request] = []
        self.prefill_s = 0.0
        self.decode_s = 0.0
        ref = model.embed_tokens.weight
        self._gemv = gemv_bound(ref.dtype, ref.device)
        self.threads = ThreadPolicy(threads)

    # ----- the public interface -----------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingOptions | None = None,
        options: Any = None,
        *,
        chat: bool = False,
        on_update: Callable[[Update], None] | None = None,
        **option_changes: Any,
    ) -> Request:
        """Queue a request; returns its handle. ``options`` (or keyword ``option_changes``)
        may change the strategy's per-request fields only. Raises :class:`ConfigError` for a
        request that cannot be served (empty prompt, prompt + ``max_new_tokens`` beyond
        ``max_seq_len``, options the decoder cannot take) and :class:`EngineFull` when the
        queue is full."""
        req = self._build(self._encode(prompt, chat), sampling or SamplingOptions(),
                          self._request_options(options, option_changes), on_update,
                          next(self._ids))
        self._enqueue(req)
        return req

    def _build(self, ids: list[int], sampling: SamplingOptions, opts: Any,
               on_update: Callable[[Update], None] | None, rid: int) -> Request:
        """A validated request (see :meth:`submit`) with id ``rid``, not yet queued."""
        if not ids:
            raise ConfigError("the prompt is empty: every prompt needs at least one token "
                              "(add a BOS token)")
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        need = len(ids) + sampling.max_new_tokens
        if need > self.max_seq_len:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{need} exceeds the context of {self.max_seq_len} tokens; lower "
                "max_new_tokens or shorten the prompt")
        generator = None if sampling.greedy else make_generator(sampling, self.decoder.device)
        seq = Seq(list(ids), sampling, opts, generator, self.decoder.new_stats())
        self.decoder.check(seq)
        if sampling.stop_strings and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else self.eos_ids)
        req = Request(rid, list(ids), sampling, opts, seq, stop_ids, on_update,
                      t_submit=time.perf_counter())
        req.tracker = TextTracker(self.tokenizer, req.id, stop_strings=sampling.stop_strings,
                                  stream=None if self.tokenizer is None else self._piece_sink(req))
        return req

    def _enqueue(self, req: Request) -> None:
        """Queue ``req`` for a row (:class:`EngineFull` beyond ``max_queue``)."""
        with self._lock:
            self._check_room()
            self._waiting.append(req)

    def _check_room(self) -> None:
        """Raise :class:`EngineFull` when ``max_queue`` requests wait (under the lock)."""
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise EngineFull(f"the queue is full ({self.max_queue} requests waiting)")

    def cancel(self, request: Request) -> None:
        """Stop ``request`` at the next step boundary (its row is freed, finish reason
        ``cancelled``). Safe from any thread; a finished request is left alone."""
        with self._lock:
            self._cancel.add(request.id)

    def score(self, ids: list[int], top: int = 0) -> list[TokenLogprob | None]:
        """Log-probabilities of ``ids`` under the final layer (the server's ``echo`` with
        ``logprobs``); call it between steps, on the thread that steps."""

        return score_tokens(self.runner, ids, top=top)

    @property
    def broken(self) -> str | None:
        """Why the engine cannot serve any more (``None``: it can); see :class:`EngineBroken`."""
        return None

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[Update]:
        """Admit, prefill, decode one step, record (see the module docstring)."""
        updates: list[Update] = []
        with torch.inference_mode():
            self._reap_cancelled(updates)
            self._admit(updates)
            if self.running:
                self._decode(updates)
        for u in updates:
            if u.request.on_update is not None:
                u.request.on_update(u)
        return updates

    def run(self) -> None:
        """Step until no request is waiting or running."""
        while self.has_work():
            self.step()

    def abort_running(self) -> list[Request]:
        """Recover after :meth:`step` raised: end every running request (finish reason
        ``error``; no update is sent) and start the pool afresh, since a failed step may have
        left its rows half-written. Waiting requests stay queued. Returns the ended requests,
        so that their owners can be told."""
        failed, self.running = self.running, []
        now = time.perf_counter()
        for r in failed:
            r.status, r.finish_reason, r.t_end = "finished", "error", now
        self.pool.drop()
        self.pool = self._new_pool()
        return failed

    def close(self) -> None:
        self.decoder.close()
        self.pool.drop()
        if self._own_runner:
            self.runner.close()

    def _new_pool(self) -> SlotPool:
        return SlotPool(self.runner, self.decoder.aux_dims, self.max_batch,
                        self.max_seq_len + self.decoder.max_lookahead)

    # ----- scheduling ---------------------------------------------------------------------------
    def _reap_cancelled(self, updates: list[Update]) -> None:
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            gone = [r for r in self._waiting if r.id in cancel]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            updates.append(self._finish(r, "cancelled"))
        rows = [i for i, r in enumerate(self.running) if r.id in cancel]
        for i in rows:
            updates.append(self._finish(self.running[i], "cancelled"))
        self._release(rows)

    def _admit(self, updates: list[Update]) -> None:
        with self._lock:
            new: list[Request] = []
            while self._waiting and len(self.running) + len(new) < self.max_batch:
                new.append(self._waiting.popleft())
        empty = [r for r in new if r.sampling.max_new_tokens == 0]
        for r in empty:
            updates.append(self._finish(r, "length"))
        new = sorted((r for r in new if r.sampling.max_new_tokens > 0),
                     key=lambda r: len(r.prompt_ids))
        if not new:
            return
        t0 = time.perf_counter()
        lo = len(self.running)
        for r in new:  # running before anything can fail (abort_running finds them)
            r.status, r.t_admit = "running", t0
        self.running.extend(new)
        look = max(self.decoder.lookahead(r.seq) for r in self.running)
        self.pool.ensure(lo + len(new), len(new[-1].prompt_ids) + look)
        emits: list[Emit] = []
        for a, b in prefill_groups([len(r.prompt_ids) for r in new]):
            with self.threads.split("torch"):
                emits += self.decoder.prefill(self.pool.batch(lo + a, lo + b,
                                                              [r.seq for r in new[a:b]]))
            t1 = time.perf_counter()
            for r in new[a:b]:
                r.t_first = t1
        self.prefill_s += time.perf_counter() - t0
        self._record(lo, new, emits, updates)

    def _decode(self, updates: list[Update]) -> None:
        t0 = time.perf_counter()
        n = len(self.running)
        cache = self.pool.cache
        assert cache is not None
        longest = int(cache.lengths[:n].max())
        self.pool.ensure(n, longest + max(self.decoder.lookahead(r.seq) for r in self.running))
        # one sequence: its one-row products are numpy GEMVs (threads to OpenBLAS); several:
        # few-row products through oneDNN (threads to torch) - measured best for each
        kind = "gemv" if self._gemv and n == 1 else "torch"
        with self.threads.step(kind, key=(kind, n)) as rec:
            emits = self.decoder.step(self.pool.batch(0, n, [r.seq for r in self.running]))
            rec.tokens = sum(len(e.tokens) for e in emits)
        self._record(0, list(self.running), emits, updates)
        self.decode_s += time.perf_counter() - t0

    def _record(self, lo: int, reqs: list[Request], emits: list[Emit],
                updates: list[Update]) -> None:
        """Feed each request its tokens until it stops; release the rows of finished ones."""
        done: list[int] = []
        for k, (r, em) in enumerate(zip(reqs, emits, strict=True)):
            kept, why = self._push(r, em)
            lps, r.seq.logprobs = r.seq.logprobs[:kept], []
            r.logprobs.extend(lps)
            r.layer_evaluations += em.evals
            r.seq.generated += kept
            r.seq.last = em.tokens[kept - 1] if kept else r.seq.last
            if why is not None:
                done.append(lo + k)
                updates.append(self._finish(r, why, em.tokens[:kept], em.layers[:kept], lps))
            else:
                updates.append(self._update(r, em.tokens, em.layers, False, lps))
        self._release(done)

    def _push(self, r: Request, em: Emit) -> tuple[int, FinishReason | None]:
        """Append ``em``'s tokens to ``r`` until a stop condition; how many were kept and
        why the request ended (``None``: it goes on)."""
        for n, (tok, layer) in enumerate(zip(em.tokens, em.layers, strict=True), start=1):
            r.exit_layers.append(layer)
            r._layer = layer
            if r.tracker.push(tok):
                return n, "stop_string"
            if tok in r.stop_ids:
                return n, "stop_token"
            if len(r.tracker.ids) >= r.sampling.max_new_tokens:
                return n, "length"
        return len(em.tokens), None

    def _release(self, rows: list[int]) -> None:
        """Remove the requests in ``rows``; the last running rows move into the gaps."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self.running)) if i not in gone]
        n = len(keep)
        holes = sorted(i for i in gone if i < n)
        movers = [i for i in keep if i >= n]
        order = list(self.running)
        for dst, src in zip(holes, movers, strict=True):
            self.pool.move_row(src, dst)
            order[dst] = self.running[src]
        for i in range(n, len(self.running)):
            self.pool.clear_row(i)
        self.running = order[:n]

    # ----- requests -------------------------------------------------------------------------------
    def _finish(self, r: Request, why: FinishReason, tokens: list[int] | None = None,
                layers: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None) -> Update:
        r.status, r.finish_reason, r.t_end = "finished", why, time.perf_counter()
        if r.t_first == 0.0:
            r.t_first = r.t_end
        r.tracker.finish()  # streams the held-back tail
        return self._update(r, tokens or [], layers or [], True, logprobs)

    def _update(self, r: Request, tokens: list[int], layers: list[int], finished: bool,
                logprobs: list[TokenLogprob] | None = None) -> Update:
        pieces, r._pieces = r._pieces, []
        return Update(r, list(tokens), list(layers), pieces, finished, list(logprobs or []))

    def _piece_sink(self, r: Request) -> Callable[[int, str], None]:
        def sink(_index: int, piece: str) -> None:
            r._pieces.append((piece, r._layer))
        return sink

    def _encode(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("text prompts need a tokenizer; pass token ids instead")
            text = (self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                    if chat else prompt)
            return self.tokenizer.encode(text)
        if chat:
            raise ConfigError("chat=True needs a text prompt, got token ids")
        return [int(x) for x in prompt]

    def _request_options(self, options: Any, changes: dict[str, Any]) -> Any:
        """The engine's options with a request's per-request fields applied; any other field
        that differs is an error (it would need another decoder)."""
        import dataclasses

        opts = self.strategy.options(options if options is not None else self.options,
                                     **changes)
        fixed = [f.name for f in dataclasses.fields(opts) if f.name not in
                 self.strategy.per_request
                 and getattr(opts, f.name) != getattr(self.options, f.name)]
        if fixed:
            raise ConfigError(
                f"{self.strategy.name} options {fixed} are fixed when the engine starts; a "
                f"request may set only {sorted(self.strategy.per_request) or 'none'}")
        return opts
