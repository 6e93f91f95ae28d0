"""Plain autoregressive decoding (the baseline every other strategy is measured against) and
fixed-depth exit (LayerSkip Sec. 4.2), which is the same loop stopped at layer ``E``.

Prompts are prefilled as one right-padded batch (positions ``0..T-1``); each sequence's first
token comes from the logits at its own last prompt position, and every step feeds one token per
sequence at that sequence's own position.
"""

from __future__ import annotations

from dataclasses import dataclass

from exitlm.backend.cuda_graphs import static_steps
from exitlm.infer.decoder import Batch, Decoder, Emit, last_positions, prefill_hidden
from exitlm.model.transformer import EarlyExitLM


@dataclass(frozen=True)
class AROptions:
    """Options of plain autoregressive decoding (none beyond :class:`SamplingOptions`)."""


class DepthDecoder(Decoder):
    """Every token runs layers ``1..depth`` and leaves through the exit after ``depth``
    (``depth = L``: plain decoding; ``depth < L``: LayerSkip's fixed exit, lossy since the
    layers past ``E`` never run - and never leave keys/values missing)."""

    name = "ar"

    def __init__(self, model: EarlyExitLM, options: object, depth: int | None = None) -> None:
        super().__init__(model, options)
        self.depth = model.num_layers if depth is None else depth
        route = model.exit_route(self.depth, setting="exit_layer")
        # a prepared model's native plain step (exits with blocks need the step's context)
        self.native = not route.has_block and self.device.type == "cpu"

    def prefill(self, batch: Batch) -> list[Emit]:
        model, e = self.model, self.depth
        h, lens = prefill_hidden(model, batch, end=e, exits=(e,))
        pos = (lens - 1).to(self.device)[:, None]
        logits = model.exit_logits(last_positions(h, lens)[:, None], e, positions=pos,
                                   cache=batch.cache)[:, 0]
        return [Emit([t], [e], e) for t in batch.choose(logits)]

    def step(self, batch: Batch) -> list[Emit]:
        model, cache, e = self.model, batch.cache, self.depth
        steps = static_steps(model)
        if steps is not None and steps.serves_exit(e):
            # a CUDA model: the whole step is one graph replay (backend.cuda_graphs)
            logits = steps.step(batch.lasts(self.device)[:, 0], cache, e)
            cache.lengths += 1
            return [Emit([t], [e], e) for t in batch.choose(logits)]
        native = getattr(model, "step_hidden", None) if self.native else None
        if native is not None and len(batch) == 1:
            # one sequence: embedding and layers in one native call (LeanLM.step_hidden)
            h = native(batch.seqs[0].last, e, cache, int(cache.lengths[0]))
            if h is not None:
                logits = model.exit_logits(h, e)[:, -1]
                cache.lengths += 1
                return [Emit([t], [e], e) for t in batch.choose(logits)]
        pos = cache.lengths.to(self.device)[:, None]  # (B, 1)
        ctx = model.context(pos, cache)
        h = model.run_layers(model.embed(batch.lasts(self.device), pos), 0, e, cache=cache,
                             ctx=ctx)
        logits = model.exit_logits(h, e, cache=cache, ctx=ctx)[:, -1]
        cache.lengths += 1
        return [Emit([t], [e], e) for t in batch.choose(logits)]

