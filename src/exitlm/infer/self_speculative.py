"""Self-speculative decoding (LayerSkip Sec. 4.3, pseudo code in App. A.6).

Each round (one :meth:`SelfSpecDecoder.step`), for every sequence of the batch at once:

1. **Self-drafting** (Sec. 4.3.1): starting from the last accepted token ``x0``, draft up to
   ``d`` tokens autoregressively with the first ``E`` layers and exit ``E``.
2. **Self-verification** (Sec. 4.3.2): run layers ``E..L`` once over ``x0, d_1 .. d_n``.
3. **Cache reuse** (Sec. 4.3.3): there is a **single KV cache**: drafting writes layers
   ``1..E`` of every draft token, verification writes layers ``E+1..L`` - nothing is computed
   twice. The **exit-query cache** is the hidden state after layer ``E`` of each draft step
   (``(B, n+1, D)``), from which verification starts; only the last draft, never fed back
   during drafting, needs its first ``E`` layers run before verification.
4. Accept the longest agreeing prefix plus the verifier's own next token (the correction on a
   mismatch, the **bonus token** when every draft passes), and roll the cache back
   (:meth:`~exitlm.model.kv_cache.KVCache.crop`) to the accepted tokens.

Greedy decoding accepts a draft when it equals the final layer's argmax, so the output is
token-identical to plain greedy decoding. Sampling uses speculative rejection sampling
(Leviathan et al. 2023, Chen et al. 2023): accept ``x ~ q`` with probability
``min(1, p(x)/q(x))``, else sample ``norm(max(0, p - q))``; the emitted tokens are then
distributed exactly as plain sampling from ``p`` (draft ``q`` and target ``p`` both go through
the same temperature / top-k / top-p).

Sequences are independent: each drafts its own number of tokens ``n_i`` (its
``num_speculations``, its remaining budget, its ``draft_threshold``), draws from its own
generator, accepts its own prefix and is cropped to it. The batch drafts ``max n_i`` steps;
a sequence past its own ``n_i`` rides along as a dummy whose drafts are neither sampled nor
verified, so what it produces never depends on what else shares the batch.

Per-token exit layers report ``E`` for accepted drafts and ``L`` for the verifier's tokens.

**Quantized drafts.** On a CPU a draft step streams the first ``E`` layers' weights from
memory. With ``draft_weights`` ``int8`` / ``int4`` (or a model whose recorded round names
them), one sequence drafts through a quantized copy of the model
(:mod:`exitlm.runtime.draft_copy`) - a quarter or a fifth of the bytes per draft step - and
verification runs all ``L`` layers over ``x0, d_1 .. d_n`` from their embeddings: the copy's
keys and values at those positions are overwritten with the model's, so the cache, the
acceptance and the output are exactly those above. Step 3's reuse of the first ``E`` layers
is given up for cheaper drafting (``layerskip-code``, ``E = 9``, ``d = 7``, int4: a round's
calls 0.78x the time). Batches draft through the model (the copy's batched chain is not
fused: a batch of 4 decoded 0.88x as fast through it).

**Adaptive rounds.** When the options leave ``exit_layer`` or ``num_speculations`` unset, each
step is chosen online by :class:`~exitlm.infer.adaptive.SpecPlanner`: a round at the exit and
draft length with the most expected tokens per second given each sequence's measured agreement
and this machine's measured costs, a plain step when no round beats it, and now and then a
probe step (a plain step that also compares every candidate exit's choice with the final
layer's). Every kind of step is exact, so the output stays plain decoding's. A batch holding a
sequence that samples from a seed takes fixed rounds (the draft exit ``E`` of a fixed
configuration, ``d`` = 4 unless given): its tokens then depend on the seed only, never on how
fast this machine was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exitlm.config import ConfigError
from exitlm.infer.adaptive import (
    MAX_AUTO_DRAFT,
    PROMPT_PROBES,
    Agreement,
    Plan,
    SpecPlanner,
    candidate_exits,
)
from exitlm.infer.decoder import (
    Batch,
    Decoder,
    Emit,
    Seq,
    first_tokens,
    plain_step,
    prefill_hidden,
    prefilled_offset,
)
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import DecodeStats
from exitlm.infer.sampling import probabilities
from exitlm.infer.strategy_options import (  # noqa: F401 - re-exported
    MAX_SPECULATIONS,
    SelfSpecOptions,
    Speculations,
)
from exitlm.kernels.argmax import argmax
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.costs import costs_of
from exitlm.runtime.draft_copy import draft_runner, unsupported
from exitlm.runtime.runner import Chain, Pick, Runner

DEFAULT_SPECULATIONS = 4
"""``d`` when it is not chosen online (a sharded model, or a fixed draft exit... given)."""
REPLAN_EVERY, BATCH_REPLAN_EVERY = 4, 16
"""Steps a plan is kept while the batch stays the same (planning costs Python time, a batch's
more: every row's rate at every exit and length)."""


@dataclass
class SelfSpecStats(DecodeStats):
    """Per-sequence counters of self-speculative decoding."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    """Steps decoded without drafting (adaptive rounds found no round that pays)."""
    probe_steps: int = 0
    """Plain steps that also measured every candidate exit's agreement."""
    exit_layer_sum: int = 0
    """The draft exits of the rounds, summed (``/ rounds``: the mean exit)."""

    def derived(self) -> dict[str, float]:
        steps = self.rounds + self.plain_steps + self.probe_steps
        return {"acceptance_rate": self.acceptance_rate,
                "tokens_per_round": (self.accepted + self.rounds) / self.rounds
                if self.rounds else 0.0,
                "mean_exit_layer": self.exit_layer_sum / self.rounds if self.rounds else 0.0,
                "mean_drafts": self.drafted / self.rounds if self.rounds else 0.0,
                "plain_share": (self.plain_steps + self.probe_steps) / steps if steps else 0.0}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def describe(self) -> str:
        text = f"acceptance {self.acceptance_rate:.1%}"
        if self.plain_steps or self.probe_steps:
            d = self.derived()
            text += (f", {d['plain_share']:.0%} plain steps" if not self.rounds else
                     f", mean exit {d['mean_exit_layer']:.1f}, mean d "
                     f"{d['mean_drafts']:.1f}, {d['plain_share']:.0%} plain steps")
        return text


def resolve_exit_layer(model: EarlyExitLM, exit_layer: int | None) -> int:
    """The draft exit ``E`` (see :attr:`SelfSpecOptions.exit_layer`), validated; left open,
    the model's measured best (:class:`~exitlm.config.DraftHint`), its deepest exit head, or
    the middle layer of a model that exits at every layer."""
    cfg = model.config
    if exit_layer is None:
        if cfg.exits.draft is not None:
            return cfg.exits.draft.exit_layer
        if cfg.exits.layers:
            return cfg.exits.layers[-1]
        if cfg.exits.every_layer:
            return max(1, model.num_layers // 2)
        raise ConfigError(
            "self-speculative decoding needs an early exit; load the model with exits "
            "(e.g. ExitConfig(every_layer=True)) or use strategy 'ar'"
        )
    if exit_layer >= model.num_layers:
        raise ConfigError(f"exit_layer {exit_layer} is not an early exit; the draft exit must "
                          f"lie in [1, {model.num_layers - 1}]")
    model.exit_route(exit_layer, setting="exit_layer")
    return exit_layer


class SelfSpecDecoder(Decoder):
    """Self-speculative decoding as a step machine (see the module docstring)."""

    name = "self-spec"
    multi_row = True
    stats_type = SelfSpecStats

    def __init__(self, runner: Runner, options: SelfSpecOptions) -> None:
        super().__init__(runner, options)
        model = runner.model
        self.e = resolve_exit_layer(model, options.exit_layer)
        hint = model.config.exits.draft
        self.default_drafts = (hint.num_speculations if hint is not None
                               and hint.exit_layer == self.e else DEFAULT_SPECULATIONS)
        """Drafts per round of fixed rounds left open: the model's measured best at its exit
        (:class:`~exitlm.config.DraftHint`), else :data:`DEFAULT_SPECULATIONS`."""
        vocab = model.config.vocab_size
        self.vocab = vocab if options.draft_vocab is None else min(options.draft_vocab, vocab)
        self.block = model.exit_route(self.e).has_block
        # where a product over several positions costs about one per position (large LM
        # heads on CPU), greedy verification projects one position at a time and stops at
        # the first rejection (_accept_greedy_lazy); elsewhere one product verifies them all
        self.lazy = not runner.supports("batched_head")
        self.draft_weights = self._draft_weights(options)
        self.drafter: Runner | None = (None if self.draft_weights == "model"
                                       else draft_runner(runner, self.draft_weights))
        """The runner of the model's quantized copy that drafts for one sequence
        (:mod:`~exitlm.runtime.draft_copy`), or None: drafts run on the model itself."""
        self.planner = self._planner(options)
        self._plan: Plan | None = None
        self._plan_key: tuple[int, ...] = ()
        self._plan_age = 0

    def _draft_weights(self, options: SelfSpecOptions) -> str:
        """What the drafts of one sequence run on: the option, else the model's recorded
        round's weights where a copy of them can run here, else the model itself. An explicit
        copy that cannot run here is a :class:`~exitlm.config.ConfigError`."""
        wanted = options.draft_weights
        if wanted is None:
            hint = self.model.config.exits.draft
            if hint is None or hint.weights == "model" or unsupported(self.runner, hint.weights):
                return "model"
            return hint.weights
        if wanted != "model":
            reason = unsupported(self.runner, wanted)
            if reason is not None:
                raise ConfigError(f"--draft-weights {wanted}: {reason}")
        return wanted

    def _planner(self, options: SelfSpecOptions) -> SpecPlanner | None:
        """The online chooser of rounds when ``E`` or ``d`` is left open and this runner's
        primitives may be timed (not on a tensor-parallel shard, whose ranks must take the
        same steps); its costs at batch 1 are measured here, before any request."""
        if options.exit_layer is not None and options.num_speculations is not None:
            return None
        if not self.runner.supports("local"):
            return None
        model = self.model
        if options.exit_layer is not None:
            exits = [options.exit_layer]
        else:
            cfg = model.config
            every = range(1, model.num_layers) if cfg.exits.every_layer else cfg.exits.layers
            exits = candidate_exits([e for e in every if e < model.num_layers],
                                    model.num_layers)
        hint = model.config.exits.draft
        anchor = None
        if hint is not None and options.exit_layer is None:
            exits = sorted({*exits, hint.exit_layer})  # the measured best is always a candidate
            anchor = (hint.exit_layer, min(hint.num_speculations, MAX_AUTO_DRAFT))
        exits = [e for e in exits if not model.exit_route(e).has_block]
        if anchor is not None and anchor[0] not in exits:
            anchor = None
        if not exits:
            return None
        self.runner.enable_row_products()
        vocab = None if self.vocab >= model.config.vocab_size else self.vocab
        copy = (None if self.drafter is None
                else (self.draft_weights, costs_of(self.drafter)))
        planner = SpecPlanner(costs_of(self.runner), model.num_layers, exits,
                              vocab=vocab, lazy_head=self.lazy, anchor=anchor, copy=copy)
        planner.measure_costs(options.num_speculations)
        return planner

    def resolved_options(self) -> dict[str, object]:
        out: dict[str, object] = {**super().resolved_options(), "draft_vocab": self.vocab,
                                  "draft_weights": self.draft_weights}
        if self.planner is None:
            return {**out, "exit_layer": self.e,
                    "num_speculations": self.options.num_speculations or self.default_drafts}
        return {**out, "adaptive": True, "candidate_exits": list(self.planner.candidates)}

    def _drafts(self, seq: Seq) -> int:
        """The most drafts a round may hold for ``seq``."""
        d = seq.options.num_speculations
        if d is not None:
            return d
        return MAX_AUTO_DRAFT if self.planner is not None else self.default_drafts

    def _static_drafts(self, seq: Seq) -> int:
        """``seq``'s drafts per round when rounds are not chosen online."""
        return seq.options.num_speculations or self.default_drafts

    def lookahead(self, seq: Seq) -> int:
        return min(self._drafts(seq), seq.remaining) + 1

    @property
    def max_lookahead(self) -> int:
        return MAX_SPECULATIONS + 1

    def prefill_span(self) -> tuple[int | None, tuple[int, ...]]:
        if self.planner is not None:
            return None, tuple(self.planner.candidates)
        return None, (self.e,) if self.block else ()

    def prefill(self, batch: Batch) -> list[Emit]:
        num_layers = self.model.num_layers
        end, exits = self.prefill_span()
        taps: dict[int, torch.Tensor] | None = {} if self.planner is not None else None
        h, lens = prefill_hidden(self.runner, batch, end, exits, taps)
        tokens = first_tokens(self.runner, batch, h, lens, num_layers)
        emits = [Emit([t], [num_layers], num_layers) for t in tokens]
        if taps is not None:
            self._observe_prompts(batch, h, lens, taps)
        return emits

    def step(self, batch: Batch) -> list[Emit]:
        """One step: a round at the fixed ``(E, d)``, or, adaptively, the planner's choice -
        a round, a plain step or a probe step."""
        if self.planner is None or any(_seeded(s) for s in batch.seqs) or (
                self.options.exit_layer is not None
                and all(s.options.num_speculations is not None for s in batch.seqs)):
            # fixed rounds: nothing left to choose, or a seed, which reproduces its tokens
            # only if the rounds do not depend on timings
            limits = [max(0, min(self._static_drafts(s), s.remaining - 1)) for s in batch.seqs]
            return self._round(batch, self.e, limits, observe=self.planner is not None)
        planner, b = self.planner, len(batch)
        plan = self._current_plan(batch)
        if b == 1 and planner.probe_due(plan):  # (a batch's probe costs every row a step)
            emits = self._probe_step(batch)
            self._plan = None
            planner.probed(self._current_plan(batch))
            return emits
        limits = [min(d, max(0, s.remaining - 1)) for d, s in zip(plan.drafts, batch.seqs,
                                                                  strict=True)]
        t0 = time.perf_counter()
        if plan.exit_layer is None or not any(limits):
            # a round with no drafts left in any row's budget is a plain step: taken as one
            # (timing it as a round would price a zero-draft shape no request starts with)
            wanted = not planner.plain_timed(b)
            emits = self._plain_step(batch)
            planner.timed_plain(b, time.perf_counter() - t0)
            if wanted:  # the plan waited for this timing: plan again now
                self._plan = None
            return emits
        emits = self._round(batch, plan.exit_layer, limits, observe=True)
        tokens = sum(len(e.tokens) for e in emits) / b
        planner.timed_round(plan.exit_layer, max(limits), b, tokens, time.perf_counter() - t0)
        return emits

    # ----- adaptive steps ----------------------------------------------------------------------
    def _current_plan(self, batch: Batch) -> Plan:
        """The planner's choice for this batch, kept for :data:`REPLAN_EVERY` steps (a batch:
        ``BATCH_REPLAN_EVERY``) while the batch holds the same sequences. While rounds at the
        model's preferred exit run, a replan weighs only that exit's draft lengths against
        plain steps: the other exits' agreement changes only at probe steps, after which
        (and for a new batch) every exit is weighed again - a full plan costs ~0.7 ms in
        Python, 8% of a round on ``layerskip-code``, and came every four steps."""
        planner = self.planner
        assert planner is not None
        key = tuple(id(s) for s in batch.seqs)
        every = REPLAN_EVERY if len(batch) == 1 else BATCH_REPLAN_EVERY
        if self._plan is None or key != self._plan_key or self._plan_age >= every:
            anchor = planner.anchor
            narrow = (anchor is not None and self._plan is not None and key == self._plan_key
                      and self._plan.exit_layer == anchor[0])
            exits = [anchor[0]] if narrow and anchor is not None else planner.candidates
            states = [self._agreement(s) for s in batch.seqs]
            rates = [{e: st.rate(e) for e in exits} for st in states]
            limits = [max(0, s.remaining - 1) for s in batch.seqs]
            fixed = [s.options.num_speculations for s in batch.seqs]
            self._plan = planner.plan(rates, limits, fixed, exits=exits)
            self._plan_key, self._plan_age = key, 0
        self._plan_age += 1
        return self._plan

    @staticmethod
    def _agreement(seq: Seq) -> Agreement:
        if seq.state is None:
            seq.state = Agreement()
        return seq.state

    def _plain_step(self, batch: Batch) -> list[Emit]:
        """A plain decoding step (no draft): plain decoding's own step, whose greedy tokens
        may come from the head's screened argmax (:func:`plain_step`)."""
        num_layers = self.model.num_layers
        tokens = plain_step(self.runner, batch, num_layers)
        for s in batch.seqs:
            s.stats.plain_steps += 1  # type: ignore[attr-defined]
        return [Emit([t], [num_layers], num_layers) for t in tokens]

    def _probe_step(self, batch: Batch) -> list[Emit]:
        """A plain step that also reads some candidate exits' choices for this position
        (:meth:`SpecPlanner.probe_exits`) and compares them with the final layer's (DEL's
        shadow tokens)."""
        assert self.planner is not None
        runner, cache = self.runner, batch.cache
        num_layers = self.model.num_layers
        pos = cache.lengths.to(self.device)[:, None]
        h = runner.embed(batch.lasts(self.device), pos)
        drafts: dict[int, torch.Tensor] = {}
        for layer, h_at, ctx in runner.walk(h, 0, num_layers, self.planner.probe_exits(), pos,
                                            cache):
            if layer < num_layers:
                drafts[layer] = runner.logits(h_at[:, 0], layer, vocab=self.vocab, ctx=ctx)
            h = h_at
        cache.lengths += 1
        final = runner.logits(h[:, 0], num_layers)
        tokens = batch.choose(final)
        self._observe(batch, final, drafts)
        for s in batch.seqs:
            s.stats.probe_steps += 1  # type: ignore[attr-defined]
        return [Emit([t], [num_layers], num_layers) for t in tokens]

    def _observe(self, batch: Batch, final: torch.Tensor, drafts: dict[int, torch.Tensor],
                 rows: list[int] | None = None) -> None:
        """Agreement of each exit's logits ``drafts[E]`` ``(R, N)`` with the final layer's
        ``final`` ``(R, V)``, row ``r`` belonging to sequence ``rows[r]`` (default: row
        ``r``): greedy rows count argmax equality, sampled rows the probability
        ``sum_x min(p(x), q(x))`` that rejection sampling accepts a draft (Leviathan et al.
        2023, Sec. 3.1)."""
        rows = list(range(final.shape[0])) if rows is None else rows
        target = argmax(final)
        sampled: dict[SamplingOptions, list[int]] = {}
        for r, i in enumerate(rows):
            s = batch.seqs[i].sampling
            if not s.greedy:
                sampled.setdefault(s, []).append(r)
        seqs = [self._agreement(batch.seqs[i]) for i in rows]
        for e, logits in drafts.items():
            drafted = self.runner.draft_tokens(argmax(logits), self.vocab)
            hits = (drafted == target).to(torch.float32)
            for sampling, rs in sampled.items():
                idx = torch.tensor(rs, device=final.device)
                p = probabilities(final[idx], sampling)
                q = self.runner.draft_distribution(probabilities(logits[idx], sampling),
                                                   self.vocab)
                hits[idx] = torch.minimum(p, q).sum(dim=-1).to(torch.float32)
            for st, hit in zip(seqs, hits.tolist(), strict=True):
                st.observe(e, hit, 1.0)

    def _observe_prompts(self, batch: Batch, h: torch.Tensor, lens: torch.Tensor,
                         taps: dict[int, torch.Tensor]) -> None:
        """Agreement of the candidate exits with the final layer over the last
        :data:`PROMPT_PROBES` prompt positions of every sequence (one product per exit)."""
        rows, cols = [], []
        held = prefilled_offset(h, lens)  # positions a chunked prefill wrote before
        for i, n in enumerate(lens.tolist()):
            for p in range(max(held, n - PROMPT_PROBES), n):
                rows.append(i)
                cols.append(p - held)
        r = torch.tensor(rows, device=self.device)
        c = torch.tensor(cols, device=self.device)
        final = self.runner.logits(h[r, c], self.model.num_layers)
        drafts = {e: self.runner.logits(taps[e][r, c], e, vocab=self.vocab) for e in taps}
        self._observe(batch, final, drafts, rows)

    # ----- a round ------------------------------------------------------------------------------
    def _round(self, batch: Batch, e: int, limits: list[int], observe: bool = False
               ) -> list[Emit]:
        """One round at exit ``e`` with at most ``limits[i]`` drafts for row ``i``: draft (a
        chain through layers ``1..E`` and exit ``E``), verify (layers ``E+1..L`` over the exit
        queries), accept, roll back; with ``observe``, the accepted prefixes update the rows'
        agreement estimates. One sequence with a quantized copy (:attr:`drafter`) drafts
        through the copy instead and is verified through all ``L`` layers from its tokens'
        embeddings, which replaces every key and value the copy wrote."""
        runner, cache = self.runner, batch.cache
        drafter = self.drafter if self.drafter is not None and len(batch) == 1 else runner
        counts = list(limits)
        q_probs: dict[int, list[torch.Tensor]] = {i: [] for i, s in enumerate(batch.seqs)
                                                  if not s.sampling.greedy}
        base = cache.lengths.to(self.device)  # (B,) position of x0
        pick, stop = self._picker(batch, counts, q_probs)
        x0 = batch.lasts(self.device)
        drafts = drafter.chain(x0[:, 0], cache, max(limits), e, vocab=self.vocab, pick=pick,
                               stop_below=stop)
        n = drafts.tokens.shape[1]
        counts = [min(c, n) for c in counts]  # a chain may have stopped early
        pos = base[:, None] + torch.arange(n + 1, device=self.device)[None, :]  # (B, n+1)
        if drafter is runner:  # the exit queries and the first E layers' cache are exact
            hv = runner.layers(drafts.hidden, e, self.model.num_layers, pos, cache)
        else:
            h0 = runner.embed(torch.cat([x0, drafts.tokens], 1), pos)
            hv = runner.layers(h0, 0, self.model.num_layers, pos, cache)
        accepted, final = self._accept(batch, drafts, counts, q_probs, hv)
        self._record_logprobs(batch, drafts, hv, accepted, final)
        keep = cache.lengths + 1 + torch.tensor(accepted)  # x0 and the accepted drafts
        cache.lengths = keep
        cache.crop(keep)
        if observe:
            for s, a, k in zip(batch.seqs, accepted, counts, strict=True):
                if k:
                    self._agreement(s).observe(e, float(a), float(a + (a < k)))
        copied = e if drafter is not runner else 0  # the copy's layers run besides L
        return [self._emit(s, drafts, e, counts[i], i, a, f, copied) for i, (s, a, f) in
                enumerate(zip(batch.seqs, accepted, final, strict=True))]

    # ----- the parts of a round ------------------------------------------------------------
    def _picker(self, batch: Batch, counts: list[int], q_probs: dict[int, list[torch.Tensor]]
                ) -> tuple[Pick | None, float | None]:
        """How drafts are chosen (Sec. 4.3.1): the argmax (``None``: any runner's own greedy
        chain) unless a row samples or has a draft threshold; then :meth:`_pick`. One greedy
        row's draft threshold is the chain's own ``stop_below`` (the runner's fused chain
        takes it), returned second."""
        taus = [s.options.draft_threshold for s in batch.seqs]
        if not q_probs and all(t is None for t in taus):
            return None, None
        if not q_probs and len(batch) == 1:
            return None, taus[0]

        def pick(j: int, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
            return self._pick(batch, logits, j, counts, q_probs), max(counts)

        return pick, None

    def _pick(self, batch: Batch, logits: torch.Tensor, j: int, counts: list[int],
              q_probs: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """Draft token ``j`` of every row from the exit's logits ``(B, N)``: argmax, or a
        sample from the row's own generator while it still drafts; a row whose own draft
        threshold is not met stops drafting after this token. Rows past their own count ride
        along (their drafts are neither sampled nor verified)."""
        tok = argmax(logits)  # columns of the draft vocabulary
        for i, s in enumerate(batch.seqs):
            if j >= counts[i]:
                continue
            tau = s.options.draft_threshold
            if i in q_probs:
                q = probabilities(logits[i : i + 1], s.sampling)
                tok[i] = torch.multinomial(q, 1, generator=s.generator)[0, 0]
                q_probs[i].append(self.runner.draft_distribution(q, self.vocab))
                conf = float(q[0, tok[i]]) if tau is not None else 1.0
            else:
                conf = float(torch.softmax(logits[i].float(), -1).max()) if tau is not None \
                    else 1.0
            if tau is not None and j + 1 < counts[i] and conf < tau:
                counts[i] = j + 1  # verify this unsure draft, draft no further
        return self.runner.draft_tokens(tok, self.vocab)

    def _accept(self, batch: Batch, drafts: Chain, counts: list[int],
                q_probs: dict[int, list[torch.Tensor]], hv: torch.Tensor
                ) -> tuple[list[int], list[int]]:
        """Accepted drafts and the verifier's token of every row: greedy rows by argmax
        agreement, sampled rows by rejection sampling with their own generator."""
        b = len(batch)
        final_head = self._final_logits
        if b == 1 and not q_probs and not self.lazy:  # one greedy row: few small tensor ops
            k = counts[0]
            target = argmax(final_head(hv[0, : k + 1])).tolist()
            toks = drafts.tokens[0, :k].tolist()
            a = 0
            while a < k and toks[a] == target[a]:
                a += 1
            return [a], [target[a]]
        accepted, final = [0] * b, [0] * b
        greedy = [i for i in range(b) if i not in q_probs]
        if greedy:
            g = torch.tensor(greedy, device=self.device)
            limit = torch.tensor([counts[i] for i in greedy], device=self.device)
            accept = _accept_greedy_lazy if self.lazy else _accept_greedy
            a, f = accept(final_head, drafts.tokens[g], hv[g], limit)
            for i, ai, fi in zip(greedy, a.tolist(), f.tolist(), strict=True):
                accepted[i], final[i] = ai, fi
        for i, qs in q_probs.items():
            s, k = batch.seqs[i], counts[i]
            p = probabilities(final_head(hv[i, : k + 1]), s.sampling)  # (k+1, V)
            q = torch.cat(qs, 0)[None] if qs else p.new_zeros(1, 0, p.shape[-1])
            a, f = _accept_sampled(drafts.tokens[i : i + 1, :k], q, p[None], s.generator)
            accepted[i], final[i] = int(a[0]), int(f[0])
        return accepted, final

    def _final_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.runner.logits(h, self.model.num_layers)

    def _record_logprobs(self, batch: Batch, drafts: Chain, hv: torch.Tensor,
                         accepted: list[int], final: list[int]) -> None:
        """Log-probabilities of the emitted tokens under the verifier (the final layer), for
        the sequences that want them: accepted drafts are the target model's tokens."""
        for i, s in enumerate(batch.seqs):
            if s.wants_logprobs:
                a = accepted[i]
                tokens = [*drafts.tokens[i, :a].tolist(), final[i]]
                batch.record(self._final_logits(hv[i, : a + 1]), tokens, [i] * (a + 1))

    def _emit(self, seq: Seq, drafts: Chain, e: int, n_i: int, i: int, a: int, final: int,
              copied: int = 0) -> Emit:
        """The round's tokens and stats for row ``i``; layer evaluations: ``L`` per position
        (drafting ``E`` + verification ``L - E``), plus ``copied`` per position for drafts
        through a quantized copy (its layers counted like the model's, though cheaper)."""
        st: SelfSpecStats = seq.stats  # type: ignore[assignment]
        st.rounds += 1
        st.drafted += n_i
        st.accepted += a
        st.exit_layer_sum += e
        toks = drafts.tokens[i, :a].tolist()
        num_layers = self.model.num_layers
        return Emit([*toks, final], [e] * a + [num_layers], (n_i + 1) * (num_layers + copied))


FinalHead = Callable[[torch.Tensor], torch.Tensor]


def _seeded(seq: Seq) -> bool:
    """Whether ``seq`` samples from a seed (its tokens must not depend on timings)."""
    return not seq.sampling.greedy and seq.sampling.seed is not None


def _accept_greedy(head: FinalHead, drafts: torch.Tensor, hv: torch.Tensor,
                   limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the number of leading drafts (at most ``limit`` per row) equal to
    the final layer's argmax over ``hv`` ``(R, n+1, D)``, and the final layer's token right
    after them (correction or bonus) ``(R,)`` each."""
    return _agreement(drafts, argmax(head(hv)), limit)


def _agreement(drafts: torch.Tensor, target: torch.Tensor, limit: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The number of leading drafts ``(R, n)`` (at most ``limit`` per row) equal to the final
    layer's tokens ``target`` ``(R, n+1)``, and the final layer's token right after them."""
    n = drafts.shape[1]
    inside = torch.arange(n, device=drafts.device)[None, :] < limit[:, None]
    agree = ((drafts == target[:, :n]) & inside).to(torch.long)
    n_acc = agree.cumprod(dim=1).sum(dim=1)  # (R,)
    return n_acc, target.gather(1, n_acc[:, None])[:, 0]


def _accept_greedy_lazy(head: FinalHead, drafts: torch.Tensor, hv: torch.Tensor,
                        limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_accept_greedy` computing the final logits one draft position at a time, only
    for the rows whose drafts all passed so far: the LM head (the largest matrix of a small
    model) then runs ``accepted + 1`` times instead of ``d + 1``. Same result."""
    r, n = drafts.shape
    n_acc = torch.zeros(r, dtype=torch.long, device=drafts.device)
    final = torch.zeros(r, dtype=torch.long, device=drafts.device)
    alive = torch.arange(r, device=drafts.device)
    for j in range(n + 1):
        target = argmax(head(hv[alive, j]))  # (R',)
        ok = (target == drafts[alive, j]) & (limit[alive] > j) if j < n else \
            torch.zeros_like(target, dtype=torch.bool)
        stop = ~ok
        n_acc[alive[stop]] = j
        final[alive[stop]] = target[stop]
        alive = alive[ok]
        if alive.numel() == 0:
            break
    return n_acc, final


def _accept_sampled(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    ``drafts`` ``(R, n)`` were drawn from ``q`` ``(R, n, V)``; ``p`` ``(R, n+1, V)`` is the
    target. Draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the
    first rejection the token is drawn from ``norm(max(0, p_j - q_j))``; when all pass, the
    bonus token is drawn from ``p_n``. Returns accepted counts and the final tokens ``(R,)``.
    """
    r, n = drafts.shape
    if n == 0:
        return (torch.zeros(r, dtype=torch.long, device=drafts.device),
                torch.multinomial(p[:, 0], 1, generator=generator)[:, 0])
    px = p[:, :n].gather(2, drafts[..., None])[..., 0]  # (R, n)
    qx = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(r, n, generator=generator, device=drafts.device)
    ok = (u * qx < px).to(torch.long)  # accept with probability min(1, p/q)
    n_acc = ok.cumprod(dim=1).sum(dim=1)  # (R,)
    rows = torch.arange(r, device=drafts.device)
    p_at = p[rows, n_acc]  # (R, V): target at the first rejection (or the bonus position)
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_acc]  # 0 for the bonus
    residual = (p_at - q_at).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; any rejection then has probability 0, so fall
    # back to p itself (never reached in exact arithmetic, guards rounding).
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    final = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n_acc, final

