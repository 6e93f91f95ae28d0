"""The runtime's contract: a :class:`Runner` computes a model's forward pieces, named by what
they compute, and knows no decoding strategy.

vLLM v1 splits the model runner (how a forward runs: inputs, CUDA graphs) from the proposers
and samplers that call it; gpt-fast's ``speculative_decode`` reuses the one compiled
``decode_one_token``. Here every strategy of :mod:`exitlm.infer` is written once, on these
primitives, and every backend implements the primitives, never a strategy's round:

* :meth:`Runner.embed` - token (+ learned position) embeddings;
* :meth:`Runner.layers` - layers ``[a, b)`` over a KV cache at given positions;
* :meth:`Runner.logits` - an exit's head (full or truncated vocabulary);
* :meth:`Runner.greedy` - the argmax of an exit's logits, for callers that need nothing else
  (greedy plain decoding; :class:`~exitlm.kernels.screen.GreedyScreen` on the native runner);
* :meth:`Runner.prefill` - right-padded prompts through layers ``[0, end)``, filling the cache;
* :meth:`Runner.chain` - a *chain* of ``n`` greedy steps through layers ``[0, depth)`` and exit
  ``depth``: what a plain decoding step (``n = 0``), self-speculative drafting (LayerSkip Sec.
  4.3.1) and a PPD branch (PPD Alg. 2 line 23) all are;
* :meth:`Runner.probe` - an exit's logits and whether its confidence (maximum probability)
  reaches a threshold (EE-LLM Sec. 5.2);
* :meth:`Runner.segments` - one token's forward as segments between exits, with the pending
  positions whose keys/values an earlier exit skipped (EE-LLM Sec. 4 / App. D.3 KV
  recomputation), stopping at the first confident exit;
* :meth:`Runner.write_kv` - a layer's key/value half only (CALM state copying).

This module's :class:`Runner` is the eager reference: plain torch through the model's own
modules, optionally with faster products (``products``, :mod:`exitlm.runtime.products`).
:class:`~exitlm.runtime.native.NativeRunner` hands chains, layers and segments of one CPU
sequence to ``block.c``; :class:`~exitlm.runtime.graphs.GraphRunner` captures primitives as
CUDA graphs. A faster runner overrides a primitive and falls back to this one for what it does
not take (a batch, sampling, a head of its own), so a decoder never asks which runner it has;
the one question it may ask is :meth:`Runner.supports`.

Cache convention (:mod:`exitlm.model.kv_cache`): the token at position ``p`` lives in slot
``p``. Primitives write keys/values and ``fill``; ``lengths`` is the decoder's to advance.
A runner never changes the model it was given (several engines may share one model).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exitlm.kernels.argmax import argmax
from exitlm.kernels.versions import version_of
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.runtime.products import Products

Pick = Callable[[int, torch.Tensor], tuple[torch.Tensor, int]]
"""``pick(j, logits) -> (tokens, n)``: the tokens ``(B,)`` of step ``j`` of a chain from the
exit's logits ``(B, N)`` (default: the argmax), and the chain's length from now on (``j < n``;
a pick may end a chain early)."""

LAZY_HEAD_BYTES = 4 << 20
"""On CPU, fp32 output embeddings of at least this size cost about as much per position in one
product over several positions as in one product each (the rows stream from memory once per
row either way), so a caller that may stop early multiplies one position at a time (see
:meth:`Runner.supports`, ``batched_head``; ~50 us of Python per call against a 4 MiB read,
~0.1 ms at ~40 GB/s)."""

FEATURES = ("streams", "batched_head", "local", "argmax")
"""What :meth:`Runner.supports` answers: ``streams`` - primitives called on other CUDA streams run
concurrently with the current one; ``argmax`` - :meth:`Runner.greedy` finds an exit's argmax for
less than its logits cost (so a greedy step should ask for it, not for the logits);
``batched_head`` - a head product over several positions costs less than one product per
position; ``local`` - the primitives run in this process alone (no collective pairs them with
another rank's calls), so a caller may run them on scratch state and let their timings steer its
choices (:mod:`exitlm.runtime.costs`)."""


@dataclass
class Chain:
    """What :meth:`Runner.chain` computed: the ``n`` tokens it chose ``(B, n)``, the hidden
    state after layer ``depth`` of every step ``(B, n + 1, D)`` (LayerSkip's exit-query cache),
    and, when asked for, exit ``depth``'s logits of the last step ``(B, V)``."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass
class Segments:
    """What :meth:`Runner.segments` computed for every row: the layer its token left at
    (``L`` when no exit was confident), the logits of that exit ``(B, V)``, the layer
    evaluations spent (token x layer, pending positions included) and the part of them that
    recomputed pending positions."""

    exit_at: list[int]
    logits: torch.Tensor
    evals: list[int]
    recomputed: list[int]


@dataclass
class _SlicedHead:
    """A copy of a draft vocabulary's rows of an output embedding, valid while the weight
    and the model's token order are unchanged."""

    weight: Any
    source: tuple[int, ...]


class Runner:
    """The eager runner: every primitive in plain torch through the model's own modules
    (see the module docstring). ``products`` chooses the kernels of the linear layers
    (:class:`~exitlm.runtime.products.Products`; ``None``: each layer's forward)."""

    kind = "eager"

    def __init__(self, model: EarlyExitLM, products: Products | None = None) -> None:
        self.model = model
        self.config = model.config
        self.num_layers = model.num_layers
        ref = model.embed_tokens.weight
        self.device: torch.device = ref.device
        self.dtype: torch.dtype = ref.dtype
        self.products = products
        self._sliced: dict[tuple[int, int], _SlicedHead] = {}

    # ----- what a decoder may ask --------------------------------------------------------------
    def supports(self, feature: str) -> bool:
        """Whether this runner has ``feature`` (one of :data:`FEATURES`)."""
        if feature not in FEATURES:
            raise ValueError(f"unknown runner feature {feature!r}; known: {FEATURES}")
        if feature == "streams":
            return self.device.type == "cuda"
        if feature == "local":
            return self.model.output_layout is None
        if feature == "argmax":
            return False
        weight = self.model.output_embedding()
        nbytes = (weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor)
                  else weight.nbytes())
        return not (self.device.type == "cpu" and self.dtype == torch.float32
                    and nbytes >= LAZY_HEAD_BYTES)

    def enable_row_products(self, sequences: int = 1) -> None:
        """Prepare for products of several rows: several positions of a sequence
        (verification, recomputation) for up to ``sequences`` sequences at once (batches):
        packed fp32 weight copies on CPU (twice the weight memory); nothing elsewhere."""
        if self.products is not None:
            self.products.enable_rows()

    def new_cache(self, rows: int, length: int) -> KVCache:
        """A KV cache of ``rows`` rows and ``length`` positions for this model."""
        return self.model.new_cache(rows, length)

    def release(self, cache: KVCache) -> None:
        """Forget what this runner keeps for ``cache`` (it is about to be reallocated or
        dropped); the eager runner keeps nothing."""

    def close(self) -> None:
        """Release what the runner holds beyond the model (captured graphs)."""

    # ----- the context of a forward -------------------------------------------------------------
    def context(self, positions: torch.Tensor, cache: KVCache | None) -> StepContext:
        """Rotary angles, cache write plan, mask and this runner's products for a forward at
        ``positions`` ``(B, T)``."""
        return self.model.context(positions, cache, self.products)

    # ----- primitives ---------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings ``(B, T, D)`` of ``tokens`` ``(B, T)``."""
        return self.model.embed(tokens, positions)

    def layers(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor | None,
               cache: KVCache | None, ctx: StepContext | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` (0-based) on ``h`` ``(B, T, D)`` at ``positions``: with a
        cache, keys/values are written there and attention reads every slot up to each
        query's position; without one, attention is causal over ``h``."""
        if ctx is None:
            if positions is None:
                positions = _default_positions(h)
            ctx = self.context(positions, cache)
        return self.model.run_layers(h, start, end, cache=cache, ctx=ctx)

    def logits(self, h: torch.Tensor, layer: int, *, vocab: int | None = None,
               positions: torch.Tensor | None = None, cache: KVCache | None = None,
               ctx: StepContext | None = None, shared_ok: bool = False) -> torch.Tensor:
        """Logits of the exit after 1-based ``layer`` (``L``: the final head) for ``h``
        ``(..., D)``, over the first ``vocab`` token ids (default: all). An exit whose head is
        a transformer block writes its own cache slot (pass ``positions``/``cache``)."""
        feats, weight = self.model.exit_features(h, layer, positions, cache, ctx,
                                                 shared_ok=shared_ok, ops=self.products)
        if vocab is not None and vocab < weight.shape[0]:
            weight = self._head_rows(weight, vocab)
        return self.project(feats, weight)

    def draft_tokens(self, columns: torch.Tensor, vocab: int | None) -> torch.Tensor:
        """Token ids of columns of :meth:`logits` over a draft vocabulary of ``vocab`` ids:
        the model's ranked ids (:meth:`~exitlm.model.transformer.EarlyExitLM.draft_ids`) or
        the columns themselves."""
        ids = self.model.draft_ids(vocab)
        return columns if ids is None else ids[columns]

    def draft_distribution(self, q: torch.Tensor, vocab: int | None) -> torch.Tensor:
        """A distribution ``(R, vocab)`` over a draft vocabulary's columns as one over every
        token id ``(R, V)`` (zero outside the draft vocabulary)."""
        v = self.config.vocab_size
        ids = self.model.draft_ids(vocab)
        if ids is None:
            return torch.nn.functional.pad(q, (0, v - q.shape[-1]))
        out = q.new_zeros(q.shape[0], v)
        out[:, ids] = q
        return out

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``h @ weight.T`` for an output embedding ``weight`` ``(V, D)`` (the product every
        head goes through): the model's own, through this runner's products where it has
        them."""
        if (self.products is None or self.model.output_layout is not None
                or not isinstance(weight, torch.Tensor)):
            return self.model.project(h, weight)
        return self.products.project(h, weight)

    def greedy(self, h: torch.Tensor, layer: int, *, positions: torch.Tensor | None = None,
               cache: KVCache | None = None, ahead: int = 0) -> list[int]:
        """The argmax token of exit ``layer``'s logits for each row of ``h`` ``(B, 1, D)``
        (first index on ties, what greedy decoding of :meth:`logits` takes), for callers that
        need no logits: a runner may compute it without them (the native runner's
        :class:`~exitlm.kernels.screen.GreedyScreen`, made once ``ahead`` - the most tokens
        a row may still take - makes it pay)."""
        logits = self.logits(h, layer, positions=positions, cache=cache)[:, -1]
        return argmax(logits).tolist()

    def probe(self, h: torch.Tensor, layer: int, thresholds: Sequence[float | None], *,
              positions: torch.Tensor | None = None, cache: KVCache | None = None,
              ctx: StepContext | None = None) -> tuple[list[int], torch.Tensor]:
        """The rows of ``h`` ``(B, T, D)`` whose exit ``layer`` is confident for their last
        position - its maximum probability reaches the row's threshold (EE-LLM Sec. 5.2; rows
        with ``None`` are not checked) - and their logits ``(k, V)``. An exit whose head is a
        transformer block runs it for every row whatever the decision (pass ``positions`` /
        ``cache``: later tokens attend to its cache slot)."""
        cand = [i for i, t in enumerate(thresholds) if t is not None]
        block = self.model.exit_route(layer).has_block
        every = (self.logits(h, layer, positions=positions, cache=cache, ctx=ctx)[:, -1]
                 if block else None)
        if not cand:
            return [], h.new_zeros(0, self.config.vocab_size)
        idx = torch.tensor(cand, device=h.device)
        logits = every[idx] if every is not None else self.logits(h[idx, -1], layer)
        conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
        sel = [j for j, i in enumerate(cand) if conf[j] >= thresholds[i]]  # type: ignore[operator]
        return [cand[j] for j in sel], logits[sel]

    def walk(self, h: torch.Tensor, start: int, end: int, stops: Sequence[int],
             positions: torch.Tensor, cache: KVCache | None
             ) -> Iterator[tuple[int, torch.Tensor, StepContext]]:
        """:meth:`layers` ``[start, end)`` stopping after every 1-based layer of ``stops``
        inside ``(start, end]`` and after ``end``: yields ``(layer, h, ctx)`` in order (the
        context serves heads that write a cache slot)."""
        ctx = self.context(positions, cache)
        done = start
        for stop in sorted({s for s in stops if start < s <= end} | {end}):
            h = self.layers(h, done, stop, positions, cache, ctx)
            done = stop
            yield stop, h, ctx

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                end: int | None = None, exits: Sequence[int] = (),
                taps: dict[int, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        """Run right-padded prompts ``tokens`` ``(B, T)`` of ``lengths`` ``(B,)`` through
        layers ``[0, end)`` (default: all), filling ``cache``; returns the hidden states
        ``(B, T, D)`` after layer ``end``. Exits of ``exits`` whose head is a transformer block
        get their cache slot filled too. ``taps``, when given, receives the hidden states
        after every layer of ``exits`` (keyed by layer). Afterwards ``cache.lengths`` holds
        the prompt lengths and ``fill`` no slot past them (pad positions hold nothing).

        ``start``: ``tokens`` are positions ``start .. start + T - 1`` of prompts whose first
        ``start`` positions every row of ``cache`` already holds (a long prompt prefilled in
        parts, :meth:`~exitlm.infer.decoder.Decoder.fill`); they attend to those."""
        model = self.model
        end = model.num_layers if end is None else end
        b, t = tokens.shape
        if start and bool((cache.lengths != start).any()):
            raise ValueError(f"a prefill from position {start} needs every cache row to hold "
                             f"{start} positions, they hold {cache.lengths.tolist()}")
        positions = torch.arange(start, start + t, device=tokens.device).expand(b, t)
        h = self.embed(tokens, positions)
        for layer, h_at, ctx in self._prefill_walk(h, end, exits, positions, cache):
            if layer in exits and model.exit_route(layer).has_block:
                model.exit_features(h_at, layer, cache=cache, ctx=ctx)
            if taps is not None and layer in exits:
                taps[layer] = h_at
            h = h_at
        cache.lengths = lengths
        cache.crop(lengths)
        return h

    def _prefill_walk(self, h: torch.Tensor, end: int, exits: Sequence[int],
                      positions: torch.Tensor, cache: KVCache
                      ) -> Iterator[tuple[int, torch.Tensor, StepContext]]:
        """A prefill's way through layers ``[0, end)``, stopping after the layers of
        ``exits`` (as :meth:`walk`): the model's own layers, all rows at once."""
        ctx = self.context(positions, cache)
        for layer, h_at in self.model.walk(h, 0, end, exits, cache=cache, ctx=ctx):
            yield layer, h_at, ctx

    def chain(self, tokens: torch.Tensor, cache: KVCache, n: int, depth: int, *,
              vocab: int | None = None, logits: bool = False, pick: Pick | None = None,
              stop_below: float | None = None) -> Chain:
        """``n`` steps of a chain from ``tokens`` ``(B,)`` at positions ``cache.lengths``:
        step ``j`` embeds token ``x_j`` at ``lengths + j``, runs layers ``[0, depth)``
        (writing their keys/values) and, for ``j < n``, takes ``x_{j+1}`` from exit
        ``depth``'s logits over the first ``vocab`` ids - the argmax, or ``pick(j, logits)``,
        which may also shorten the chain. Returns the tokens chosen, every step's hidden state
        after layer ``depth`` and, with ``logits``, the exit's full logits of the last step
        (a plain decoding step is ``n = 0``). A chain that uses the exit's head (``n > 0``, or
        ``logits``) writes the cache slot of an exit with a block head for every step; one
        that does not (``n = 0``: a PPD branch) is layers ``[0, depth)`` only.

        ``stop_below`` (greedy chains, no ``pick``) ends the chain early: after a step at
        which every row's draft has a probability under the exit below it (the last draft's
        state is still computed) - a round's drafting adapted to the draft's confidence."""
        model = self.model
        b = tokens.shape[0]
        base = cache.lengths.to(self.device)
        block = model.exit_route(depth).has_block
        learned = model.config.pos == "learned"
        out = torch.zeros(b, n, dtype=torch.long, device=self.device)
        hidden = torch.empty(b, n + 1, model.config.dim, dtype=self.dtype, device=self.device)
        tok = tokens.to(self.device)
        last = None
        j = 0
        while True:
            pos = (base + j)[:, None]  # (B, 1)
            ctx = self.context(pos, cache)
            # rows past their own budget ride along; learned positions stay in range
            emb_pos = pos.clamp(max=model.config.max_seq_len - 1) if learned else pos
            h = self.layers(self.embed(tok[:, None], emb_pos), 0, depth, pos, cache, ctx)
            hidden[:, j] = h[:, 0]
            if j == n and not logits:
                if block and n:  # a chain through the head: its block's slot holds every step
                    model.exit_features(h, depth, cache=cache, ctx=ctx)
                break
            step_logits = self.logits(h, depth, vocab=None if j == n else vocab, ctx=ctx,
                                      cache=cache)[:, 0]
            if j == n:
                last = step_logits
                break
            if pick is None:
                tok = self.draft_tokens(argmax(step_logits), vocab)
                if stop_below is not None and j + 1 < n:
                    conf = torch.softmax(step_logits.float(), dim=-1).amax(dim=-1)
                    if bool((conf < stop_below).all()):
                        n = j + 1
            else:
                tok, n = pick(j, step_logits)
            out[:, j] = tok
            j += 1
        return Chain(out[:, :n], hidden[:, : n + 1], last)

    def segments(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                 bounds: Sequence[int], thresholds: Sequence[float | None]) -> Segments:
        """One token per row through the layers as segments ``bounds[i] .. bounds[i+1]``
        (``bounds = [0, exits..., L]``), with KV recomputation (EE-LLM Sec. 4, App. D.3).

        ``tokens`` ``(B,)`` enter at positions ``q = cache.lengths``. ``hidden`` ``(B, S, D)``
        holds, at slot ``p`` of row ``i``, position ``p``'s state at the depth it reached: a
        segment ``[a, e)`` runs every position from ``fill[a, i]`` (the first whose keys/values
        of layer ``a`` are missing: tokens that exited earlier) to ``q_i``, so only skipped
        layers are ever recomputed. After each early exit ``e``, a row with a threshold leaves
        when :meth:`probe` finds it confident; rows with ``None`` may not exit. Rows that left
        ride along as dummies on their own slot ``q_i``, whose deep entries are missing
        anyway; ``fill`` is set after the step (layers below a row's exit hold ``0..q_i``,
        deeper ones keep their prefix). ``lengths`` is the caller's to advance."""
        model, dev = self.model, self.device
        b = tokens.shape[0]
        q = cache.lengths.clone()
        rows = torch.arange(b, device=dev)
        q_dev = q.to(dev)
        hidden[rows, q_dev] = self.embed(tokens.to(dev)[:, None], q_dev[:, None])[:, 0]
        fill_old = cache.fill.clone()
        exit_at: list[int | None] = [None] * b
        logits: list[torch.Tensor | None] = [None] * b
        evals, recomputed = [0] * b, [0] * b
        blocks = _block_slots(model, bounds)
        qs = q.tolist()
        for a, e in itertools.pairwise(bounds):
            live = [i for i in range(b) if exit_at[i] is None]
            if not live:
                break
            starts = [int(fill_old[a, i]) if exit_at[i] is None else qs[i] for i in range(b)]
            width = max(x - s + 1 for x, s in zip(qs, starts, strict=True))
            pos = torch.empty(b, width, dtype=torch.long)
            for i, (x, s) in enumerate(zip(qs, starts, strict=True)):
                m = x - s + 1
                pos[i, : width - m] = s  # left padding: duplicates of the first position
                pos[i, width - m :] = torch.arange(s, x + 1)
                if exit_at[i] is None:
                    evals[i] += (e - a) * m
                    recomputed[i] += (e - a) * (m - 1)
            pos_dev = pos.to(dev)
            ctx = self.context(pos_dev, cache)
            h = self.layers(hidden[rows[:, None], pos_dev], a, e, pos_dev, cache, ctx)
            live_dev = torch.tensor(live, device=dev)
            hidden[live_dev[:, None], pos_dev[live_dev]] = h[live_dev]
            if e == model.num_layers:
                final = self.logits(h[live_dev, -1], e)
                for j, i in enumerate(live):
                    exit_at[i], logits[i] = e, final[j]
                continue
            asked = [thresholds[i] if exit_at[i] is None else None for i in range(b)]
            got, got_logits = self.probe(h, e, asked, ctx=ctx, cache=cache)
            for j, i in enumerate(got):
                exit_at[i], logits[i] = e, got_logits[j]
        done = [int(x or 0) for x in exit_at]
        commit_fill(cache, fill_old, q, done, blocks)
        assert all(x is not None for x in logits)  # every row leaves at L at the latest
        return Segments(done, torch.stack(logits), evals, recomputed)  # type: ignore[arg-type]

    def write_kv(self, h: torch.Tensor, layer: int, positions: torch.Tensor, cache: KVCache,
                 rows: torch.Tensor) -> None:
        """Keys/values that 0-based ``layer`` computes from its input ``h`` ``(n, T, D)`` at
        ``positions`` ``(n, T)`` of cache rows ``rows`` (the layer's key/value half only;
        ``fill`` is the caller's)."""
        self.model.write_kv(h, layer, positions, cache, rows, self.products)

    # ----- helpers -----------------------------------------------------------------------------
    def _head_rows(self, weight: torch.Tensor, vocab: int) -> torch.Tensor:
        """The rows of a draft vocabulary of ``vocab`` ids of an output embedding
        (:meth:`~exitlm.model.transformer.EarlyExitLM.draft_ids`: the first ``vocab`` ids, or
        the ``vocab`` most frequent ones in rank order): a slice of a quantized weight (a
        gathered copy when ranked), a contiguous copy of a dense one (made once per weight
        version)."""
        ids = self.model.draft_ids(vocab)
        key = (id(weight), vocab)
        got = self._sliced.get(key)
        if not isinstance(weight, torch.Tensor):
            tag = 0 if ids is None else ids.data_ptr()
            source = (weight.q.data_ptr(), version_of(weight.q), tag)
            if got is None or got.source != source:
                got = _SlicedHead(weight[:vocab] if ids is None else weight.rows(ids), source)
                self._sliced[key] = got
            return got.weight
        source = (weight.data_ptr(), version_of(weight), 0 if ids is None else ids.data_ptr())
        if got is None or got.source != source:
            with torch.inference_mode(False):  # a normal tensor: packed copies track versions
                w = weight.detach()
                part = (w[:vocab] if ids is None else w.index_select(0, ids)).clone()
            got = _SlicedHead(part.contiguous(), source)
            self._sliced[key] = got
        return got.weight


def commit_fill(cache: KVCache, fill_old: torch.Tensor, q: torch.Tensor, exit_at: list[int],
                blocks: dict[int, int]) -> None:
    """``fill`` after a segmented step: every layer below a row's exit now holds positions
    ``0..q``, exit-block slots of exits at or below it too; deeper layers keep their old
    prefix (a dummy's writes there are ignored)."""
    fill = fill_old.clone()
    for i, e in enumerate(exit_at):
        fill[:e, i] = q[i] + 1
        for layer, slot in blocks.items():
            if layer <= e:
                fill[slot, i] = q[i] + 1
    cache.fill = fill


def _block_slots(model: EarlyExitLM, bounds: Sequence[int]) -> dict[int, int]:
    """The cache slots of the exits in ``bounds`` whose head is a transformer block."""
    out: dict[int, int] = {}
    for e in bounds[1:-1]:
        route = model.exit_route(e)
        if route.has_block:
            assert route.cache_slot is not None
            out[e] = route.cache_slot
    return out


def _default_positions(h: torch.Tensor) -> torch.Tensor:
    b, t = h.shape[:2]
    return torch.arange(t, device=h.device).expand(b, t)


__all__ = ["FEATURES", "LAZY_HEAD_BYTES", "Chain", "Pick", "Runner", "Segments", "commit_fill"]
