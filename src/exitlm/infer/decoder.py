"""What every decoding strategy is: a :class:`Decoder` with a prefill and a step over the
sequences it is given (gpt-fast's ``prefill`` / ``decode_one_token``, vLLM's per-step
scheduling), written once on the primitives of a runtime runner
(:class:`~exitlm.runtime.runner.Runner`): a decoder holds a strategy's rules - acceptance, exit
criteria, branches - and never asks which backend computes its forwards.

The :class:`~exitlm.infer.engine.Engine` owns everything else - the pool of KV rows,
admission, stopping, streaming, timing and results - and calls a decoder with a
:class:`Batch`: the running sequences (:class:`Seq`, one per pool row) and views of their
cache rows. A decoder never sees more than the rows it must advance, keeps no per-sequence
state of its own between calls (except PPD, which runs one sequence at a time), and answers
each call with one :class:`Emit` per sequence: the tokens chosen, the layer each exited at
and the layer evaluations spent.

Cache convention (:mod:`exitlm.model.kv_cache`): the token at position ``p`` lives in slot
``p``; ``cache.lengths[row]`` counts the tokens whose keys/values are committed; the newest
chosen token (``Seq.last``) is not yet in the cache - the next step feeds it at position
``cache.lengths[row]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import DecodeStats, TokenLogprob
from exitlm.infer.sampling import choose_rows, token_logprobs
from exitlm.model.kv_cache import KVCache
from exitlm.runtime.runner import Runner


@dataclass(eq=False)
class Seq:
    """One request's decoding state as decoders see it.

    Attributes:
        prompt: the prompt's token ids.
        sampling: how this sequence chooses tokens and when it stops.
        options: the strategy's options for this sequence (per-request fields applied).
        generator: its own random generator (``None`` when greedy).
        stats: the strategy's per-sequence statistics, updated by the decoder.
        last: the newest chosen token, not yet fed through the model (``-1`` before prefill).
        generated: tokens chosen so far.
        logprobs: log-probabilities of the tokens chosen since the engine last collected
            them, in order (kept only when ``sampling.logprobs`` asks for them).
    """

    prompt: list[int]
    sampling: SamplingOptions
    options: Any
    generator: torch.Generator | None
    stats: DecodeStats
    state: Any = None
    """A strategy's own per-sequence state carried from step to step (adaptive
    self-speculation's agreement estimates), ``None`` until it sets one."""
    last: int = -1
    generated: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def remaining(self) -> int:
        """How many more tokens this sequence may produce."""
        return self.sampling.max_new_tokens - self.generated


@dataclass
class Batch:
    """The sequences one decoder call advances and views of their pool rows.

    Attributes:
        seqs: one per row, in row order.
        cache: the rows' KV cache (a view sharing the pool's storage).
        aux: per-row buffers the decoder asked for (:attr:`Decoder.aux_dims`), as views
            ``(rows, capacity, dim)``.
    """

    seqs: list[Seq]
    cache: KVCache
    aux: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)

    def sampling(self) -> list[SamplingOptions]:
        return [s.sampling for s in self.seqs]

    def choose(self, logits: torch.Tensor, rows: list[int] | None = None) -> list[int]:
        """Each row's next token from ``logits`` ``(R, V)``; ``rows`` picks which sequences
        the logits belong to (default: all, in order). Records log-probabilities for the
        sequences that want them."""
        seqs = self.seqs if rows is None else [self.seqs[i] for i in rows]
        tokens = choose_rows(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        self.record(logits, tokens, rows)
        return tokens

    def record(self, logits: torch.Tensor, tokens: list[int], rows: list[int] | None = None
               ) -> None:
        """Note the log-probabilities of ``tokens`` (one per row of ``logits``) for the
        sequences ``rows`` that want them; a row may repeat (several tokens of one sequence,
        in order)."""
        idx = list(range(len(self.seqs))) if rows is None else rows
        want = [j for j, i in enumerate(idx) if self.seqs[i].wants_logprobs]
        if not want:
            return
        top = max(self.seqs[idx[j]].sampling.logprobs or 0 for j in want)
        sel = torch.tensor(want, device=logits.device)
        for j, lp in zip(want, token_logprobs(logits[sel], [tokens[j] for j in want], top),
                         strict=True):
            seq = self.seqs[idx[j]]
            keep = seq.sampling.logprobs or 0
            seq.logprobs.append(TokenLogprob(lp.token, lp.logprob, lp.top[:keep]))

    def lasts(self, device: torch.device) -> torch.Tensor:
        """``(B, 1)`` the newest token of every sequence."""
        return torch.tensor([[s.last] for s in self.seqs], dtype=torch.long, device=device)


@dataclass
class Emit:
    """What one call produced for one sequence: tokens in order, the 1-based layer each
    exited at, and the transformer-layer evaluations (token x layer) spent."""

    tokens: list[int]
    layers: list[int]
    evals: int


class Decoder:
    """A decoding strategy as a step machine (see the module docstring).

    Subclasses set the class attributes and implement :meth:`prefill` and :meth:`step`.
    """

    name: ClassVar[str] = ""
    stats_type: ClassVar[type[DecodeStats]] = DecodeStats
    max_batch: ClassVar[int | None] = None
    """The most sequences one step may hold (``None``: any)."""
    multi_row: ClassVar[bool] = False
    """Whether a step multiplies several rows per sequence (verification, recomputation)."""
    fills_in_parts: ClassVar[bool] = True
    """Whether :meth:`fill` may prefill the start of a long prompt in parts before
    :meth:`prefill` takes the rest (the engine's chunked prefill)."""

    def __init__(self, runner: Runner, options: Any) -> None:
        self.runner = runner
        self.model = runner.model
        self.options = options
        self.device = runner.device
        self.dtype = runner.dtype

    # ----- what the engine asks ------------------------------------------------------------
    @property
    def aux_dims(self) -> dict[str, int]:
        """Per-row buffers ``name -> feature size`` the pool keeps next to the KV cache."""
        return {}

    def lookahead(self, seq: Seq) -> int:
        """Positions past ``cache.lengths`` that the next step may write for ``seq``."""
        return 1

    @property
    def max_lookahead(self) -> int:
        """An upper bound of :meth:`lookahead` over every sequence."""
        return 1

    def check(self, seq: Seq) -> None:
        """Reject a request this decoder cannot serve (a :class:`ConfigError`)."""

    def resolved_options(self) -> dict[str, Any]:
        """The options in force, defaults resolved (reported in results)."""
        import dataclasses

        return dataclasses.asdict(self.options) if self.options is not None else {}

    def new_stats(self) -> DecodeStats:
        return self.stats_type()

    @property
    def startup_s(self) -> float:
        """Seconds spent so far starting helpers (a worker process) inside :meth:`prefill`;
        the engine reports them apart from prefill time."""
        return 0.0

    def close(self) -> None:
        """Release what the decoder holds beyond the engine's pool (threads, streams)."""

    def prefill_span(self) -> tuple[int | None, tuple[int, ...]]:
        """What :meth:`prefill` fills: the cache of layers ``[0, end)`` (``None``: all) and of
        the exits of the tuple whose head is a transformer block (:meth:`Runner.prefill`)."""
        return None, ()

    # ----- the calls ----------------------------------------------------------------------------
    def prefill(self, batch: Batch) -> list[Emit]:
        """Run the prompts of ``batch`` and choose each sequence's first token. The rows are
        fresh, or hold the start of their prompts that :meth:`fill` wrote."""
        raise NotImplementedError

    def fill(self, batch: Batch, stop: int) -> None:
        """Prefill the prompt positions ``[held, stop)`` of ``batch``'s rows (``held``: the
        positions they hold, the same in every row) into the cache as :meth:`prefill` would,
        without choosing a token: the engine's chunked prefill runs a long prompt in parts
        between decoding steps, :meth:`prefill` taking the last part."""
        end, exits = self.prefill_span()
        prefill_hidden(self.runner, batch, end=end, exits=exits, stop=stop)

    def step(self, batch: Batch) -> list[Emit]:
        """Advance every sequence of ``batch`` by at least one token."""
        raise NotImplementedError


# ----- helpers shared by the decoders ----------------------------------------------------------

def padded_prompts(batch: Batch, pad: int, device: torch.device, stop: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt tokens ``(B, T)`` on ``device`` and their lengths ``(B,)``
    (``stop``: the prompts' first ``stop`` tokens)."""
    prompts = [s.prompt if stop is None else s.prompt[:stop] for s in batch.seqs]
    lens = [len(p) for p in prompts]
    tokens = torch.full((len(lens), max(lens)), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : lens[i]] = torch.tensor(p, dtype=torch.long)
    return tokens.to(device), torch.tensor(lens, dtype=torch.long)


def prefill_hidden(runner: Runner, batch: Batch, end: int | None = None,
                   exits: tuple[int, ...] = (), taps: dict[int, torch.Tensor] | None = None,
                   stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``batch``'s prompts through layers ``[0, end)`` (:meth:`Runner.prefill`), filling its
    cache rows; returns the hidden states after layer ``end`` and the prompt lengths
    (``taps``: see :meth:`Runner.prefill`).

    Rows that already hold the start of their prompts (:meth:`Decoder.fill`: all the same
    number of positions) continue from there: the states then cover the positions from it
    on, ``(B, T - start, D)`` (:func:`last_positions` and :func:`prefilled_offset` account
    for it). ``stop``: only the prompts' first ``stop`` tokens (a part of a long prompt)."""
    cfg = runner.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    tokens, lens = padded_prompts(batch, pad, runner.device, stop)
    start = int(batch.cache.lengths.min()) if len(batch) else 0
    return runner.prefill(tokens[:, start:], lens, batch.cache, end, exits, taps,
                          start=start), lens


def prefilled_offset(h: torch.Tensor, lengths: torch.Tensor) -> int:
    """The prompt position of ``h[:, 0]`` for states :func:`prefill_hidden` returned for
    prompts of ``lengths`` (right-padded to the longest): 0 unless the rows held a start."""
    return int(lengths.max()) - h.shape[1]


def last_positions(h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Every row's state at its last prompt position, ``(B, D)``, from the states
    :func:`prefill_hidden` returned for prompts of ``lengths``."""
    rows = torch.arange(h.shape[0], device=h.device)
    return h[rows, lengths.to(h.device) - 1 - prefilled_offset(h, lengths)]


def argmax_only(runner: Runner, batch: Batch) -> bool:
    """Whether only the argmax is needed (every row greedy, no log-probabilities) and the
    runner finds it for less than the logits (:meth:`Runner.greedy`)."""
    return runner.supports("argmax") and all(
        s.sampling.greedy and not s.wants_logprobs for s in batch.seqs)


def first_tokens(runner: Runner, batch: Batch, h: torch.Tensor, lengths: torch.Tensor,
                 depth: int) -> list[int]:
    """Each sequence's first token: the choice of the exit after ``depth`` at its last prompt
    position, from the states :func:`prefill_hidden` returned. The argmax alone when that is
    all the batch needs (:func:`argmax_only`; a screen it builds then is built during the
    prefill, not during the first timed step)."""
    pos = (lengths - 1).to(runner.device)[:, None]
    last = last_positions(h, lengths)[:, None]
    if argmax_only(runner, batch):
        return runner.greedy(last, depth, positions=pos, cache=batch.cache,
                             ahead=max(s.remaining for s in batch.seqs))
    return batch.choose(runner.logits(last, depth, positions=pos, cache=batch.cache)[:, 0])


def plain_step(runner: Runner, batch: Batch, depth: int) -> list[int]:
    """One token per sequence of ``batch`` through layers ``1..depth`` and the exit after
    ``depth`` (a chain of no draft), each sequence's newest token fed at its own position;
    the cache lengths advance by one. The argmax alone (:meth:`Runner.greedy`) when that is
    all the batch needs, else the logits and each sequence's choice."""
    greedy = argmax_only(runner, batch)
    out = runner.chain(batch.lasts(runner.device)[:, 0], batch.cache, 0, depth,
                       logits=not greedy)
    if greedy:
        pos = batch.cache.lengths[:, None].to(runner.device)
        tokens = runner.greedy(out.hidden[:, -1:], depth, positions=pos, cache=batch.cache,
                               ahead=max(s.remaining for s in batch.seqs))
    else:
        assert out.logits is not None
        tokens = batch.choose(out.logits)
    batch.cache.lengths += 1
    return tokens
