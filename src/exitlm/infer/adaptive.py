"""Adaptive self-speculation: choose the draft exit ``E`` and the draft length ``d`` online,
and decode plainly when no choice pays.

LayerSkip (Sec. 4.3) drafts with a fixed exit ``E`` and ``d`` tokens per round; which ``(E, d)``
is fastest depends on the model, the machine, the batch and the text. This module estimates,
per sequence, how often each candidate exit agrees with the final layer, and, per runner, what
a round costs (:class:`~exitlm.runtime.costs.PrimitiveCosts`), and picks the round with the
most expected tokens per second - or a plain step when none beats it (DEL, arXiv 2504.05598,
does the same per round from acceptance statistics gathered on the fly).

**Expected tokens of a round.** With a per-token acceptance rate ``a`` (the probability that a
draft is accepted given the drafts before it were), a round of ``d`` drafts yields
``(1 - a^(d+1)) / (1 - a)`` tokens (Leviathan et al. 2023, Eq. 1): the accepted prefix plus
the verifier's own token.

**Acceptance.** For greedy decoding a draft is accepted when the exit's argmax equals the final
layer's; for sampling the probability is ``sum_x min(p(x), q(x))`` (Leviathan et al. 2023,
Sec. 3.1 / Definition 3.1: ``1 - D_LK(p, q)``). Observations come from three places: the
prompt (the exit's and the final layer's choices at the last prompt positions, measured during
prefill), every self-speculative round (its accepted prefix and the first rejection) and
*probe* steps - plain steps that also read the hidden state at a few candidate exits and
compare the exits' choices with the final layer's (DEL's shadow tokens). Counts decay
(:data:`DECAY`) so that the estimate follows the text.

**Cost of a round** (LayerSkip Sec. 4.3 with a single KV cache): ``d + 1`` steps of the first
``E`` layers (the last draft is fed once more so that verification can start from its exit
query), ``d`` draft heads, and layers ``E..L`` over ``d + 1`` positions plus the final head
(once per checked position where the head is verified lazily, once over all positions
otherwise)::

    T(E, d) = (d + 1) E c(b) + d h_E(b) + (L - E) c(b (d + 1)) + H

(One sequence drafting through a quantized copy of the model,
:mod:`~exitlm.runtime.draft_copy`: the copy's chain, timed on the copy, and all ``L`` layers
over ``d + 1`` positions.)
``c(r)`` is one layer over ``r`` rows and ``h_E(r)`` exit ``E``'s head, both measured on this
machine; a plain step is ``L c(b) + h_L(b)``, and a batch's modelled round is scaled by its
measured plain step over that model (a batch of ``b`` sequences takes other code paths than
``b`` rows of one). Every batch size, one sequence included, decodes plainly until a plain
step was timed: the modelled plain step comes from the same scratch timings as the rounds'
calls, which flatter it (on ``layerskip-code`` 2.4 ms where a step takes 3.3), and rounds,
soon priced from their measured times, lost to it on a fresh process's first prompt; and
one sequence's plain step is timed again after every :data:`PLAIN_RETIME_EVERY` rounds. For one
sequence the round's calls are measured as they are made instead (the chain of ``d`` drafts,
layers ``E..L`` over ``d + 1`` positions): a fused native chain costs far less than its layers
one by one. The times actually taken are tracked too: plain steps replace the modelled plain
cost, a round's measured time replaces the model for rounds of its exit and draft length, and
rounds not yet taken are modelled times the measured/modelled ratio of the rounds that were (the
calls were timed on a small scratch cache, where a chain's weights stay in the processor's
caches between repeats and attention reads few positions: on a 24-layer byte model a chain
through 20 layers took 1.6x its timing once decoding) - from two measured shapes on, a line
``a * modelled + o`` fitted to them instead: the decoder's own work around a round's calls is
a cost per round, which a ratio measured on cheap shallow rounds would overstate for deeper
ones (on an 8-layer byte model rounds at exit 2 took 1.7x their model, at exit 5 1.45x, and
the ratio kept the planner at exit 2, 0.8x the best fixed exit). A tenth of the ratio's excess
over 1 (:data:`RATIO_KEEP`) is forgotten at every probe step, so that rounds not yet taken
are tried again now and then.

The measured step and round times are kept with the costs
(:attr:`~exitlm.runtime.costs.PrimitiveCosts.learned`), which belong to the model and the kind
of runner (:func:`~exitlm.runtime.costs.costs_of`), so that the next engine on the same model -
the next ``generate`` call, which prepares a new runner - starts from them: on an 8-layer byte
model, 96-token generations decoded 1.12x plain decoding when every planner started afresh and
1.32x when each started from the last one's times (``generate(model, ...)`` over 12 prompts,
twice: 1.08-1.11x when each call started afresh, 1.20-1.27x since the costs stay with the
model).

**Within a round** a user's ``draft_threshold`` ends drafting at an unsure draft; an automatic
threshold from costs was tried and dropped: the exits' probabilities are not calibrated to
acceptance (drafts at 97% acceptance were cut to 1.7 per round), so ``d`` is chosen per step.

**A model's measured best round.** A model may name the round measured fastest with its
weights (``exits.draft`` in its config, :class:`~exitlm.config.DraftHint`: a timed sweep of
``(E, d)`` over whole generations of held-out prompts, which a few dozen tokens of one
generation cannot match). The planner then prefers that round: another round is chosen only
when it promises :data:`ANCHOR_MARGIN` times the preferred round's throughput, while plain
steps are weighed against it as against any round, so that a text on which the exit stops
agreeing still falls back to plain decoding. Without it the planner's picks drift with its
estimates, and both lean against deep, long rounds early on: the prompt's agreement is
teacher-forced on human text, while greedy continuations agree more (on ``layerskip-code``
exit 10 agreed with the final layer at 74-85% over prompts and at 90% per draft over its own
continuations), and the modelled cost of a shape not yet taken rests on startup timings that
vary from run to run. On ``layerskip-code`` (its weights of 2026-11-27, before the exits
were distilled; bench's 8 held-out prompts x 64 bytes, one
thread, variants interleaved per prompt, each keeping its own measured times) the planner
alone decoded 1.30-1.47x plain decoding; preferring its recorded E = 10, d = 4 with a margin
of 1.2, 1.33-1.54x, and of 1.5, 1.50-1.57x; fixed rounds there 1.53-1.61x. A preferred
round not yet timed is taken before any other (its modelled cost rests on the same
flattering timings, and a fresh process's first rounds had wandered to exits 4, 7 and 14
until chance brought it back), and while rounds at its exit run, probes come every
:data:`ANCHOR_PROBE_EVERY` rounds (a probe made while another plan runs forgets its
measured time, so that it is tried again): with these and the timed plain step, fresh processes
decoded 1.60x plain decoding where they had decoded 1.53x, fixed rounds at E = 10, d = 4
1.62x (five passes of the 8 prompts, each with fresh models, variants interleaved per
prompt).

**Probing.** While plain steps win, a probe step of one sequence (a batch probes through its
prompts and rounds only) comes every ``probe_every`` steps; the interval doubles (up to
:data:`MAX_PROBE_EVERY`) after every probe that leaves plain steps ahead and returns to
:data:`MIN_PROBE_EVERY` once a round wins, like :class:`~exitlm.infer.threads.ThreadPolicy`
re-measuring now and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from exitlm.runtime.costs import PrimitiveCosts, fit_line

DECAY = 0.97
"""Weight kept by past agreement observations per new one (an effective window of ~33)."""
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0
"""A uniform prior on an exit's acceptance rate (an unseen exit counts as 50%)."""
PROMPT_PROBES = 64
"""Prompt positions (the last ones) whose exits' choices are compared with the final layer's
during prefill."""
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 8, 64
"""Steps between probe steps: the shortest and the longest interval."""
SPEC_PROBE_EVERY = 16
"""Rounds between probe steps while a round wins (the other exits' rates go stale)..."""
ANCHOR_PROBE_EVERY = 64
"""... and while rounds at the model's preferred exit run: another exit displaces it only by
:data:`ANCHOR_MARGIN`, so its rates matter less, while a probe step costs a plain step and a
few heads (on ``layerskip-code``, bench's prompts, probes every 16 rounds cost 2-3% of
self-speculation's throughput against every 64)."""
MARGIN = 1.02
"""A round must promise this much more throughput than a plain step to be chosen..."""
BATCH_MARGIN = 1.15
"""... and this much for a batch, whose rounds are priced from a coarser model."""
PROBE_EXITS = 3
"""Candidate exits read per probe step (in turn): a probe pays a head per exit it reads."""
MAX_AUTO_DRAFT = 8
"""The longest draft the planner considers."""
MAX_CANDIDATES = 8
"""The most exits the planner considers (every-layer models: spread over the depth)."""
TIME_DECAY = 0.8
"""Weight kept by a round's measured time (and the measured/modelled ratio) per new round."""
TIME_CLIP = 1.3
"""A new time enters a running average clipped to within this factor of the average: one
round that the operating system preempted must not price its shape out of the plan (on a
2-core VM a round at exit 10 with 4 drafts was once averaged to 13.3 ms, its usual time
8.7 ms, and the planner left it for the rest of the run)."""
PLAIN_RETIME_EVERY = 64
"""Rounds of one sequence after which a plain step is timed again (before the next round):
rounds are timed whenever they are taken, a plain step only when one is, so without it the
plain time measured once - under whatever load the machine had then - would price plain
steps for the rest of the process."""
RATIO_KEEP = 0.9
"""Share of the measured/modelled ratio's excess over 1 kept at a probe step."""
ANCHOR_MARGIN = 1.5
"""A round other than the model's measured best (its :class:`~exitlm.config.DraftHint`)
must promise this much more throughput than that round to be chosen instead."""


def _average(old: float, new: float) -> float:
    """A running average of times: ``new`` clipped to within :data:`TIME_CLIP` of ``old``,
    weighted ``1 - TIME_DECAY``."""
    new = min(max(new, old / TIME_CLIP), old * TIME_CLIP)
    return TIME_DECAY * old + (1 - TIME_DECAY) * new


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a round of ``drafts`` drafts yields at per-token acceptance ``rate``:
    ``(1 - a^(d+1)) / (1 - a)`` (Leviathan et al. 2023, Eq. 1)."""
    if drafts <= 0:
        return 1.0
    if rate >= 1.0:
        return float(drafts + 1)
    return (1.0 - rate ** (drafts + 1)) / (1.0 - rate)


def candidate_exits(exits: Sequence[int], num_layers: int) -> list[int]:
    """The exits the planner considers: all of ``exits`` when few, else
    :data:`MAX_CANDIDATES` spread evenly over them."""
    exits = sorted(set(exits))
    if len(exits) <= MAX_CANDIDATES:
        return exits
    step = (len(exits) - 1) / (MAX_CANDIDATES - 1)
    return sorted({exits[round(i * step)] for i in range(MAX_CANDIDATES)})


@dataclass
class Agreement:
    """One sequence's decayed agreement counts per candidate exit (see the module docstring)."""

    hits: dict[int, float] = field(default_factory=dict)
    trials: dict[int, float] = field(default_factory=dict)

    def observe(self, exit_layer: int, hits: float, trials: float) -> None:
        """Add ``trials`` observations of ``exit_layer`` of which ``hits`` agreed (fractions
        allowed: sampled acceptance probabilities)."""
        keep = DECAY ** trials
        self.hits[exit_layer] = self.hits.get(exit_layer, 0.0) * keep + hits
        self.trials[exit_layer] = self.trials.get(exit_layer, 0.0) * keep + trials

    def rate(self, exit_layer: int) -> float:
        """The estimated per-token acceptance rate of ``exit_layer``."""
        return ((self.hits.get(exit_layer, 0.0) + PRIOR_HITS)
                / (self.trials.get(exit_layer, 0.0) + PRIOR_TRIALS))


@dataclass(frozen=True)
class Plan:
    """What the next steps do: rounds at ``exit_layer`` with ``drafts[i]`` drafts for row
    ``i`` (``exit_layer is None``: plain steps); ``gain`` is the expected throughput over plain
    steps', ``best_gain`` that of the best round considered (chosen or not)."""

    exit_layer: int | None
    drafts: tuple[int, ...]
    gain: float = 1.0
    best_gain: float = 0.0


class SpecPlanner:
    """Chooses each step of adaptive self-speculation (see the module docstring).

    Args:
        costs: the runner's measured primitive costs.
        num_layers: the model's depth ``L``.
        candidates: exits that may draft.
        vocab: the draft heads' vocabulary (``None``: all).
        lazy_head: verification computes the final head one position at a time.
        max_draft: the longest draft considered.
        anchor: the model's measured best round ``(E, d)``, preferred (see the module
            docstring); ``E`` must be a candidate.
        copy: ``(kind, costs)`` where one sequence drafts through a quantized copy of the
            model (:mod:`~exitlm.runtime.draft_copy`) whose primitives ``costs`` measures:
            its rounds are the copy's chain and all ``L`` layers over ``d + 1`` positions.
    """

    def __init__(self, costs: PrimitiveCosts, num_layers: int, candidates: Sequence[int], *,
                 vocab: int | None, lazy_head: bool, max_draft: int = MAX_AUTO_DRAFT,
                 anchor: tuple[int, int] | None = None,
                 copy: tuple[str, PrimitiveCosts] | None = None) -> None:
        if not candidates:
            raise ValueError("adaptive self-speculation needs at least one candidate exit")
        if anchor is not None and anchor[0] not in candidates:
            raise ValueError(f"the preferred round's exit {anchor[0]} is not a candidate")
        self.anchor = anchor
        self.costs = costs
        self.num_layers = num_layers
        self.candidates = list(candidates)
        self.vocab = vocab
        self.lazy_head = lazy_head
        self.max_draft = max_draft
        self.copy_costs = None if copy is None else copy[1]
        self.probe_every = MIN_PROBE_EVERY
        self.since_probe = 0
        """Steps since the last probe step."""
        self._probe_turn = 0
        # what steps and rounds were measured to take, kept with the model's costs (when
        # they keep it) so that the model's next engines start from it instead of from the
        # cost model alone: a short generation ends before its planner has learned much
        learned = getattr(costs, "learned", None)
        memory: dict[str, dict] = ({} if learned is None
                                   else learned.setdefault(
                                       ("rounds", vocab, lazy_head, copy and copy[0]), {}))
        self._plain: dict[int, float] = memory.setdefault("plain", {})
        self._measured: dict[tuple[int, int, int], float] = memory.setdefault("measured", {})
        """Measured seconds of rounds by (exit, drafts, sequences), the lazy head excluded."""
        self._ratio: dict[int, float] = memory.setdefault("ratio", {})
        """Measured over modelled seconds of rounds, by sequences."""
        self._keep: dict[int, float] = memory.setdefault("keep", {})
        """Share of the fitted correction's excess still applied, by sequences."""
        self._since_plain: list[int] = memory.setdefault("since_plain", [0])
        """Rounds of one sequence since its plain step was last timed."""
        self._version: list[int] = memory.setdefault("version", [0])
        """Bumped by every measured step or round (the fits below are redone after it)."""
        self._fits: dict[int, tuple[int, tuple[float, float] | None]] = {}
        self._fixed: dict[tuple[int, int, int], float] = {}
        self._heads: dict[tuple[int, int], float] = {}

    # ----- costs ------------------------------------------------------------------------------
    def plain_cost(self, b: int) -> float:
        """Seconds of a plain step for ``b`` sequences: measured when steps were timed,
        from the primitives' costs otherwise."""
        if b in self._plain:
            return self._plain[b]
        c, L = self.costs, self.num_layers
        if b == 1:
            return c.chain(L, 0)
        return L * c.layer(b) + c.head(L, b)

    def round_cost(self, exit_layer: int, drafts: int, b: int, tokens: float) -> float:
        """Seconds of a round at ``exit_layer`` with ``drafts`` drafts for ``b`` sequences
        expecting ``tokens`` tokens each (see the module docstring): as measured for rounds
        of this shape, else modelled and corrected by the measured/modelled ratio of past
        rounds. One sequence's round is modelled from its calls as measured (a chain, layers
        over ``d + 1`` positions); a batch's from its layers and heads."""
        key = (exit_layer, drafts, b)
        t = self._measured.get(key)
        if t is None:
            t = self._corrected(self._modelled(exit_layer, drafts, b), b)
        return max(1e-9, t + self._lazy_head(b, tokens))

    def _corrected(self, modelled: float, b: int) -> float:
        """A round not yet taken: its modelled time corrected by the rounds that were. From
        two shapes on, a line ``measured = a * modelled + o`` fitted to them (a round's own
        overhead - the decoder's work around its calls - weighs most on the cheapest rounds,
        which a ratio would carry over to dearer ones as a factor); else their
        measured/modelled ratio. Either correction's excess is forgotten at probes as the
        ratio's is (:meth:`probed`)."""
        got = self._fits.get(b)
        if got is None or got[0] != self._version[0]:
            got = self._fits[b] = (self._version[0], self._fit(b))
        fit = got[1]
        if fit is None:
            return modelled * self._ratio.get(b, 1.0)
        a, o = fit
        return modelled + self._keep.get(b, 1.0) * ((a - 1.0) * modelled + o)

    def _fit(self, b: int) -> tuple[float, float] | None:
        """Least-squares ``(a, o)`` of measured against modelled round times of ``b``
        sequences, from at least two shapes a tenth or more apart; None otherwise, or for a
        line that is not a cost: ``a <= 0``, or a negative overhead per round ``o < 0``. Such
        a line comes from a few rounds of nearby shapes whose noise tilts it: on the 24-layer
        ``layerskip-code``, rounds measured at exits 1 and 4 only (modelled 2.8-3.4 ms, measured
        5.4-7.4) gave ``a = 2.8, o = -2.7 ms``, which priced a round at exit 10 with 4 drafts
        at 13.5 ms (it takes 8.5-9.8) and kept the planner at exits 1-4 (1.37x plain decoding
        where exit 10 gives 1.62x); the ratio of measured to modelled times prices it at
        10.3 ms instead."""
        pts = [(self._modelled(*k), t) for k, t in self._measured.items() if k[2] == b]
        xs = [x for x, _ in pts]
        if len(pts) < 2 or max(xs) < 1.1 * min(xs):
            return None
        line = fit_line(pts)
        if line is None or line[1] <= 0 or line[0] < 0:
            return None
        return line[1], line[0]

    def _modelled(self, e: int, d: int, b: int) -> float:
        """The primitives' seconds of a round, without the lazily verified head."""
        c, L = self.costs, self.num_layers
        key = (e, d, b)
        t = self._fixed.get(key)
        if t is None:
            if b == 1 and self.copy_costs is not None:
                t = self.copy_costs.chain(e, d, self.vocab) + c.layers(0, d + 1)
            elif b == 1:
                t = c.chain(e, d, self.vocab) + c.layers(e, d + 1)
            else:
                t = ((d + 1) * e * c.layer(b) + d * c.head(e, b, self.vocab)
                     + (L - e) * c.layer(b * (d + 1)))
            if not self.lazy_head:
                t += c.head(L, b * (d + 1))
            self._fixed[key] = t
        if b > 1:  # a batch's steps take other paths than the timed rows: scale them alike
            t *= self._plain[b] / (L * c.layer(b) + c.head(L, b))
        return t

    def _lazy_head(self, b: int, tokens: float) -> float:
        """The final head of a lazy verification: once per checked position."""
        if not self.lazy_head:
            return 0.0
        head = self._heads.get((self.num_layers, b))
        if head is None:
            head = self._heads[(self.num_layers, b)] = self.costs.head(self.num_layers, b)
        return tokens * head

    def plain_timed(self, b: int) -> bool:
        """Whether a plain step for ``b`` sequences was timed - for one sequence, within the
        last :data:`PLAIN_RETIME_EVERY` rounds (otherwise :meth:`plan` plans one)."""
        return b in self._plain and (b > 1 or self._since_plain[0] < PLAIN_RETIME_EVERY)

    def measure_costs(self, drafts: int | None = None) -> None:
        """Time now whatever the plans of one sequence price (the primitives' timings are
        taken on first use, :class:`~exitlm.runtime.costs.PrimitiveCosts`), so that no
        request waits for them: an engine calls this when it starts. ``drafts``: the draft
        length its requests fix (default: the longest the planner considers); a round near
        the end of a budget drafts fewer."""
        self.costs.chain(self.num_layers, 0)
        for e in self.candidates:
            for d in range(1, (drafts or self.max_draft) + 1):
                self._modelled(e, d, 1)
        self._lazy_head(1, 1.0)
        for costs in (self.costs, self.copy_costs):
            if costs is not None:
                costs.persist()  # the next process on this machine reads them

    def timed_plain(self, b: int, seconds: float) -> None:
        """Note the measured time of a plain step for ``b`` sequences."""
        old = self._plain.get(b)
        self._plain[b] = seconds if old is None else _average(old, seconds)
        if b == 1:
            self._since_plain[0] = 0
        self._version[0] += 1

    def timed_round(self, exit_layer: int, drafts: int, b: int, tokens: float,
                    seconds: float) -> None:
        """Note the measured time of a round: it prices later rounds of its shape, and its
        ratio to the modelled time corrects the model of rounds not yet taken."""
        key = (exit_layer, drafts, b)
        fixed = max(1e-9, seconds - self._lazy_head(b, tokens))
        old = self._measured.get(key)
        self._measured[key] = fixed if old is None else _average(old, fixed)
        ratio = fixed / max(1e-9, self._modelled(exit_layer, drafts, b))
        old_ratio = self._ratio.get(b)
        self._ratio[b] = ratio if old_ratio is None else (
            TIME_DECAY * old_ratio + (1 - TIME_DECAY) * ratio)
        self._keep[b] = 1.0
        if b == 1:
            self._since_plain[0] += 1
        self._version[0] += 1

    # ----- choices ----------------------------------------------------------------------------
    def plan(self, rates: Sequence[dict[int, float]], limits: Sequence[int],
             fixed_drafts: Sequence[int | None], exits: Sequence[int] | None = None) -> Plan:
        """The next step for a batch whose row ``i`` has acceptance ``rates[i][E]``, may draft
        at most ``limits[i]`` tokens (its budget) and asked for ``fixed_drafts[i]`` drafts
        (``None``: choose). ``exits`` restricts the exits (default: the candidates). The
        preferred round (``anchor``; with drafts fixed by the caller, any round at its exit)
        yields only to a round promising :data:`ANCHOR_MARGIN` times its throughput, and to
        none before it was timed. Plain steps until one was timed for ``b`` sequences."""
        b = len(limits)
        if not self.plain_timed(b):  # a plain step is timed first (module docstring)
            return Plan(None, (0,) * b)
        plain_rate = b / self.plain_cost(b)
        floor = plain_rate * (MARGIN if b == 1 else BATCH_MARGIN)  # what a round must beat
        fixed = all(f is not None for f in fixed_drafts)
        best: tuple[int, tuple[int, ...], float] | None = None  # the best round by its score
        best_score = top_rate = 0.0
        for e in exits or self.candidates:
            lengths = range(1, self.max_draft + 1)
            if fixed:
                lengths = range(max(f or 0 for f in fixed_drafts),
                                max(f or 0 for f in fixed_drafts) + 1)
            for d in lengths:
                drafts = tuple(min(d if f is None else f, lim)
                               for f, lim in zip(fixed_drafts, limits, strict=True))
                if not any(drafts):
                    continue
                per_row = [expected_tokens(r[e], n) for r, n in zip(rates, drafts, strict=True)]
                tokens = sum(per_row)
                rate = tokens / self.round_cost(e, max(drafts), b, tokens / b)
                top_rate = max(top_rate, rate)
                score = rate
                if self._anchored(e, d, fixed):  # untimed: it is tried before any other
                    score *= ANCHOR_MARGIN if (e, max(drafts), b) in self._measured else 1e9
                if rate > floor and score > best_score:
                    best_score, best = score, (e, drafts, rate)
        top_gain = top_rate / plain_rate
        if best is None:
            return Plan(None, (0,) * b, best_gain=top_gain)
        return Plan(best[0], best[1], best[2] / plain_rate, best_gain=top_gain)

    def _anchored(self, e: int, d: int, fixed: bool) -> bool:
        """Whether the round at exit ``e`` with ``d`` drafts is the preferred one (drafts
        fixed by the caller: any round at its exit)."""
        a = self.anchor
        return a is not None and e == a[0] and (fixed or d == a[1])

    def probe_exits(self) -> list[int]:
        """The candidate exits the next probe step reads: :data:`PROBE_EXITS` of them, in
        turn."""
        n = len(self.candidates)
        if n <= PROBE_EXITS:
            return list(self.candidates)
        start = self._probe_turn % n
        self._probe_turn += PROBE_EXITS
        return sorted(self.candidates[(start + i) % n] for i in range(PROBE_EXITS))

    def probe_due(self, plan: Plan) -> bool:
        """Whether the next step should be a probe step (counts the step)."""
        self.since_probe += 1
        if plan.exit_layer is None:
            every = self.probe_every
        elif self.anchor is not None and plan.exit_layer == self.anchor[0]:
            every = ANCHOR_PROBE_EVERY
        else:
            every = SPEC_PROBE_EVERY
        due = self.since_probe >= every
        if due:
            self.since_probe = 0
        return due

    def probed(self, plan: Plan) -> None:
        """After a probe step and a new plan: while plain steps keep winning, probe less and
        less often; once a round wins, the next probe comes after the usual interval. A tenth
        of the measured/modelled ratio's excess over 1 is forgotten, so that rounds not yet
        taken are put to the test again now and then (shapes already measured keep their
        times) - except the preferred round while another plan runs: its measured time is
        forgotten, so that it is tried again (a slow spell of the machine while it ran must
        not price it out for the rest of the process)."""
        a = self.anchor
        if (a is not None and (plan.exit_layer, max(plan.drafts, default=0)) != a
                and self._measured.pop((a[0], a[1], 1), None) is not None):
            self._version[0] += 1
        for b, r in self._ratio.items():
            self._ratio[b] = 1.0 + RATIO_KEEP * (r - 1.0)
            self._keep[b] = RATIO_KEEP * self._keep.get(b, 1.0)
        if plan.exit_layer is not None:
            self.probe_every = MIN_PROBE_EVERY
        else:
            self.probe_every = min(MAX_PROBE_EVERY, self.probe_every * 2)


__all__ = ["ANCHOR_MARGIN", "ANCHOR_PROBE_EVERY", "DECAY", "PLAIN_RETIME_EVERY", "Agreement",
           "Plan", "SpecPlanner", "candidate_exits", "expected_tokens"]
