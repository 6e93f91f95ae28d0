"""Confidence-based early exit with KV recomputation (EE-LLM Sec. 4 and App. D.3), and
CALM-style state copying for comparison.

A token that exits at layer ``e`` leaves its keys/values of layers ``e..L`` missing; later
tokens that go deeper would attend to them. EE-LLM keeps "a list of the most recent tokens that
have missing KV caches in deep layers" and includes them in the next forward pass, which
recomputes those entries; a full-model pass is forced when the list reaches a configured
length. :class:`RecomputeDecoder` implements that with three refinements that keep the result
exact:

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
full model without a cache and applies the same exit rule (:func:`reference_decode`): every
key/value ever attended to is the one the full model computes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from exitlm.infer.decoder import Batch, Decoder, Emit, last_positions, prefill_hidden
from exitlm.infer.result import DecodeStats
from exitlm.model.transformer import EarlyExitLM, StepContext


@dataclass
class EarlyExitStats(DecodeStats):
    """Per-sequence counters of confidence early exit."""

    forced_full: int = 0
    """Full-depth passes forced because ``max_pending`` tokens awaited recomputation."""
    recompute_evaluations: int = 0
    """Layer evaluations spent re-running pending tokens through layers they skipped."""


@dataclass
class _Step:
    """Bookkeeping of one decoding step over a batch."""

    q: torch.Tensor  # (B,) position of each new token
    fill_old: torch.Tensor  # (slots, B) fill before the step
    force: list[bool]  # rows that must go the full depth (max_pending reached)
    thresholds: list[float]
    exit_at: list[int | None]
    chosen: list[int]
    evals: list[int]

    def live(self) -> list[int]:
        return [i for i, e in enumerate(self.exit_at) if e is None]


class RecomputeDecoder(Decoder):
    """Per-token forward with confidence exits and KV recomputation (see the module
    docstring). ``checks`` are the 1-based exits tried, in increasing order (each ``< L``);
    each sequence's ``options.threshold`` and ``options.max_pending`` apply to it alone."""

    name = "early-exit"
    multi_row = True
    stats_type = EarlyExitStats

    def __init__(self, model: EarlyExitLM, options: object, checks: tuple[int, ...]) -> None:
        super().__init__(model, options)
        self.num_layers = model.num_layers
        self.checks = tuple(sorted(c for c in checks if 0 < c < model.num_layers))
        self.block_slots = {e: model.exit_route(e).cache_slot for e in self.checks
                            if model.exit_route(e).has_block}

    @property
    def aux_dims(self) -> dict[str, int]:
        return {"hidden": self.model.config.dim}

    def resolved_options(self) -> dict[str, object]:
        return {**super().resolved_options(), "exit_layers": list(self.checks)}

    def prefill(self, batch: Batch) -> list[Emit]:
        h, lens = prefill_hidden(self.model, batch, exits=self.checks)
        logits = self.model.final_logits(last_positions(h, lens))
        return [Emit([t], [self.num_layers], self.num_layers) for t in batch.choose(logits)]

    def step(self, batch: Batch) -> list[Emit]:
        """Feed each sequence's newest token at ``cache.lengths``; choose the next one at the
        first checked exit confident enough for that sequence, else at the final layer."""
        st = self._start(batch)
        if self._native_step(batch, st):
            self._commit(batch, st)
            return [Emit([st.chosen[0]], [int(st.exit_at[0] or 0)], st.evals[0])]
        for a, e in itertools.pairwise([0, *self._checks_for(st), self.num_layers]):
            if not st.live():
                break
            h, ctx = self._advance(batch, st, a, e)
            if e == self.num_layers:
                live = st.live()
                logits = self.model.final_logits(h[torch.tensor(live, device=self.device), -1])
                for i, tok in zip(live, batch.choose(logits, live), strict=True):
                    st.exit_at[i], st.chosen[i] = e, tok
            else:
                self._try_exit(batch, st, e, h, ctx)
        self._commit(batch, st)
        return [Emit([t], [int(e or 0)], n) for t, e, n in
                zip(st.chosen, st.exit_at, st.evals, strict=True)]

    # ----- the parts of a step -----------------------------------------------------------------
    def _start(self, batch: Batch) -> _Step:
        cache = batch.cache
        q = cache.lengths.clone()
        rows = torch.arange(len(batch), device=self.device)
        q_dev = q.to(self.device)
        batch.aux["hidden"][rows, q_dev] = self.model.embed(batch.lasts(self.device),
                                                            q_dev[:, None])[:, 0]
        pending = (cache.lengths - cache.fill[self.num_layers - 1]).tolist()
        opts = [s.options for s in batch.seqs]
        force = [p >= o.max_pending for p, o in zip(pending, opts, strict=True)]
        for s, f in zip(batch.seqs, force, strict=True):
            s.stats.forced_full += int(f)  # type: ignore[attr-defined]
        b = len(batch)
        return _Step(q, cache.fill.clone(), force, [o.threshold for o in opts], [None] * b,
                     [0] * b, [0] * b)

    def _native_step(self, batch: Batch, st: _Step) -> bool:
        """The step of one greedy sequence in one native call, where the model offers one
        (:meth:`~exitlm.backend.decode_block.LeanLM.early_exit_step`): its segments and exit
        checks without a Python round trip each (a small model's check costs more in Python
        than its layers compute). The final layer's logits, when no exit fires, come from
        :meth:`~exitlm.model.transformer.EarlyExitLM.final_logits` as in every other step.
        False (nothing done) where the call does not apply: a batch, sampling,
        log-probabilities, exits with blocks, the copy mode, or a model it does not take."""
        step = getattr(self.model, "early_exit_step", None)
        if (step is None or type(self) is not RecomputeDecoder or len(batch) != 1
                or self.block_slots or self.device.type != "cpu"):
            return False
        seq = batch.seqs[0]
        if not seq.sampling.greedy or seq.wants_logprobs:
            return False
        q = int(st.q[0])
        bounds = [0, *self._checks_for(st), self.num_layers]
        starts = [int(st.fill_old[a, 0]) for a in bounds[:-1]]
        may = st.thresholds[0] < 1.0 and not st.force[0]
        hidden = batch.aux["hidden"][0]
        got = step(hidden, q, starts, bounds, st.thresholds[0] if may else None, batch.cache)
        if got is None:
            return False
        ran, exit_layer, token = got
        for a, e, s in zip(bounds[:ran], bounds[1:ran + 1], starts, strict=False):
            _count(batch, st, 0, e - a, q - s + 1)
        if exit_layer:
            st.exit_at[0], st.chosen[0] = exit_layer, token
        else:
            logits = self.model.final_logits(hidden[q][None])
            st.exit_at[0], st.chosen[0] = self.num_layers, batch.choose(logits)[0]
        return True

    def _checks_for(self, st: _Step) -> tuple[int, ...]:
        """The segment bounds of this step: every check, unless no sequence may exit and none
        has tokens pending (they join the forward at their own exit layers)."""
        may = any(t < 1.0 and not f for t, f in zip(st.thresholds, st.force, strict=True))
        pending = bool((st.q > st.fill_old[self.num_layers - 1]).any())
        return self.checks if may or pending else ()

    def _advance(self, batch: Batch, st: _Step, a: int, e: int
                 ) -> tuple[torch.Tensor, StepContext]:
        """Run layers ``[a, e)`` over every live row's pending positions and its new token
        (dummies for exited rows); returns the hidden states ``(B, W, D)`` after layer ``e``."""
        qs = st.q.tolist()
        starts = [int(st.fill_old[a, i]) if x is None else qs[i] for i, x in enumerate(st.exit_at)]
        width = max(q - s + 1 for q, s in zip(qs, starts, strict=True))
        pos = torch.empty(len(qs), width, dtype=torch.long)
        for i, (q, s) in enumerate(zip(qs, starts, strict=True)):
            n = q - s + 1
            pos[i, : width - n] = s  # left padding: duplicates of the first one
            pos[i, width - n :] = torch.arange(s, q + 1)
            if st.exit_at[i] is None:
                _count(batch, st, i, e - a, n)
        pos_dev = pos.to(self.device)
        hidden = batch.aux["hidden"]
        rows = torch.arange(len(qs), device=self.device)
        ctx = self.model.context(pos_dev, batch.cache)
        h = self.model.run_layers(hidden[rows[:, None], pos_dev], a, e, cache=batch.cache,
                                  ctx=ctx)
        live = torch.tensor(st.live(), device=self.device)
        hidden[live[:, None], pos_dev[live]] = h[live]
        return h, ctx

    def _try_exit(self, batch: Batch, st: _Step, e: int, h: torch.Tensor,
                  ctx: StepContext) -> None:
        """Exit the live, unforced rows whose maximum probability at exit ``e`` reaches their
        threshold (EE-LLM Sec. 5.2 confidence)."""
        if e in self.block_slots:  # the exit block's own cache slot needs every row's token
            all_logits = self.model.exit_logits(h, e, cache=batch.cache, ctx=ctx)[:, -1]
        cand = [i for i in st.live() if not st.force[i] and st.thresholds[i] < 1.0]
        if not cand:
            return
        idx = torch.tensor(cand, device=self.device)
        logits = all_logits[idx] if e in self.block_slots else \
            self.model.exit_logits(h[idx, -1], e)
        conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
        sel = [j for j, i in enumerate(cand) if conf[j] >= st.thresholds[i]]
        if sel:
            rows = [cand[j] for j in sel]
            for i, tok in zip(rows, batch.choose(logits[sel], rows), strict=True):
                st.exit_at[i], st.chosen[i] = e, tok

    def _commit(self, batch: Batch, st: _Step) -> None:
        """Set ``fill`` after a step: every layer below a sequence's exit now holds positions
        ``0..q_b``; deeper layers (and block-exit slots past the exit) keep their old prefix
        (dummy writes there are ignored)."""
        fill = st.fill_old.clone()
        for i, e in enumerate(st.exit_at):
            assert e is not None
            fill[:e, i] = st.q[i] + 1
            for layer, slot in self.block_slots.items():
                if layer <= e:
                    fill[slot, i] = st.q[i] + 1
        batch.cache.fill = fill
        batch.cache.lengths = st.q + 1


def _count(batch: Batch, st: _Step, row: int, layers: int, positions: int) -> None:
    """Count ``layers`` layers run over ``positions`` positions of sequence ``row`` (its new
    token and the pending ones before it): layer evaluations, and the recomputed ones."""
    st.evals[row] += layers * positions
    stats = batch.seqs[row].stats
    stats.recompute_evaluations += layers * (positions - 1)  # type: ignore[attr-defined]


class CopyDecoder(RecomputeDecoder):
    """CALM-style state copying (lossy, for comparison): an exited token's exit-layer hidden
    state stands in for its skipped layers' inputs; only their key/value projections are
    computed (:meth:`~exitlm.model.transformer.EarlyExitLM.write_kv`), so nothing is ever
    pending and every step is one token deep."""

    def _commit(self, batch: Batch, st: _Step) -> None:
        exits = torch.tensor([int(e or 0) for e in st.exit_at])  # (B,)
        start = int(exits.min())
        if start < self.num_layers:
            q = st.q.to(self.device)
            rows = torch.arange(len(batch), device=self.device)
            state = batch.aux["hidden"][rows, q][:, None]  # (B, 1, D): each row's exit state
            for layer in range(start, self.num_layers):
                sel = (exits <= layer).nonzero().flatten().to(self.device)
                self.model.write_kv(state[sel], layer, q[sel][:, None], batch.cache, sel)
        batch.cache.fill = torch.maximum(st.fill_old, (st.q + 1)[None, :])
        batch.cache.lengths = st.q + 1


def reference_decode(
    model: EarlyExitLM,
    prompt: list[int],
    steps: int,
    checks: tuple[int, ...],
    threshold: float,
    max_pending: int,
) -> tuple[list[int], list[int]]:
    """Slow greedy reference for tests: every token re-runs the whole prefix through the full
    model **without a cache** and applies the same exit rule (first checked exit with maximum
    probability ``>= threshold``; a full pass after ``max_pending`` consecutive early exits).
    Returns the tokens and their exit layers; the first token always comes from the final
    layer (the prompt forward is a full pass)."""
    seq = list(prompt)
    out: list[int] = []
    layers: list[int] = []
    pending = 0
    num_layers = model.num_layers
    with torch.inference_mode():
        for step in range(steps):
            res = model(torch.tensor([seq]), exit_layers=tuple(checks))
            layer, tok = num_layers, int(res.logits[0, -1].argmax())
            if step > 0 and threshold < 1.0 and pending < max_pending:
                for e in sorted(checks):
                    logits = res.exit_logits[e][0, -1]
                    if float(torch.softmax(logits.float(), -1).max()) >= threshold:
                        layer, tok = e, int(logits.argmax())
                        break
            pending = 0 if layer == num_layers else pending + 1
            out.append(tok)
            layers.append(layer)
            seq.append(tok)
    return out, layers

