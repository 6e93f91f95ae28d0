"""Plain autoregressive decoding (the baseline every other strategy is measured against) and
fixed-depth exit (LayerSkip Sec. 4.2), which is the same loop stopped at layer ``E``.

Prompts are prefilled as one right-padded batch (positions ``0..T-1``, or from the start that
a prefill in parts already wrote); each sequence's first token comes from the exit at its own
last prompt position, and every step feeds one token per sequence at that sequence's own
position.
"""

from __future__ import annotations

from exitlm.infer.decoder import Batch, Decoder, Emit, first_tokens, plain_step, prefill_hidden
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
