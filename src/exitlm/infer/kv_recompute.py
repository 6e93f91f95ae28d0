"""Confidence-based early exit with KV recomputation (EE-LLM Sec. 4 and App. D.3).

A token that exits at layer ``e`` leaves its keys/values of layers ``e..L`` missing; later
tokens that go deeper would attend to them. EE-LLM keeps "a list of the most recent tokens that
have missing KV caches in deep layers" and includes them in the next forward pass, which
recomputes those entries; a full-model pass is forced when the list reaches a configured
length. This module implements that with three refinements that keep the result exact:

* **Only the skipped layers are recomputed.** A pending token joins the next forward at its
  own exit layer, from the hidden state it had there (kept in a preallocated
  ``(B, capacity, D)`` buffer, the analogue of LayerSkip's exit-query cache), not from layer 1.
* **The cache's per-slot ``fill`` says what is missing.** ``fill[i, b]`` is the number of
  leading positions of sequence ``b`` with valid keys/values in layer ``i``; every position at
  or after it still needs layer ``i``. Because a forward advances every pending token to the
  depth the new token reaches, missing entries always form a suffix, and ``fill`` is
  non-increasing with depth. Exit checkpoints split the depth into segments ``[a, e)``; within
  one segment the tokens to run are positions ``fill[a, b] .. q_b`` (``q_b`` the new token).
* **Batches exit independently.** Each sequence has its own pending suffix and its own exit
  decision. Rows are left-padded with duplicates of their first active position (identical
  inputs write identical keys/values); a row whose new token already exited keeps running as
  a dummy on its own slot ``q_b`` (whose deep entries are missing anyway) and its ``fill`` is
  restored afterwards.

The tokens produced equal those of a slow reference that re-runs the whole prefix through the
full model without a cache and applies the same exit rule: every key/value ever attended to is
the one the full model computes.
"""

from __future__ import annotations

import itertools

import torch

from exitlm.infer.common import block_slot, has_block_head
from exitlm.infer.options import SamplingOptions
from exitlm.infer.sampling import choose
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM


class RecomputeDecoder:
    """Per-token forward with confidence exits and KV recomputation for a batch.

    Args:
        model: the model.
        cache: a prefilled cache; ``cache.lengths[b]`` is the next position of sequence ``b``
            and ``cache.fill`` is the valid prefix of every slot (see module docstring).
        checks: 1-based exit layers checked in increasing order (each ``< L``).
        threshold: emit at the first checked exit whose maximum probability is
            ``>= threshold`` (EE-LLM Sec. 5.2 confidence); ``>= 1`` never exits early.
        max_pending: force a full-depth pass when this many tokens wait for recomputation
            (EE-LLM App. D.3).
        sampling: how the token is chosen from the exit's (or final) logits.
        generator: the sampling generator (``None`` when greedy).
    """

    def __init__(
        self,
        model: EarlyExitLM,
        cache: KVCache,
        checks: tuple[int, ...],
        threshold: float,
        max_pending: int,
        sampling: SamplingOptions,
        generator: torch.Generator | None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.num_layers = model.num_layers
        self.checks = tuple(sorted(c for c in checks if 0 < c < model.num_layers))
        self.threshold = threshold
        self.max_pending = max_pending
        self.sampling = sampling
        self.generator = generator
        ref = model.embed_tokens.weight
        self.device = ref.device
        # Hidden state of every pending token at the depth its keys/values reach.
        self.hidden = torch.zeros(
            cache.batch_size, cache.max_seq_len, model.config.dim, dtype=ref.dtype,
            device=ref.device,
        )
        self._block_slot = {
            e: block_slot(model, e) for e in self.checks if has_block_head(model, e)
        }

    def pending(self) -> torch.Tensor:
        """Tokens per sequence whose deepest keys/values are missing ``(B,)``."""
        return self.cache.lengths - self.cache.fill[self.num_layers - 1]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """Feed one new token per sequence at position ``cache.lengths``; return the next
        token of every sequence, the layer it exited at, and the layer evaluations (token x
        layer, recomputation included) spent on each sequence."""
        model, cache, num_layers = self.model, self.cache, self.num_layers
        b = cache.batch_size
        q = cache.lengths.clone()  # (B,) position of the new token
        fill_old = cache.fill.clone()  # (slots, B)
        rows = torch.arange(b, device=self.device)
        q_dev = q.to(self.device)
        self.hidden[rows, q_dev] = model.embed(tokens[:, None], q_dev[:, None])[:, 0]
        never = self.threshold >= 1.0
        force = (self.pending() >= self.max_pending).tolist()
        exit_at: list[int | None] = [None] * b
        chosen: list[int] = [0] * b
        evals = [0] * b
        bounds = [0, *([] if never else self.checks), num_layers]
        for a, e in itertools.pairwise(bounds):
            live = [i for i in range(b) if exit_at[i] is None]
            if not live:
                break
            qs = q.tolist()
            starts = [int(fill_old[a, i]) if exit_at[i] is None else qs[i] for i in range(b)]
            width = max(qs[i] - starts[i] + 1 for i in range(b))
            pos = torch.empty(b, width, dtype=torch.long)
            for i in range(b):
                n = qs[i] - starts[i] + 1
                pos[i, : width - n] = starts[i]  # left padding: duplicates of the first one
                pos[i, width - n :] = torch.arange(starts[i], qs[i] + 1)
                if exit_at[i] is None:
                    evals[i] += (e - a) * n
            pos_dev = pos.to(self.device)
            h = self.hidden[rows[:, None], pos_dev]  # (B, W, D)
            ctx = model.context(pos_dev, cache)
            h = model.run_layers(h, a, e, cache=cache, ctx=ctx)
            live_t = torch.tensor(live, device=self.device)
            self.hidden[live_t[:, None], pos_dev[live_t]] = h[live_t]
            if e == num_layers:
                logits = model.final_logits(h[live_t, -1])
                picks = choose(logits, self.sampling, self.generator).tolist()
                for i, tok in zip(live, picks, strict=True):
                    exit_at[i], chosen[i] = e, tok
                break
            if e in self._block_slot:  # the exit block's own cache slot needs every token
                all_logits = model.exit_logits(h, e, cache=cache, ctx=ctx)[:, -1]
            cand = [i for i in live if not force[i]]
            if not cand:
                continue
            cand_t = torch.tensor(cand, device=self.device)
            if e in self._block_slot:
                logits = all_logits[cand_t]
            else:
                logits = model.exit_logits(h[cand_t, -1], e)
            conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
            go = (conf >= self.threshold).tolist()
            if any(go):
                sel = [j for j, g in enumerate(go) if g]
                picks = choose(logits[sel], self.sampling, self.generator).tolist()
                for j, tok in zip(sel, picks, strict=True):
                    exit_at[cand[j]], chosen[cand[j]] = e, tok
        self._commit(q, fill_old, exit_at)
        return chosen, [int(x) for x in exit_at if x is not None], evals

    def _commit(self, q: torch.Tensor, fill_old: torch.Tensor, exit_at: list[int | None]) -> None:
        """Set ``fill`` after a step: every layer below a sequence's exit now holds positions
        ``0..q_b``; deeper layers (and block-exit slots past the exit) keep their old prefix
        (dummy writes there are ignored)."""
        cache = self.cache
        fill = fill_old.clone()
        for i, e in enumerate(exit_at):
            assert e is not None
            fill[:e, i] = q[i] + 1
            for layer, slot in self._block_slot.items():
                if layer <= e:
                    fill[slot, i] = q[i] + 1
        cache.fill = fill
        cache.lengths = q + 1


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
