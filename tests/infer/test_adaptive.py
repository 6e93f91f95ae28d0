"""Adaptive self-speculation: the planner's arithmetic and choices on given costs, agreement
estimates, and the decoder's steps - rounds at chosen exits, plain steps, probe steps - all
giving plain decoding's tokens (greedy) or its distribution (sampling)."""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref
from collections.abc import Iterator

import pytest
import torch

from _ee_models import chi_square, ee_model, exact_joint, one_thread, random_prompts  # noqa: F401
from exitlm.config import DraftHint
from exitlm.infer import Engine, SamplingOptions, adaptive, generate
from exitlm.infer.adaptive import (
    ANCHOR_MARGIN,
    MAX_PROBE_EVERY,
    MIN_PROBE_EVERY,
    PLAIN_RETIME_EVERY,
    Agreement,
    Plan,
    SpecPlanner,
    candidate_exits,
    expected_tokens,
)
from exitlm.infer.strategies import get_strategy
from exitlm.runtime import prepare
from exitlm.runtime.costs import PrimitiveCosts, costs_of, fit_line

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


class FakeCosts:
    """Primitive costs given by formula: a layer costs ``base + per_row * rows``, a head
    ``head`` per row, a chain and layers what their layers and heads cost."""

    def __init__(self, base: float = 1.0, per_row: float = 0.05, head: float = 0.5,
                 num_layers: int = 8) -> None:
        self.base, self.per_row, self.head_s = base, per_row, head
        self.num_layers = num_layers

    def layer(self, rows: int) -> float:
        return self.base + self.per_row * rows

    def head(self, layer: int, rows: int, vocab: int | None = None) -> float:
        return self.head_s * rows

    def chain(self, depth: int, n: int, vocab: int | None = None) -> float:
        if n == 0:
            return depth * self.layer(1) + self.head(depth, 1)
        return (n + 1) * depth * self.layer(1) + n * self.head(depth, 1)

    def layers(self, start: int, positions: int) -> float:
        return (self.num_layers - start) * self.layer(positions)

    def close(self) -> None:
        pass


def _planner(costs: FakeCosts, exits: tuple[int, ...] = (2, 4, 6), layers: int = 8,
             anchor: tuple[int, int] | None = None) -> SpecPlanner:
    """A planner whose plain step was timed at its modelled cost (before that, it plans plain
    steps only)."""
    planner = SpecPlanner(costs, layers, exits, vocab=None, lazy_head=True,  # type: ignore
                          anchor=anchor)
    planner.timed_plain(1, planner.plain_cost(1))
    return planner


def test_expected_tokens_is_leviathan_eq_1() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.9, 0) == 1.0
    # a simulation of rounds with independent acceptances agrees
    gen = torch.Generator().manual_seed(0)
    ok = torch.rand(20000, 3, generator=gen) < 0.7
    tokens = ok.to(torch.long).cumprod(dim=1).sum(dim=1) + 1
    assert float(tokens.float().mean()) == pytest.approx(expected_tokens(0.7, 3), rel=0.02)


def test_agreement_prior_and_decay() -> None:
    a = Agreement()
    assert a.rate(3) == 0.5
    for _ in range(200):
        a.observe(3, 1.0, 1.0)
    assert a.rate(3) > 0.95
    for _ in range(200):
        a.observe(3, 0.0, 1.0)  # the text changed: the estimate follows
    assert a.rate(3) < 0.05
    a.observe(5, 3.0, 4.0)
    assert 0.5 < a.rate(5) < 1.0


def test_candidate_exits_spread_over_the_depth() -> None:
    assert candidate_exits([12, 20], 30) == [12, 20]
    many = candidate_exits(list(range(1, 30)), 30)
    assert len(many) == 8 and many[0] == 1 and many[-1] == 29


def test_planner_picks_plain_steps_when_rounds_do_not_pay() -> None:
    planner = _planner(FakeCosts())
    low = [{2: 0.1, 4: 0.2, 6: 0.3}]
    plan = planner.plan(low, [30], [None])
    assert plan.exit_layer is None and plan.drafts == (0,)
    assert 0 < plan.best_gain < 1


def test_planner_picks_the_round_with_most_tokens_per_second() -> None:
    planner = _planner(FakeCosts())
    rates = [{2: 0.95, 4: 0.97, 6: 0.99}]
    plan = planner.plan(rates, [30], [None])
    assert plan.exit_layer is not None and plan.drafts[0] > 1 and plan.gain > 1.2
    # brute force over the same grid with the same cost model
    best = max(((e, d) for e in (2, 4, 6) for d in range(1, 9)),
               key=lambda ed: expected_tokens(rates[0][ed[0]], ed[1])
               / planner.round_cost(ed[0], ed[1], 1, expected_tokens(rates[0][ed[0]], ed[1])))
    assert (plan.exit_layer, plan.drafts[0]) == best
    # a row's budget caps its drafts; a fixed d is kept
    assert planner.plan(rates, [2], [None]).drafts == (2,)
    assert planner.plan(rates, [30], [3]).drafts == (3,)


def test_planner_follows_measured_times() -> None:
    planner = _planner(FakeCosts())
    rates = [{2: 0.8, 4: 0.85, 6: 0.9}]
    assert planner.plan(rates, [30], [None]).exit_layer is not None
    # rounds took ten times what the model said: plain steps win from now on
    plan = planner.plan(rates, [30], [None])
    assert plan.exit_layer is not None
    modelled = planner.round_cost(plan.exit_layer, plan.drafts[0], 1, 2.0)
    for _ in range(20):
        planner.timed_round(plan.exit_layer, plan.drafts[0], 1, 2.0, 10 * modelled)
    assert planner.plan(rates, [30], [None]).exit_layer is None
    # plain steps measured slower than modelled make rounds pay again
    for _ in range(80):  # (each new time enters clipped to TIME_CLIP of the average)
        planner.timed_plain(1, 100.0)
    assert planner.plan(rates, [30], [None]).exit_layer is not None


def test_measured_rounds_price_their_shape_and_scale_the_untried_ones() -> None:
    """A round's measured time prices its own (E, d) from then on; the other shapes are
    modelled times the measured/modelled ratio, of which a probe forgets only a tenth - so a
    model timed too optimistically (a scratch cache, hot caches) does not send the planner back
    to losing rounds after every probe."""
    planner = _planner(FakeCosts())
    rates = [{2: 0.8, 4: 0.85, 6: 0.9}]
    plan = planner.plan(rates, [30], [None])
    e, d = plan.exit_layer, plan.drafts[0]
    assert e is not None
    tokens = expected_tokens(rates[0][e], d)
    head = planner.round_cost(e, d, 1, tokens) - planner.round_cost(e, d, 1, 0.0)  # lazy head
    modelled = planner.round_cost(e, d, 1, 0.0)
    planner.timed_round(e, d, 1, tokens, 3 * modelled + head)
    assert planner.round_cost(e, d, 1, 0.0) == pytest.approx(3 * modelled)
    other = next((x, y) for x in (2, 4, 6) for y in range(1, 9) if (x, y) != (e, d))
    before = planner._modelled(*other, 1)
    assert planner.round_cost(*other, 1, 0.0) == pytest.approx(3 * before)
    assert planner.plan(rates, [30], [None]).exit_layer is None  # nothing pays at 3x
    planner.probed(planner.plan(rates, [30], [None]))
    assert planner.round_cost(*other, 1, 0.0) == pytest.approx(before * (1 + 0.9 * 2))
    assert planner.round_cost(e, d, 1, 0.0) == pytest.approx(3 * modelled)  # measured: kept
    assert planner.plan(rates, [30], [None]).exit_layer is None


def test_two_measured_shapes_fit_a_per_round_overhead() -> None:
    """From two measured shapes on, untried rounds are priced by the line through measured
    against modelled times: a fixed overhead per round (the decoder's own work) carries over
    as an overhead, not as a factor that would overprice deeper rounds; probes forget its
    excess as they forget the ratio's."""
    planner = _planner(FakeCosts())
    shapes = [(2, 1), (2, 4)]
    for e, d in shapes:
        planner.timed_round(e, d, 1, 0.0, planner._modelled(e, d, 1) + 5.0)
    deep = planner._modelled(6, 3, 1)
    assert planner.round_cost(6, 3, 1, 0.0) == pytest.approx(deep + 5.0)
    ratio = planner._ratio[1]
    assert deep * ratio > deep + 5.0 + 1e-6  # what the ratio alone would have said
    planner.probed(planner.plan([{2: 0.8, 4: 0.85, 6: 0.9}], [30], [None]))
    assert planner.round_cost(6, 3, 1, 0.0) == pytest.approx(deep + 0.9 * 5.0)


def test_planners_of_one_runner_start_from_what_the_last_one_measured() -> None:
    """The measured step and round times live with the runner's costs: the next engine's
    planner (a new generation) prices rounds from them at once."""
    costs = FakeCosts()
    costs.learned = {}  # type: ignore[attr-defined]
    first = SpecPlanner(costs, 8, (2, 4, 6), vocab=None, lazy_head=True)  # type: ignore
    first.timed_plain(1, 7.0)
    first.timed_round(4, 2, 1, 0.0, 42.0)
    second = _planner(costs)
    assert second.plain_cost(1) == 7.0
    assert second.round_cost(4, 2, 1, 0.0) == pytest.approx(42.0)
    other = SpecPlanner(costs, 8, (2, 4, 6), vocab=16, lazy_head=True)  # type: ignore[arg-type]
    assert other.round_cost(4, 2, 1, 0.0) != pytest.approx(42.0)  # another draft head


def test_costs_belong_to_the_model_and_kind_of_runner_not_to_one_runner() -> None:
    """A new ``generate(model, ...)`` prepares a new runner: its costs - what was measured
    and learned - are the last runner's of that model and kind, and they keep neither the
    model nor a runner alive."""
    from exitlm.kernels.quantized import quantize_model

    model = ee_model(every_layer=True)
    first = costs_of(prepare(model))
    generate(model, None, [[3, 5, 7, 9]], strategy="self-spec", max_new_tokens=12,
             ignore_eos=True)
    runner = prepare(model)
    again = costs_of(runner)
    assert again is first and again.runner is runner
    assert again.learned  # the generation's planner left its measured times
    assert costs_of(prepare(model, backend="static")) is not first  # another kind of runner
    quantize_model(model, "int8")
    assert costs_of(prepare(model)) is not first  # other modules
    gone = weakref.ref(model)
    del model, runner
    gc.collect()
    assert gone() is None


def test_probe_interval_backs_off_and_returns() -> None:
    planner = _planner(FakeCosts())
    far = planner.plan([{2: 0.0, 4: 0.0, 6: 0.0}], [30], [None])
    for _ in range(10):
        planner.probed(far)
    assert planner.probe_every == MAX_PROBE_EVERY
    steps = [planner.probe_due(far) for _ in range(MAX_PROBE_EVERY)]
    assert steps.count(True) == 1 and steps[-1]
    close = planner.plan([{2: 0.99, 4: 0.99, 6: 0.99}], [30], [None])
    planner.probed(close)
    assert planner.probe_every == MIN_PROBE_EVERY


def test_primitive_costs_are_measured_once_per_shape() -> None:
    model = ee_model(every_layer=True)
    costs = PrimitiveCosts(prepare(model, backend="eager"))
    one = costs.layer(1)
    assert one > 0 and costs.layer(1) == one
    spent = costs.measured_s
    three = costs.layer(3)  # between the measured 2 and 4 rows
    assert min(costs.layer(2), costs.layer(4)) <= three <= max(costs.layer(2), costs.layer(4))
    assert costs.head(4, 1) > 0 and costs.head(2, 1, vocab=7) > 0
    assert costs.measured_s > spent
    # chains: measured at two lengths, linear in between
    c1, c8 = costs.chain(2, 1), costs.chain(2, 8)
    assert costs.chain(2, 4) == pytest.approx(c1 + (c8 - c1) * 3 / 7)
    assert costs.chain(4, 0) > 0 and costs.layers(2, 3) > 0
    before = costs.measured_s
    costs.chain(2, 5)
    costs.layers(2, 3)
    assert costs.measured_s == before  # nothing new measured
    costs.close()


# ----- the decoder -----------------------------------------------------------------------------

@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Replace measured costs by :class:`FakeCosts` (set on the returned holder) and ignore
    measured times, so that the planner's choices do not depend on the machine."""

    class Holder:
        costs = FakeCosts()

    def fake(name: str) -> None:
        def call(self: PrimitiveCosts, *args: object, **kw: object) -> float:
            Holder.costs.num_layers = self.num_layers
            return getattr(Holder.costs, name)(*args, **kw)

        monkeypatch.setattr(PrimitiveCosts, name, call)

    for name in ("layer", "head", "chain", "layers"):
        fake(name)
    def counted_round(self: SpecPlanner, e: int, d: int, b: int, *args: object) -> None:
        self._since_plain[0] += b == 1  # (the plain step's re-timing counts rounds)

    def modelled_plain(self: SpecPlanner, b: int, seconds: float) -> None:
        self._plain[b] = self.num_layers * self.costs.layer(b) + self.costs.head(
            self.num_layers, b)
        if b == 1:
            self._since_plain[0] = 0

    monkeypatch.setattr(SpecPlanner, "timed_round", counted_round)

    monkeypatch.setattr(SpecPlanner, "timed_plain", modelled_plain)
    yield Holder


def _perfect_draft_model() -> torch.nn.Module:
    """Layers 3 and 4 are identities, so exit 2 equals the final output: every draft passes."""
    model = ee_model(every_layer=True)
    with torch.no_grad():
        for i in (2, 3):
            model.layers[i].attn.wo.weight.zero_()
            model.layers[i].mlp.w_out.weight.zero_()
    return model


@pytest.mark.parametrize("backend", ["eager", "native", "static"])
def test_rounds_at_the_agreeing_exit(forced: object, backend: str) -> None:
    from exitlm.kernels import native

    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    forced.costs = FakeCosts(base=1.0, per_row=0.05, head=0.05)  # type: ignore[attr-defined]
    model = _perfect_draft_model()
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW)
    got = generate(prepare(model, backend=backend), None, prompts, strategy="self-spec",
                   max_new_tokens=NEW)
    assert got.token_ids == ar.token_ids
    st = got.stats
    assert st.rounds > 0 and st.acceptance_rate > 0.9
    assert st.derived()["mean_drafts"] > 1
    # exit 2 agrees as well as 3 and costs less: the planner drafts there
    assert st.derived()["mean_exit_layer"] == pytest.approx(2.0, abs=0.5)
    assert got.options["adaptive"] is True


def test_a_fresh_models_first_step_is_a_timed_plain_step(
        forced: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first generation on a model times a plain step before its first round (the
    planner's plain cost is then measured, not modelled); the next generation starts from
    that time and drafts at once. Both give plain decoding's tokens."""
    forced.costs = FakeCosts(base=1.0, per_row=0.05, head=0.05)  # type: ignore[attr-defined]
    model = _perfect_draft_model()
    prompt = random_prompts()[0]
    L = model.num_layers
    first = generate(model, None, prompt, strategy="self-spec", max_new_tokens=NEW)
    assert first.sequences[0].exit_layers[:2] == [L, L]  # prefill's token, then a plain step
    assert first.stats.plain_steps == 1 and first.stats.rounds > 0
    again = generate(model, None, prompt, strategy="self-spec", max_new_tokens=NEW)
    assert again.stats.plain_steps == 0 and again.sequences[0].exit_layers[1] < L
    ar = generate(model, None, prompt, max_new_tokens=NEW)
    assert first.token_ids == again.token_ids == ar.token_ids
    # every PLAIN_RETIME_EVERY rounds a plain step is timed again, then rounds go on
    monkeypatch.setattr(adaptive, "PLAIN_RETIME_EVERY", 2)
    often = generate(model, None, prompt, strategy="self-spec", max_new_tokens=NEW)
    assert often.token_ids == ar.token_ids
    st = often.stats
    assert st.plain_steps >= 2 and st.rounds >= 2 * st.plain_steps - 2


def test_a_budgets_last_token_is_a_plain_step_not_a_zero_draft_round(
        forced: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """When a planned round meets a budget with one token left (no draft fits), the step is
    a plain one: it is not timed as a round of zero drafts, whose shape the engine never
    timed at start-up (pricing it timed a chain and layers mid-request, once the machine
    made the planner choose a round for the last token)."""
    forced.costs = FakeCosts(base=1.0, per_row=0.05, head=0.05)  # type: ignore[attr-defined]
    rounds: list[int] = []
    counted = SpecPlanner.timed_round

    def recorded(self: SpecPlanner, e: int, d: int, b: int, *args: object) -> None:
        rounds.append(d)
        counted(self, e, d, b, *args)

    monkeypatch.setattr(SpecPlanner, "timed_round", recorded)
    model = _perfect_draft_model()
    prompt = random_prompts()[0]
    generate(model, None, prompt, strategy="self-spec", max_new_tokens=NEW)  # times plain
    lasts = 0
    for new in range(2, 14):
        ar = generate(model, None, prompt, max_new_tokens=new)
        got = generate(model, None, prompt, strategy="self-spec", max_new_tokens=new)
        assert got.token_ids == ar.token_ids
        lasts += got.sequences[0].exit_layers[-1] == model.num_layers
    assert rounds and min(rounds) >= 1
    assert lasts > 0  # some budgets ended on a plain step (rounds of d + 1 did not fit)


@pytest.mark.parametrize("drafts", [None, 3])
def test_an_engine_times_the_primitives_before_any_request(drafts: int | None) -> None:
    """The primitives a plan prices are timed when the engine starts: a request does not
    wait for them (a fresh process's first generation once spent half a second of its
    decoding there)."""
    model = _perfect_draft_model()
    options = get_strategy("self-spec").options(num_speculations=drafts)
    engine = Engine(model, None, "self-spec", options)
    try:
        costs = costs_of(engine.runner)
        spent = costs.measured_s
        assert spent > 0
        for prompt in random_prompts()[:2]:  # the first times its plain step
            req = engine.submit(prompt, SamplingOptions(max_new_tokens=NEW))
            engine.run()
            assert len(req.token_ids) == NEW
        assert costs.measured_s == spent
    finally:
        engine.close()


def test_plain_and_probe_steps_when_drafts_do_not_pay(forced: object) -> None:
    forced.costs = FakeCosts(base=0.01, per_row=1.0, head=0.001)  # type: ignore[attr-defined]
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=40)
    got = generate(model, None, prompts, strategy="self-spec", max_new_tokens=40)
    assert got.token_ids == ar.token_ids
    st = got.stats
    assert st.rounds == 0 and st.plain_steps > 0  # a batch probes through its prompts only
    assert st.probe_steps == 0 and st.derived()["plain_share"] == 1.0
    assert set(layer for s in got.sequences for layer in s.exit_layers) == {model.num_layers}
    alone = generate(model, None, prompts[1], strategy="self-spec", max_new_tokens=40)
    assert alone.token_ids[0] == ar.token_ids[1]
    assert alone.stats.rounds == 0 and alone.stats.probe_steps > 0


@pytest.mark.parametrize("kind", [{"every_layer": True}, {"head": "mlp", "gpt2": True}])
def test_measured_choices_keep_the_output(kind: dict) -> None:
    """Whatever the machine makes the planner choose, greedy output is plain decoding's, in
    a batch and alone, with a fixed exit (d chosen) or a fixed d (exit chosen)."""
    model = ee_model(**kind)
    prompts = random_prompts(sizes=(5, 9, 3, 12))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    for opts in ({}, {"exit_layer": 2}, {"num_speculations": 3}):
        got = generate(model, None, prompts, strategy="self-spec", max_new_tokens=NEW, **opts)
        assert got.token_ids == ar, opts
        alone = generate(model, None, [prompts[1]], strategy="self-spec", max_new_tokens=NEW,
                         **opts)
        assert alone.token_ids == ar[1:2], opts


def test_mixed_greedy_and_sampled_rows(forced: object) -> None:
    """A sampled row in the batch does not change a greedy row's tokens, whatever steps the
    batch takes."""
    model = _perfect_draft_model()
    prompts = random_prompts()
    ar = generate(model, None, prompts[:1], max_new_tokens=NEW).token_ids[0]
    engine = Engine(model, None, "self-spec", max_batch=4)
    greedy = engine.submit(prompts[0], SamplingOptions(max_new_tokens=NEW))
    sampled = engine.submit(prompts[1], SamplingOptions(max_new_tokens=NEW, temperature=1.0,
                                                        seed=3))
    engine.run()
    engine.close()
    assert greedy.token_ids == ar
    assert len(sampled.token_ids) == NEW
    assert greedy.stats.rounds > 0 and sampled.stats.rounds > 0


def test_adaptive_sampling_matches_target_distribution(forced: object) -> None:
    """Chi-square goodness of fit of 3-token continuations sampled with adaptive rounds (the
    planner drafts at exit 1, as costs make it pay) against the exact joint distribution."""
    forced.costs = FakeCosts(base=1.0, per_row=0.0, head=0.0)  # type: ignore[attr-defined]
    model = ee_model(every_layer=True, vocab=5, scale=0.5, seed=1)
    prompt = [1, 3, 0, 2]
    n = 6000
    out = generate(model, None, [prompt] * n, strategy="self-spec", max_new_tokens=3,
                   temperature=1.0, seed=7, ignore_eos=True)
    assert out.stats.rounds > 0 and out.stats.drafted > 0
    chi2, dof = chi_square(out.token_ids, exact_joint(model, prompt, 3, 1.0))
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)


@pytest.mark.parametrize("backend", ["eager", "native", "static"])
def test_chains_that_stop_on_low_confidence(backend: str) -> None:
    """A chain with ``stop_below`` ends after the first draft whose probability is below the
    threshold: the same drafts, fewer of them, on every runner; 0 never stops."""
    from exitlm.kernels import native

    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    model = ee_model(every_layer=True)
    runner = prepare(model, backend=backend)
    eager = prepare(model, backend="eager")
    out = {}
    for name, r in (("eager", eager), (backend, runner)):
        for tau in (None, 0.0, 0.5, 1.0):
            cache = r.new_cache(1, 64)
            with torch.inference_mode():
                r.prefill(torch.tensor([[3, 9, 7, 1, 4]]), torch.tensor([5]), cache)
                ch = r.chain(torch.tensor([2]), cache, 6, 2, stop_below=tau)
            out[(name, tau)] = ch.tokens[0].tolist()
            assert ch.hidden.shape[1] == ch.tokens.shape[1] + 1
    full = out[(backend, None)]
    assert len(full) == 6 and out[(backend, 0.0)] == full
    assert len(out[(backend, 1.0)]) == 1  # no draft is certain: stop after the first
    assert full[: len(out[(backend, 0.5)])] == out[(backend, 0.5)]
    assert out[(backend, 0.5)] == out[("eager", 0.5)]


def test_a_fitted_line_with_a_negative_overhead_is_not_used() -> None:
    """Nearby measured shapes whose noise tilts the line (measured = a * modelled + o with
    o < 0) would overprice every deeper round; the planner prices untried rounds by the
    measured/modelled ratio instead."""
    planner = _planner(FakeCosts())
    (e1, d1), (e2, d2) = (2, 1), (2, 4)
    m1, m2 = planner._modelled(e1, d1, 1), planner._modelled(e2, d2, 1)
    assert m2 > 1.1 * m1
    planner.timed_round(e1, d1, 1, 0.0, 1.5 * m1)  # ratio 1.5 ...
    planner.timed_round(e2, d2, 1, 0.0, 3.0 * m2)  # ... then 3.0: a steep line, o < 0
    assert fit_line([(m1, 1.5 * m1), (m2, 3.0 * m2)])[0] < 0
    deep = planner._modelled(6, 3, 1)
    assert planner.round_cost(6, 3, 1, 0.0) == pytest.approx(deep * planner._ratio[1])


def test_the_models_measured_best_round_is_preferred() -> None:
    """A model's recorded best round (``exits.draft``) yields to another round only when that
    one promises ANCHOR_MARGIN times its throughput, and to plain steps whenever they win."""
    costs = FakeCosts()
    free = _planner(costs)
    anchored = _planner(costs, anchor=(4, 3))
    anchored.timed_round(4, 3, 1, 0.0, anchored._modelled(4, 3, 1))  # as modelled

    def rate(p: SpecPlanner, e: int, d: int, a: float) -> float:
        t = expected_tokens(a, d)
        return t / p.round_cost(e, d, 1, t)

    rates = [{2: 0.75, 4: 0.9, 6: 0.9}]
    best = free.plan(rates, [30], [None])
    assert best.exit_layer == 2
    top = rate(free, 2, best.drafts[0], 0.75)
    assert top < ANCHOR_MARGIN * rate(free, 4, 3, 0.9)  # the best promises too little more
    plan = anchored.plan(rates, [30], [None])
    assert (plan.exit_layer, plan.drafts) == (4, (3,))
    assert plan.gain == pytest.approx(rate(anchored, 4, 3, 0.9) * anchored.plain_cost(1))
    assert plan.best_gain == pytest.approx(best.best_gain)
    # exit 2 agrees more: it promises over ANCHOR_MARGIN times as much and is chosen
    high = [{2: 0.99, 4: 0.9, 6: 0.9}]
    assert anchored.plan(high, [30], [None]).exit_layer == 2
    # no round pays (3 drafts each): plain steps, the preferred round's margin notwithstanding
    none = [{2: 0.05, 4: 0.65, 6: 0.05}]
    assert rate(anchored, 4, 3, 0.65) * ANCHOR_MARGIN > anchored.plain_cost(1) ** -1 > rate(
        anchored, 4, 3, 0.65)
    assert anchored.plan(none, [30], [3]).exit_layer is None
    # drafts fixed by the caller: the preferred exit with them
    fixed = anchored.plan(rates, [30], [5])
    assert fixed == Plan(4, (5,), rate(anchored, 4, 5, 0.9) * anchored.plain_cost(1),
                         fixed.best_gain)
    assert free.plan(rates, [30], [5]).exit_layer == 2
    with pytest.raises(ValueError, match="not a candidate"):
        SpecPlanner(costs, 8, (2, 4), vocab=None, lazy_head=True, anchor=(3, 2))  # type: ignore


def test_a_plain_step_is_timed_before_any_round() -> None:
    """Until a plain step was timed, the planner plans plain steps: the modelled plain step
    comes from timings on a small scratch cache with the weights in the processor's caches
    (on ``layerskip-code`` 2.4 ms where a step takes 3.3), and rounds, priced from their
    measured times, lost to it on a fresh process's first prompt. One sequence's plain step is
    timed again every PLAIN_RETIME_EVERY rounds (the machine's load changes)."""
    costs = FakeCosts()
    planner = SpecPlanner(costs, 8, (2, 4, 6), vocab=None, lazy_head=True)  # type: ignore
    rates = [{2: 0.99, 4: 0.99, 6: 0.99}]
    assert not planner.plain_timed(1)
    assert planner.plan(rates, [30], [None]).exit_layer is None
    planner.timed_plain(1, planner.plain_cost(1))
    assert planner.plain_timed(1) and planner.plan(rates, [30], [None]).exit_layer is not None
    assert not planner.plain_timed(2)
    assert planner.plan(rates * 2, [30, 30], [None, None]).exit_layer is None
    # rounds go on: after PLAIN_RETIME_EVERY of them a plain step is timed again
    for _ in range(PLAIN_RETIME_EVERY - 1):
        planner.timed_round(4, 3, 1, 0.0, planner._modelled(4, 3, 1))
    assert planner.plan(rates, [30], [None]).exit_layer is not None
    planner.timed_round(4, 3, 1, 0.0, planner._modelled(4, 3, 1))
    assert not planner.plain_timed(1)
    assert planner.plan(rates, [30], [None]).exit_layer is None
    planner.timed_plain(1, planner.plain_cost(1))
    assert planner.plan(rates, [30], [None]).exit_layer is not None


def test_an_untimed_preferred_round_is_tried_before_any_other() -> None:
    """The model's preferred round is taken while it has not been timed, even where another
    round promises ANCHOR_MARGIN times as much on modelled costs and a few prompt positions'
    agreement; once timed, the margin rule applies - and plain steps still win where no
    round pays."""
    costs = FakeCosts()
    planner = _planner(costs, anchor=(4, 3))
    high = [{2: 0.99, 4: 0.9, 6: 0.9}]  # exit 2 promises over the margin (see above)
    assert planner.plan(high, [30], [None]).exit_layer == 4
    assert planner.plan([{2: 0.05, 4: 0.05, 6: 0.05}], [30], [None]).exit_layer is None
    planner.timed_round(4, 3, 1, 0.0, planner._modelled(4, 3, 1))
    assert planner.plan(high, [30], [None]).exit_layer == 2
    # measured slow (a slow spell of the machine): left; a probe forgets that time, so the
    # preferred round is tried again
    rates = [{2: 0.9, 4: 0.9, 6: 0.9}]
    planner._measured[(4, 3, 1)] *= 5.0
    away = planner.plan(rates, [30], [None])
    assert (away.exit_layer, away.drafts) != (4, (3,))
    planner.probed(away)
    back = planner.plan(rates, [30], [None])
    assert (back.exit_layer, back.drafts) == (4, (3,))


def test_one_preempted_round_does_not_price_its_shape_out() -> None:
    planner = SpecPlanner(FakeCosts(), 8, (2, 4, 6), vocab=None, lazy_head=True)  # type: ignore
    for _ in range(5):
        planner.timed_round(4, 3, 1, 0.0, 10.0)
        planner.timed_plain(1, 5.0)
    planner.timed_round(4, 3, 1, 0.0, 100.0)  # the operating system took the processor
    planner.timed_plain(1, 0.1)
    assert planner._measured[(4, 3, 1)] == pytest.approx(0.8 * 10.0 + 0.2 * 13.0)
    assert planner.plain_cost(1) == pytest.approx(0.8 * 5.0 + 0.2 * 5.0 / 1.3)


def test_a_models_draft_hint_anchors_its_rounds(forced: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``exits.draft`` of the model's config: the planner prefers that round (exit 8 of 12
    layers here, where exit 7 agrees as well and costs a little less, so an unanchored
    planner drafts at 7); rounds that cannot be chosen online (a seed) are that round; the
    output stays plain decoding's."""
    forced.costs = FakeCosts(base=1.0, per_row=0.05, head=0.05)  # type: ignore[attr-defined]
    model = ee_model(every_layer=True, num_layers=12)
    with torch.no_grad():  # layers 7-12 are identities: exits 6-11 give the final output
        for layer in model.layers[6:]:
            layer.attn.wo.weight.zero_()
            layer.mlp.w_out.weight.zero_()
    prompts = random_prompts(sizes=(60,))  # exits' agreement measured over the prompt
    ar = generate(model, None, prompts[0], max_new_tokens=NEW)
    free = generate(model, None, prompts[0], strategy="self-spec", max_new_tokens=NEW)
    assert free.stats.exit_layer_sum == 7 * free.stats.rounds > 0  # 6 is not a candidate
    model.config = model.config.replace(exits=dataclasses.replace(
        model.config.exits, draft=DraftHint(exit_layer=8, num_speculations=2)))
    weighed: list[tuple[int, ...]] = []  # the exits each plan weighs
    plan = SpecPlanner.plan

    def spy(self: SpecPlanner, *args: object, exits: object = None) -> Plan:
        weighed.append(tuple(exits or self.candidates))  # type: ignore[arg-type]
        return plan(self, *args, exits=exits)  # type: ignore[arg-type]

    monkeypatch.setattr(SpecPlanner, "plan", spy)
    got = generate(model, None, prompts[0], strategy="self-spec", max_new_tokens=NEW)
    assert got.token_ids == ar.token_ids == free.token_ids
    assert got.stats.exit_layer_sum == 8 * got.stats.rounds > 0
    # every exit is weighed first (and after a probe); while exit 8 runs, only exit 8
    assert len(weighed[0]) > 1 and (8,) in weighed[1:]
    assert got.stats.drafted <= 2 * got.stats.rounds
    engine = Engine(model, None, "self-spec")
    try:
        assert engine.decoder.planner.anchor == (8, 2)  # type: ignore[attr-defined]
    finally:
        engine.close()
    batch = random_prompts(sizes=(60, 7, 33))  # a batch plans with the anchor too
    assert generate(model, None, batch, strategy="self-spec", max_new_tokens=NEW
                    ).token_ids == generate(model, None, batch, max_new_tokens=NEW).token_ids
    seeded = generate(model, None, prompts[0], strategy="self-spec", max_new_tokens=NEW,
                      temperature=1.0, seed=5)
    st = seeded.stats
    assert st.exit_layer_sum == 8 * st.rounds and st.drafted <= 2 * st.rounds
    assert st.drafted >= 2 * (st.rounds - 1)  # 2 a round (the last one may have fewer)
    fixed = generate(model, None, prompts[0], strategy="self-spec", max_new_tokens=NEW,
                     temperature=1.0, seed=5, exit_layer=8, num_speculations=2)
    assert fixed.token_ids == seeded.token_ids and fixed.stats == st
