"""Plain autoregressive decoding (the baseline every other strategy is measured against) and
fixed-depth exit (LayerSkip Sec. 4.2), which is the same loop stopped at layer ``E``.

Prompts are prefilled as one right-padded batch (positions ``0..T-1``); each sequence's first
token comes from the logits at its own last prompt position, and every step feeds one token per
sequence at that sequence's own position.
"""

from __future__ import annotations

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
        runner, e = self.runner, self.depth
        h, lens = prefill_hidden(runner, batch, *self.prefill_span())
        pos = (lens - 1).to(self.device)[:, None]
        last = last_positions(h, lens)[:, None]
        if self._argmax_only(batch):
            tokens = runner.greedy(last, e, positions=pos, cache=batch.cache,
                                   ahead=max(s.remaining for s in batch.seqs))
        else:
            tokens = batch.choose(runner.logits(last, e, positions=pos, cache=batch.cache)[:, 0])
        return [Emit([t], [e], e) for t in tokens]

    def step(self, batch: Batch) -> list[Emit]:
        e = self.depth
        argmax_only = self._argmax_only(batch)
        out = self.runner.chain(batch.lasts(self.device)[:, 0], batch.cache, 0, e,
                                logits=not argmax_only)
        if argmax_only:
            pos = batch.cache.lengths[:, None].to(self.device)
            tokens = self.runner.greedy(out.hidden[:, -1:], e, positions=pos, cache=batch.cache,
                                        ahead=max(s.remaining for s in batch.seqs))
        else:
            assert out.logits is not None
            tokens = batch.choose(out.logits)
        batch.cache.lengths += 1
        return [Emit([t], [e], e) for t in tokens]

    def _argmax_only(self, batch: Batch) -> bool:
        """Whether only the argmax is needed (every row greedy, no log-probabilities) and the
        runner finds it for less than the logits (:meth:`Runner.greedy`)."""
        return self.runner.supports("argmax") and all(
            s.sampling.greedy and not s.wants_logprobs for s in batch.seqs)
