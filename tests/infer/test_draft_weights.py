"""Self-speculative decoding that drafts through a quantized copy of the model
(``draft_weights``, runtime/draft_copy.py): the output stays the eager reference's greedy
tokens, whatever the exit, draft length, draft vocabulary or batch; sampling with a one-hot
target still gives them; a recorded round's weights are taken where a copy can run; an
explicit copy that cannot run is one clear error."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401
from _reference import greedy_reference
from exitlm.config import ConfigError
from exitlm.infer import generate
from exitlm.infer.adaptive import SpecPlanner
from exitlm.infer.self_speculative import SelfSpecDecoder, SelfSpecOptions
from exitlm.kernels import native
from exitlm.runtime import prepare
from exitlm.runtime.costs import costs_of
from exitlm.runtime.draft_copy import draft_runner

pytestmark = [pytest.mark.skipif(not native.available(), reason="no native library"),
              pytest.mark.usefixtures("one_thread")]

NEW = 16
MODELS = {
    "layerskip": {"every_layer": True},
    "odd-mlp": {"every_layer": True, "hidden": 48},  # MLP outputs kept in fp16 by the copy
    "gpt2-mlp": {"head": "mlp", "gpt2": True},
    "block": {"head": "block"},
}
CASES: list[dict[str, Any]] = [
    {"exit_layer": 1, "num_speculations": 1},
    {"exit_layer": 2, "num_speculations": 5},
    {"exit_layer": 3, "num_speculations": 6, "draft_vocab": 7},
    {"exit_layer": 2, "num_speculations": 4, "draft_threshold": 0.6},
    {},  # adaptive
]


def _prompts() -> list[list[int]]:
    torch.manual_seed(11)
    return random_prompts(sizes=(5, 9, 3))


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("opts", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
                         or "adaptive")
def test_copy_drafts_emit_the_reference_tokens(opts: dict[str, Any], model_name: str,
                                               kind: str) -> None:
    model = ee_model(**MODELS[model_name])  # type: ignore[arg-type]
    runner = prepare(model, backend="native")
    prompts = _prompts()
    want = [greedy_reference(model, p, NEW) for p in prompts]
    drafted = 0
    for p, w in zip(prompts, want, strict=True):  # one sequence: drafts through the copy
        got = generate(runner, None, [p], strategy="self-spec", max_new_tokens=NEW,
                       draft_weights=kind, **opts)
        assert got.token_ids[0] == w
        drafted += got.stats.drafted
    if opts:
        assert drafted > 0
    # a batch drafts through the model itself, the same tokens
    got = generate(runner, None, prompts, strategy="self-spec", max_new_tokens=NEW,
                   draft_weights=kind, **opts)
    assert got.token_ids == want


def test_the_copy_drafts_and_full_depth_verification_follows(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The copy's runner makes the chain; the model's runner verifies layers 0..L."""
    model = ee_model(every_layer=True)
    runner = prepare(model, backend="native")
    copy = draft_runner(runner, "int8")
    calls: list[tuple[str, int, int]] = []
    chain, layers = type(copy).chain, type(runner).layers

    def spy_chain(self: Any, tokens: torch.Tensor, cache: Any, n: int, depth: int,
                  **kw: Any) -> Any:
        calls.append(("copy" if self is copy else "model", n, depth))
        return chain(self, tokens, cache, n, depth, **kw)

    def spy_layers(self: Any, h: torch.Tensor, start: int, end: int, *a: Any, **kw: Any) -> Any:
        if self is runner and h.shape[1] > 1:
            calls.append(("verify", start, end))
        return layers(self, h, start, end, *a, **kw)

    monkeypatch.setattr(type(copy), "chain", spy_chain)
    monkeypatch.setattr(type(runner), "layers", spy_layers)
    prompt = _prompts()[1]
    got = generate(runner, None, [prompt], strategy="self-spec", max_new_tokens=NEW,
                   draft_weights="int8", exit_layer=2, num_speculations=3)
    assert got.token_ids[0] == greedy_reference(model, prompt, NEW)
    assert ("copy", 3, 2) in calls and ("verify", 0, model.num_layers) in calls
    assert not any(c[0] == "model" and c[1] > 0 for c in calls)
    # layer evaluations: the first token's L, then L + E per position of every round (the
    # model verifies all L layers, the copy ran E)
    st, seq = got.stats, got.sequences[0]
    assert seq.layer_evaluations == model.num_layers + (st.drafted + st.rounds) * (
        model.num_layers + 2)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("odd", [False, True], ids=["layerskip", "odd-mlp"])
def test_one_hot_sampling_through_the_copy_is_greedy(kind: str, odd: bool) -> None:
    """Rejection sampling against a one-hot target accepts exactly the argmax drafts and
    resamples the argmax otherwise: the reference's greedy tokens, through the copy's
    sampled drafts (its eager chain with a pick; with ``odd``, through fp16 MLP outputs)."""
    model = ee_model(every_layer=True, hidden=48 if odd else 64)
    runner = prepare(model, backend="native")
    prompt = _prompts()[0]
    got = generate(runner, None, [prompt], strategy="self-spec", max_new_tokens=NEW,
                   draft_weights=kind, exit_layer=2, num_speculations=4, temperature=1.0,
                   top_k=1, seed=3)
    assert got.token_ids[0] == greedy_reference(model, prompt, NEW)
    assert got.stats.drafted > 0


def test_a_recorded_round_names_the_copy_where_it_can_run() -> None:
    model = ee_model(every_layer=True)
    model.config = model.config.with_draft(2, 3, "int8")
    native_runner = prepare(model, backend="native")
    dec = SelfSpecDecoder(native_runner, SelfSpecOptions())
    assert dec.draft_weights == "int8" and dec.drafter is draft_runner(native_runner, "int8")
    assert dec.resolved_options()["draft_weights"] == "int8"
    own = SelfSpecDecoder(native_runner, SelfSpecOptions(draft_weights="model"))
    assert own.draft_weights == "model" and own.drafter is None
    eager = SelfSpecDecoder(prepare(model, backend="eager"), SelfSpecOptions())
    assert eager.draft_weights == "model" and eager.drafter is None
    prompt = _prompts()[2]
    got = generate(native_runner, None, [prompt], strategy="self-spec", max_new_tokens=NEW)
    assert got.token_ids[0] == greedy_reference(model, prompt, NEW)


def test_an_explicit_copy_that_cannot_run_is_a_config_error() -> None:
    model = ee_model(every_layer=True)
    with pytest.raises(ConfigError, match=r"--draft-weights int8: .*native"):
        SelfSpecDecoder(prepare(model, backend="eager"), SelfSpecOptions(draft_weights="int8"))
    half = ee_model(every_layer=True).half()
    with pytest.raises(ConfigError, match=r"--draft-weights int4: .*float32"):
        SelfSpecDecoder(prepare(half, backend="native"), SelfSpecOptions(draft_weights="int4"))
    with pytest.raises(ConfigError):
        SelfSpecOptions(draft_weights="int2")  # type: ignore[arg-type]


def test_the_planner_prices_one_sequence_by_the_copy() -> None:
    """A planner with a copy models one sequence's round as the copy's chain plus all L
    layers over d + 1 positions (a batch as before), and keeps its learned times apart from
    a planner drafting through the model."""
    model = ee_model(every_layer=True)
    runner = prepare(model, backend="native")
    copy = draft_runner(runner, "int8")
    costs, copy_costs = costs_of(runner), costs_of(copy)
    own = SpecPlanner(costs, 4, [1, 2], vocab=None, lazy_head=True)
    via = SpecPlanner(costs, 4, [1, 2], vocab=None, lazy_head=True, copy=("int8", copy_costs))
    assert via._modelled(2, 3, 1) == pytest.approx(copy_costs.chain(2, 3) + costs.layers(0, 4))
    assert own._modelled(2, 3, 1) == pytest.approx(costs.chain(2, 3) + costs.layers(2, 4))
    via.timed_round(2, 3, 1, 2.0, 1.0)
    assert (2, 3, 1) in via._measured and (2, 3, 1) not in own._measured
    assert dataclasses.fields(SelfSpecOptions)  # (the options class stays a dataclass)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_sequence_left_alone_in_an_engine_drafts_through_the_copy(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with their own budgets in one engine: a batch drafts through the model; once
    the others have finished, the last one drafts through the copy on the engine's pooled
    cache - every request with the reference's tokens."""
    from _ee_models import BUDGETS
    from exitlm.infer.engine import Engine
    from exitlm.infer.options import SamplingOptions

    model = ee_model(every_layer=True)
    copied: list[int] = []
    chain = type(draft_runner(prepare(model, backend="native"), kind)).chain

    def spy(self: Any, tokens: torch.Tensor, *a: Any, **kw: Any) -> Any:
        if self.model is not model:
            copied.append(tokens.shape[0])
        return chain(self, tokens, *a, **kw)

    monkeypatch.setattr(type(draft_runner(prepare(model, backend="native"), kind)), "chain", spy)
    torch.manual_seed(5)
    prompts = random_prompts(sizes=(5, 9, 3, 7))
    engine = Engine(model, None, "self-spec",
                    SelfSpecOptions(exit_layer=2, num_speculations=3, draft_weights=kind),
                    max_batch=len(prompts))
    reqs = [engine.submit(p, SamplingOptions(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, BUDGETS, strict=True)]
    engine.run()
    for r, p, n in zip(reqs, prompts, BUDGETS, strict=True):
        assert r.result(model.num_layers).token_ids == greedy_reference(model, p, n)
    assert copied and set(copied) == {1}
