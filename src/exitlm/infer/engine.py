"""The decoding engine: continuous batching of requests over one decoder and a pool of KV rows.

    engine = Engine(model, tokenizer, "self-spec", SelfSpecOptions(exit_layer=8), max_batch=8)
    req = engine.submit("def f(x):", SamplingOptions(max_new_tokens=64))
    while engine.has_work():
        for update in engine.step():
            print(update.request.id, update.text)

Every :meth:`Engine.step` (vLLM's scheduler loop, gpt-fast's ``generate`` loop):

1. drops cancelled requests (freeing their rows);
2. admits waiting requests while rows are free and prefills them in padded batches of
   similar prompt lengths (:func:`~exitlm.infer.prefill_plan.prefill_groups`; their first
   token comes out of the
   prefill). With ``prefill_chunk``, a step prefills about that many prompt positions at
   most, between the decoding steps of the others (vLLM's chunked prefill, Sarathi-Serve's
   "stall-free" batching): shorter prompts whole, first come first served, while they fit
   (the first always), and a longer prompt in parts - the rest of the step's budget, at least
   a quarter of it - so that neither a long prompt nor a crowd of short ones holds every
   running stream for its whole prefill. One long prompt fills at a time (its row the last
   one); other long ones wait at the queue's front. A prompt that several requests share
   (``n`` choices) is prefilled once, and a prompt's start that a running sequence's prompt
   shares is copied from its row (:mod:`~exitlm.infer.prefill_plan`); each request prefills
   at least its last position itself;
3. runs one decoder step over every running sequence - each accepts, exits and stops on
   its own - and records the tokens: stop tokens, stop strings and ``max_new_tokens`` end a
   request, which leaves the pool at once (:mod:`exitlm.infer.pool` compacts its rows).

The engine owns everything around the decoder: ``inference_mode``, stop conditions,
streaming (per-request :class:`Update` objects and callbacks), timing and results. Where the
decoder runs - this process, tensor-parallel ranks that replay every step, pipeline stages, a
PPD branch worker - is its :class:`~exitlm.infer.executor.Executor`'s business
(:func:`~exitlm.infer.executors.executor_for`); submissions and cancellations take effect at
the start of the next step, in order, so that an executor can hand them to every process
first. Each
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
from typing import Any

import torch

from exitlm.comm.health import ParallelError
from exitlm.config import ConfigError
from exitlm.infer.decoder import Decoder, Emit, Seq
from exitlm.infer.executor import Cancel, EngineSpec, Event, Executor, Submit
from exitlm.infer.executors import executor_for
from exitlm.infer.options import SamplingOptions
from exitlm.infer.pool import SlotPool
from exitlm.infer.prefill_plan import Held, PrefillPart, held_start, plan_prefill
from exitlm.infer.request import Request, Update
from exitlm.infer.result import FinishReason, TokenLogprob
from exitlm.infer.sampling import make_generator
from exitlm.infer.score import score_tokens
from exitlm.infer.stopping import TextTracker
from exitlm.infer.strategies import get_strategy
from exitlm.infer.threads import ThreadPolicy
from exitlm.kernels.blas import gemv_bound
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.runner import Runner
from exitlm.tokenizer import Tokenizer


class EngineBroken(RuntimeError):
    """The engine cannot serve any more requests (an engine over several processes whose
    ranks failed: :attr:`~exitlm.infer.executor.Executor.fatal_failures`); the message says
    why and what to do."""


class EngineFull(ConfigError):
    """The waiting queue is full (``max_queue``); try again later."""


class Engine:
    """Continuous batching over one decoding strategy (see the module docstring).

    Args:
        model: the model (its device and dtype are used as they are), the runner that
            computes its forwards (:func:`~exitlm.runtime.prepare`; prepared here for a
            model - pass a runner to share one between engines), or the executor the engine
            runs on (:mod:`exitlm.infer.executors`; chosen here for the strategy's options
            otherwise). What the engine makes itself it closes with :meth:`close`.
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
        prefill_chunk: the prompt positions one step prefills, about (see the module
            docstring): longer prompts go in parts; ``None``: every admitted prompt whole, in
            the step that admits it. Ignored by decoders that cannot
            (:attr:`Decoder.fills_in_parts`).
        share_prompts: prefill a prompt once for the requests that share it, and copy a
            prompt's start from a running sequence's row that holds it
            (:mod:`~exitlm.infer.prefill_plan`; decoders that fill in parts); ``False``:
            every prompt prefilled whole by its own request.
    """

    def __init__(
        self,
        model: EarlyExitLM | Runner | Executor,
        tokenizer: Tokenizer | None = None,
        strategy: str = "ar",
        options: Any = None,
        *,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        max_queue: int | None = None,
        threads: int | None = None,
        prefill_chunk: int | None = None,
        share_prompts: bool = True,
    ) -> None:
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1 (positions per part), got "
                              f"{prefill_chunk}")
        self.tokenizer = tokenizer
        self.strategy = get_strategy(strategy)
        self.options = self.strategy.options(options)
        self._own_executor = not isinstance(model, Executor)
        self.executor = executor_for(model, self.strategy, self.options)
        try:
            self.executor.start(EngineSpec(self.strategy.name, self.options, tokenizer,
                                           max_batch, max_seq_len, threads, prefill_chunk,
                                           share_prompts))
        except BaseException:
            if self._own_executor:
                self.executor.close()
            raise
        self.runner = self.executor.runner
        self.model = model = self.runner.model
        self.decoder: Decoder = self.executor.decoder(self.strategy, self.options)
        self.max_batch = min(max_batch, self.decoder.max_batch or max_batch)
        if self.max_batch > 1 or self.decoder.multi_row:
            # steps multiply several rows: packed copies of fp32 weights for few-row
            # products (twice the weight memory) where the runner's products need them
            self.runner.enable_row_products(self.max_batch)
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
        self._events: list[Event] = []  # submissions and cancellations for the next step
        self._broken: str | None = None
        self.running: list[Request] = []
        """The requests holding pool rows, in row order: the decoding ones, then the one
        whose prompt is being prefilled in parts (:attr:`filling`), if any."""
        self.prefill_chunk = prefill_chunk if self.decoder.fills_in_parts else None
        self.share_prompts = share_prompts and self.decoder.fills_in_parts
        self.filling: Request | None = None
        """The request whose long prompt is prefilled in parts (the last of ``running``)."""
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.startup_s = 0.0
        """Seconds the decoder spent starting helpers during prefills (PPD's branch worker
        process), not counted in ``prefill_s``."""
        ref = model.embed_tokens.weight
        # one sequence's products on the backend's threads: numpy's OpenBLAS (fp32) or the
        # native runner's kernels (every dtype it decodes; fp16 got one thread before)
        self._gemv = gemv_bound(ref.dtype, ref.device) or self.runner.kind == "native"
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
        if self._broken is not None:
            raise EngineBroken(self._broken)
        sampling = self.executor.admit(sampling or SamplingOptions())
        req = self.build_request(self._encode(prompt, chat), sampling,
                                 self.request_options(options, option_changes), on_update,
                                 next(self._ids))
        self.enqueue(req)
        return req

    def build_request(self, ids: list[int], sampling: SamplingOptions, opts: Any,
                      on_update: Callable[[Update], None] | None, rid: int) -> Request:
        """A validated request (see :meth:`submit`) with id ``rid``, not yet queued (an
        executor's processes replay rank 0's submissions with its ids)."""
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

    def enqueue(self, req: Request) -> None:
        """Queue ``req`` for a row from the next step on (:class:`EngineFull` beyond
        ``max_queue``)."""
        with self._lock:
            self._check_room()
            self._events.append(Submit(req))

    def _check_room(self) -> None:
        """Raise :class:`EngineFull` when ``max_queue`` requests wait (under the lock)."""
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise EngineFull(f"the queue is full ({self.max_queue} requests waiting)")

    def cancel(self, request: Request | int) -> None:
        """Stop ``request`` (or the request of that id) at the next step boundary (its row is
        freed, finish reason ``cancelled``). Safe from any thread; a finished request is left
        alone."""
        rid = request if isinstance(request, int) else request.id
        with self._lock:
            self._events.append(Cancel(rid))

    def score(self, ids: list[int], top: int = 0) -> list[TokenLogprob | None]:
        """Log-probabilities of ``ids`` under the final layer (the server's ``echo`` with
        ``logprobs``); call it between steps, on the thread that steps."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        self.executor.before_score(list(ids), top)
        return score_tokens(self.runner, ids, top=top)

    @property
    def broken(self) -> str | None:
        """Why the engine cannot serve any more (``None``: it can); see :class:`EngineBroken`."""
        return self._broken

    def has_work(self) -> bool:
        if self._broken is not None:
            return False
        with self._lock:
            return bool(self._waiting or self.running or self._events)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a row (those submitted since the last step included)."""
        return len(self._waiting) + sum(isinstance(e, Submit) for e in self._events)

    def step(self) -> list[Update]:
        """Apply the submissions and cancellations since the last step (after the executor
        saw them), admit, prefill, decode one step, record (see the module docstring)."""
        if self._broken is not None:
            raise EngineBroken(self._broken)
        with self._lock:
            events, self._events = self._events, []
            self._waiting.extend(e.request for e in events if isinstance(e, Submit))
            self._cancel |= {e.request_id for e in events if isinstance(e, Cancel)}
        updates: list[Update] = []
        try:
            self.executor.before_step(events)
            with torch.inference_mode():
                self._reap_cancelled(updates)
                self._admit(updates)
                if self._decoding:
                    self._decode(updates)
        except Exception as err:
            why = self.executor.failure()  # another process's exit explains any error
            if why:
                raise ParallelError(f"{self.executor.name} {why}") from err
            raise
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
        failed, self.running, self.filling = self.running, [], None
        if self.executor.fatal_failures:  # the processes may disagree now: serve no more
            why = self.executor.failure()
            self._broken = (f"the {self.executor.name} processes failed during a step; "
                            "restart the server or the run (see the log)"
                            + (f": {why}" if why else ""))
            with self._lock:
                failed += list(self._waiting)
                failed += [e.request for e in self._events if isinstance(e, Submit)]
                self._waiting.clear()
                self._events.clear()
            self.executor.close(EngineBroken(self._broken))  # its processes are of no use
        now = time.perf_counter()
        for r in failed:
            r.status, r.finish_reason, r.t_end = "finished", "error", now
        self.pool.drop()
        self.pool = self._new_pool()
        return failed

    def close(self) -> None:
        """Release the decoder, the pool, and the executor when the engine made it."""
        try:
            self.decoder.close()
            self.pool.drop()
        finally:
            if self._own_executor:
                self.executor.close(EngineBroken(self._broken) if self._broken else None)

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

    @property
    def _decoding(self) -> int:
        """How many of ``running`` (the first ones) decode: all but :attr:`filling`."""
        return len(self.running) - (self.filling is not None)

    def _admit(self, updates: list[Update]) -> None:
        if not self._waiting:  # most steps: nothing to admit, at most a prompt filling
            if self.filling is not None:
                assert self.prefill_chunk is not None
                self._fill(updates, self.prefill_chunk)
            return
        held = self._held_prompts()
        with self._lock:
            new, long, used = self._take(held)
        empty = [r for r in new if r.sampling.max_new_tokens == 0]
        for r in empty:
            updates.append(self._finish(r, "length"))
        new = [r for r in new if r.sampling.max_new_tokens > 0]
        order, parts = plan_prefill([r.prompt_ids for r in new], held,
                                    share=self.share_prompts)
        new = [new[i] for i in order]
        if new or long is not None:
            t0 = time.perf_counter()
            started = self.decoder.startup_s
            lo = self._decoding
            joining = [*new, *([long] if long is not None else [])]
            for r in joining:  # running before anything can fail (abort_running finds them)
                r.status, r.t_admit = "running", t0
            look = max(self.decoder.lookahead(r.seq) for r in (*self.running, *joining))
            self.pool.ensure(len(self.running) + len(joining),
                             max(len(r.prompt_ids) for r in joining) + look)
            if self.filling is not None and new:  # its row goes after the new ones
                self.pool.move_row(lo, lo + len(new))
            self.running[lo:lo] = new
            if long is not None:  # the last row: it fills in parts, from this step on
                self.running.append(long)
                self.filling = long
                start = held_start(long.prompt_ids, held)
                if start is not None:  # its start is a running row's: the parts follow it
                    row = len(self.running) - 1
                    self.pool.copy_prefix(start[0], row, row + 1, start[1])
                    long.prompt_copied = start[1]
            self._prefill_new(lo, new, parts, t0, started, updates)
        if self.filling is not None:
            assert self.prefill_chunk is not None
            self._fill(updates, max(self.prefill_chunk - used, self.prefill_chunk // 4, 1))

    def _held_prompts(self) -> Held:
        """The decoding rows and their prompts (each in the cache whole), whose starts new
        prompts may copy (decoders that continue a prompt held in part,
        :attr:`Decoder.fills_in_parts`)."""
        if not self._waiting or not self.share_prompts:
            return []
        return [(row, r.prompt_ids) for row, r in enumerate(self.running[:self._decoding])
                if len(r.prompt_ids) > 1]

    def _take(self, held: Held) -> tuple[list[Request], Request | None, int]:
        """The waiting requests this step admits, in queue order, while rows are free: without
        ``prefill_chunk``, all; with it, the prompts of at most ``prefill_chunk`` positions to
        prefill while their sum stays within it (the first always), and the first longer one
        when no prompt is filling (it fills in parts); later long ones keep their places at
        the queue's front (one long prompt fills at a time). A prompt costs about the
        positions that :func:`~exitlm.infer.prefill_plan.plan_prefill` leaves it: those after
        the longest start it shares with a running sequence's prompt (``held``) or one taken
        before it. Returns them and the positions they cost."""
        budget, used = self.prefill_chunk, 0
        taken: list[tuple[int, Sequence[int]]] = []  # the prompts taken, as held_start reads
        new: list[Request] = []
        long: Request | None = None
        kept: list[Request] = []
        while self._waiting and (len(self.running) + len(new) + (long is not None)
                                 < self.max_batch):
            r = self._waiting[0]
            n = len(r.prompt_ids) if r.sampling.max_new_tokens > 0 else 0
            if budget is not None and n > 1 and (held or taken):  # (a budget bounds taken)
                start = held_start(r.prompt_ids, [*held, *taken])
                n -= 0 if start is None else start[1]
            if budget is not None and n > budget:
                if self.filling is None and long is None:
                    long = self._waiting.popleft()
                else:
                    kept.append(self._waiting.popleft())
                continue
            if budget is not None and used and used + n > budget:
                break
            new.append(self._waiting.popleft())
            used += n
            if budget is not None and self.share_prompts and n > 0:
                taken.append((-1, r.prompt_ids))
        self._waiting.extendleft(reversed(kept))
        return new, long, used

    def _prefill_new(self, lo: int, new: list[Request], parts: list[PrefillPart],
                     t0: float, started: float, updates: list[Update]) -> None:
        """Prefill ``new`` (rows ``lo ..``, in the order of ``parts``, which
        :func:`~exitlm.infer.prefill_plan.plan_prefill` made): each part's rows first hold
        their prompts' first ``start`` positions - copied from a running row, or filled into
        the part's first row (:meth:`Decoder.fill`) and copied to the others - then prefill
        the rest, the last position giving each row its first token with its own sampling."""
        if not new:
            return
        emits: list[Emit] = []
        for part in parts:
            source = part.source if part.copy_of is None else lo + part.copy_of
            emits += self._prefill_rows(lo + part.a, new[part.a:part.b], part.start, source)
        startup = self.decoder.startup_s - started
        self.startup_s += startup
        self.prefill_s += time.perf_counter() - t0 - startup
        self._record(lo, new, emits, updates)

    def _fill(self, updates: list[Update], part: int) -> None:
        """The next part of :attr:`filling`'s prompt: up to ``part`` positions into its row;
        the last part is the decoder's prefill, whose token starts its decoding."""
        r = self.filling
        assert r is not None
        row = len(self.running) - 1
        batch = self.pool.batch(row, row + 1, [r.seq])
        stop = int(batch.cache.lengths[0]) + part  # after the positions its row holds
        t0 = time.perf_counter()
        started = self.decoder.startup_s
        if stop < len(r.prompt_ids):
            with self.threads.split("torch"):
                self.decoder.fill(batch, stop)
            self.prefill_s += time.perf_counter() - t0
            return
        self.filling = None  # a decoding row from here on, whatever the prefill does
        copies = self._waiting_copies(r)
        if copies:  # rows after it, which start from its row (_prefill_rows)
            for q in copies:
                q.status, q.t_admit = "running", t0
            look = max(self.decoder.lookahead(q.seq) for q in (*self.running, *copies))
            self.pool.ensure(len(self.running) + len(copies), len(r.prompt_ids) + look)
            self.running += copies
        reqs = [r, *copies]
        emits = self._prefill_rows(row, reqs, len(r.prompt_ids) - 1 if copies else 0)
        startup = self.decoder.startup_s - started
        self.startup_s += startup
        self.prefill_s += r.t_first - t0 - startup
        self._record(row, reqs, emits, updates)

    def _prefill_rows(self, a: int, reqs: list[Request], start: int = 0,
                      source: int | None = None) -> list[Emit]:
        """Prefill rows ``[a, a + len(reqs))``, which hold ``reqs``, as one batch: each first
        holds its prompt's first ``start`` positions - copied from row ``source``, or (``None``)
        filled into row ``a`` past what it holds (:meth:`Decoder.fill`) and copied to the
        others - then prefills the rest, the last position giving each row its first token
        with its own sampling."""
        b = a + len(reqs)
        seqs = [q.seq for q in reqs]
        with self.threads.split("torch"):
            if start:
                first = a
                if source is None:  # rows of one start: the first one fills it
                    source, first = a, a + 1
                    one = self.pool.batch(a, a + 1, seqs[:1])
                    if int(one.cache.lengths[0]) < start:
                        self.decoder.fill(one, start)
                if first < b:
                    self.pool.copy_prefix(source, first, b, start)
                for q in reqs[first - a:]:
                    q.prompt_copied = start
            emits = self.decoder.prefill(self.pool.batch(a, b, seqs))
        t1 = time.perf_counter()
        for q in reqs:
            q.t_first = t1
        return emits

    def _waiting_copies(self, r: Request) -> list[Request]:
        """The waiting requests with ``r``'s prompt (of two tokens or more), while rows are
        free, taken out of the queue: a long prompt's other choices, which waited while it
        filled in parts, start from its row when its last part is prefilled."""
        if len(r.prompt_ids) < 2 or not self.share_prompts:
            return []
        with self._lock:
            room = self.max_batch - len(self.running)
            copies = [q for q in self._waiting if q.prompt_ids == r.prompt_ids
                      and q.sampling.max_new_tokens > 0][:max(room, 0)]
            for q in copies:
                self._waiting.remove(q)
        return copies

    def _decode(self, updates: list[Update]) -> None:
        t0 = time.perf_counter()
        n = self._decoding
        cache = self.pool.cache
        assert cache is not None
        longest = int(cache.lengths[:n].max())
        self.pool.ensure(n, longest + max(self.decoder.lookahead(r.seq)
                                          for r in self.running[:n]))
        # one sequence: its one-row products run on the backend's threads (OpenBLAS' GEMVs or
        # the native kernels); several: few-row products through oneDNN (threads to torch) -
        # measured best for each
        kind = "gemv" if self._gemv and n == 1 else "torch"
        with self.threads.step(kind, key=(kind, n)) as rec:
            emits = self.decoder.step(self.pool.batch(0, n, [r.seq for r in self.running[:n]]))
            rec.tokens = sum(len(e.tokens) for e in emits)
        self._record(0, self.running[:n], emits, updates)
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
        """Remove the requests in ``rows``; the last decoding rows move into the gaps, and
        :attr:`filling`'s row, which stays last, after them."""
        if not rows:
            return
        gone = set(rows)
        last = len(self.running) - 1
        if self.filling is not None and last in gone:  # cancelled while it filled
            self.filling = None
        filling = self.filling
        decoding = self._decoding
        keep = [i for i in range(decoding) if i not in gone]
        n = len(keep)
        holes = sorted(i for i in gone if i < n)
        movers = [i for i in keep if i >= n]
        order = list(self.running)
        for dst, src in zip(holes, movers, strict=True):
            self.pool.move_row(src, dst)
            order[dst] = self.running[src]
        order = order[:n]
        if filling is not None:
            if last != n:
                self.pool.move_row(last, n)
            order.append(filling)
        for i in range(len(order), len(self.running)):
            self.pool.clear_row(i)
        self.running = order

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

    def request_options(self, options: Any, changes: dict[str, Any]) -> Any:
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
