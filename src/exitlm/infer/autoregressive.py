"""Plain autoregressive decoding (the baseline every other strategy is measured against) and
fixed-depth exit (LayerSkip Sec. 4.2), which is the same loop stopped at layer ``E``.

Prompts are prefilled as one right-padded batch (positions ``0..T-1``, or from the start that
a prefill in parts already wrote); each sequence's first token comes from the exit at its own
last prompt position, and every step feeds one token per sequence at that sequence's own
position.
"""

from __future__ import annotations

import torch

from exitlm.infer.decoder import Batch, Decoder, Emit, last_positions, prefill_hidden
from exitlm.infer.strategy_options import AROptions  # noqa: F401 - re-exported
from exitlm.runtime.runner import Runner


class DepthDecoder(Decoder):
    """Every token runs layers ``1..depth`` and leaves through the exit after ``depth``
    (``depth = L``: plain decoding; ``depth < L``: LayerSkip's fixed exit, lossy since the
    layers past ``E`` never run - and never leave keys/values missing). A step is a chain of
    no draft (:meth:`~exitlm.runtime.runner.Runner.chain` with ``n = 0``) and the exit's
    logits."""

    name = "ar"

    def __init__(self, runner: Runner, options: object, depth: int | None = None) -> None:
        super().__init__(runner, options)
        self.depth = runner.num_layers if depth is None else depth
        self.model.exit_route(self.depth, setting="exit_layer")

    def prefill_span(self) -> tuple[int | None, tuple[int, ...]]:
        return self.depth, (self.depth,)

    def prefill(self, batch: Batch) -> list[Emit]:
        e = self.depth
        h, lens = prefill_hidden(self.runner, batch, *self.prefill_span())
        return [Emit([t], [e], e) for t in first_tokens(self.runner, batch, h, lens, e)]

    def step(self, batch: Batch) -> list[Emit]:
        e = self.depth
        return [Emit([t], [e], e) for t in plain_step(self.runner, batch, e)]


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
