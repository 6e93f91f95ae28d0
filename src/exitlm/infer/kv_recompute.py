"""Confidence-based early exit with KV recomputation (EE-LLM Sec. 4 and App. D.3), and
CALM-style state copying for comparison.

A token that exits at layer ``e`` leaves its keys/values of layers ``e..L`` missing; later
tokens that go deeper would attend to them. EE-LLM keeps "a list of the most recent tokens that
have missing KV caches in deep layers" and includes them in the next forward pass, which
recomputes those entries; a full-model pass is forced when the list reaches a configured
length. :class:`RecomputeDecoder` holds that rule - which exits are checked, at which
threshold, when a full pass is forced - and runs each step as one
:meth:`~exitlm.runtime.runner.Runner.segments` call, whose segments carry three refinements
that keep the result exact:

* **Only the skipped layers are recomputed.** A pending token joins the next forward at its
  own exit layer, from the hidden state it had there (kept in a per-row ``(capacity, D)``
  buffer of the engine's pool, the analogue of LayerSkip's exit-query cache), not from layer 1.
* **The cache's per-slot ``fill`` says what is missing.** ``fill[i, b]`` is the number of
  leading positions of sequence ``b`` with valid keys/values in layer ``i``; every position at
  or after it still needs layer ``i``. Because a forward advances every pending token to the
  depth the new token reaches, missing entries always form a suffix, and ``fill`` is
  non-increasing with depth. Exit checkpoints split the depth into segments ``[a, e)``; within
  one segment the tokens to run are positions ``fill[a, b] .. q_b`` (``q_b`` the new token).
* **Sequences exit independently**, each with its own threshold and pending list. Rows are
  left-padded with duplicates of their first active position (identical inputs write identical
  keys/values); a row whose new token already exited keeps running as a dummy on its own slot
  ``q_b`` (whose deep entries are missing anyway) and its ``fill`` is restored afterwards.

The tokens produced equal those of a slow reference that re-runs the whole prefix through the
full model without a cache and applies the same exit rule (the tests' reference): every
key/value ever attended to is the one the full model computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exitlm.infer.decoder import Batch, Decoder, Emit, last_positions, prefill_hidden
from exitlm.infer.result import DecodeStats
from exitlm.runtime.runner import Runner, Segments


@dataclass
class EarlyExitStats(DecodeStats):
    """Per-sequence counters of confidence early exit."""

    forced_full: int = 0
    """Full-depth passes forced because ``max_pending`` tokens awaited recomputation."""
    recompute_evaluations: int = 0
    """Layer evaluations spent re-running pending tokens through layers they skipped."""


class RecomputeDecoder(Decoder):
    """Per-token forward with confidence exits and KV recomputation (see the module
    docstring). ``checks`` are the 1-based exits tried, in increasing order (each ``< L``);
    each sequence's ``options.threshold`` and ``options.max_pending`` apply to it alone."""

    name = "early-exit"
    multi_row = True
    stats_type = EarlyExitStats

    def __init__(self, runner: Runner, options: object, checks: tuple[int, ...]) -> None:
        super().__init__(runner, options)
        self.num_layers = runner.num_layers
        self.checks = tuple(sorted(c for c in checks if 0 < c < runner.num_layers))

    @property
    def aux_dims(self) -> dict[str, int]:
        return {"hidden": self.model.config.dim}

    def resolved_options(self) -> dict[str, object]:
        return {**super().resolved_options(), "exit_layers": list(self.checks),
                "threshold": self.options.threshold_for(self.model.config)}

    def prefill_span(self) -> tuple[int | None, tuple[int, ...]]:
        return None, tuple(self.checks)

    def prefill(self, batch: Batch) -> list[Emit]:
        h, lens = prefill_hidden(self.runner, batch, *self.prefill_span())
        logits = self.runner.logits(last_positions(h, lens), self.num_layers)
        return [Emit([t], [self.num_layers], self.num_layers) for t in batch.choose(logits)]

    def step(self, batch: Batch) -> list[Emit]:
        """Feed each sequence's newest token at ``cache.lengths``; choose the next one at the
        first checked exit confident enough for that sequence (EE-LLM Sec. 5.2), else at the
        final layer. A sequence with ``max_pending`` tokens awaiting recomputation goes the
        full depth (App. D.3)."""
        cache = batch.cache
        q = cache.lengths.clone()
        pending = (cache.lengths - cache.fill[self.num_layers - 1]).tolist()
        thresholds: list[float | None] = []
        config = self.model.config
        for s, p in zip(batch.seqs, pending, strict=True):
            force = p >= s.options.max_pending
            s.stats.forced_full += int(force)  # type: ignore[attr-defined]
            threshold = s.options.threshold_for(config)
            thresholds.append(threshold if threshold < 1.0 and not force else None)
        # no row may exit and none has pending tokens: one segment, no checks
        checks = self.checks if any(t is not None for t in thresholds) or any(pending) else ()
        seg = self.runner.segments(batch.lasts(self.device)[:, 0], batch.aux["hidden"], cache,
                                   [0, *checks, self.num_layers], thresholds)
        tokens = batch.choose(seg.logits)
        for s, r in zip(batch.seqs, seg.recomputed, strict=True):
            s.stats.recompute_evaluations += r  # type: ignore[attr-defined]
        self._commit(batch, q, seg)
        return [Emit([t], [e], n) for t, e, n in
                zip(tokens, seg.exit_at, seg.evals, strict=True)]

    def _commit(self, batch: Batch, q: torch.Tensor, seg: Segments) -> None:
        """After a step: every sequence has one more token (the runner left ``fill`` as the
        step's segments filled it)."""
        batch.cache.lengths = q + 1


class CopyDecoder(RecomputeDecoder):
    """CALM-style state copying (lossy, for comparison): an exited token's exit-layer hidden
    state stands in for its skipped layers' inputs; only their key/value projections are
    computed (:meth:`~exitlm.runtime.runner.Runner.write_kv`), so nothing is ever pending and
    every step is one token deep."""

    def _commit(self, batch: Batch, q: torch.Tensor, seg: Segments) -> None:
        exits = torch.tensor(seg.exit_at)  # (B,)
        start = int(exits.min())
        if start < self.num_layers:
            q_dev = q.to(self.device)
            rows = torch.arange(len(batch), device=self.device)
            state = batch.aux["hidden"][rows, q_dev][:, None]  # (B, 1, D): each exit state
            for layer in range(start, self.num_layers):
                sel = (exits <= layer).nonzero().flatten().to(self.device)
                self.runner.write_kv(state[sel], layer, q_dev[sel][:, None], batch.cache, sel)
        batch.cache.fill = torch.maximum(batch.cache.fill, (q + 1)[None, :])
        batch.cache.lengths = q + 1
