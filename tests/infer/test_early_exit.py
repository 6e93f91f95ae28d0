"""Early exit beyond the conformance suite (test_conformance.py: threshold 1.0 is greedy, KV
recomputation equals the cache-free reference, a fixed exit is the truncated model): cache
fill, state copying, sampling and stop tokens per sequence, configuration errors."""

from __future__ import annotations

import pytest
import torch

from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401
from exitlm.config import ConfigError
from exitlm.infer import EarlyExitOptions, Engine, SamplingOptions, generate

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16


def test_fill_tracks_missing_layers_and_pending_joins_at_its_exit() -> None:
    model = ee_model("linear")
    prompt = random_prompts(sizes=(6,))[0]
    # threshold 0: every token exits at the first check (layer 2) until max_pending forces
    engine = Engine(model, None, "early-exit",
                    EarlyExitOptions(threshold=0.0, max_pending=3, exit_layers=(2,)),
                    max_batch=1)
    req = engine.submit(prompt, SamplingOptions(max_new_tokens=10, ignore_eos=True))
    seen = []
    evals = 0
    for _ in range(4):
        engine.step()  # the first step also prefills (one full-depth token)
        assert engine.pool.cache is not None
        seen.append((req.exit_layers[-1], req.layer_evaluations - evals,
                     engine.pool.cache.fill[:, 0].tolist()))
        evals = req.layer_evaluations
    # step 1: prefill (4 layers) + exit at layer 2 -> layers 0,1 hold position 6
    assert seen[0] == (2, 4 + 2, [7, 7, 6, 6])
    # step 2: nothing pending below layer 2; exits again
    assert seen[1] == (2, 2, [8, 8, 6, 6])
    assert seen[2] == (2, 2, [9, 9, 6, 6])
    # step 4: 3 pending -> forced full pass; they join at layer 2 (not layer 1):
    # 2 layers x 1 new token + 2 layers x 4 tokens (3 pending + new)
    assert seen[3] == (4, 2 + 2 * 4, [10, 10, 10, 10])
    assert req.stats.forced_full == 1  # type: ignore[attr-defined]
    assert req.stats.recompute_evaluations == 2 * 3  # type: ignore[attr-defined]


def test_state_copy_writes_exit_state_projections() -> None:
    model = ee_model("linear")
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW)
    same = generate(model, None, prompts, strategy="early-exit", kv="copy", threshold=1.0,
                    max_new_tokens=NEW)
    assert same.token_ids == ar.token_ids
    lossy = generate(model, None, prompts, strategy="early-exit", kv="copy", threshold=0.3,
                     max_new_tokens=NEW)
    assert any(x < 4 for s in lossy.sequences for x in s.exit_layers)
    # the projections equal what the layer itself writes for the same input
    h = torch.randn(2, 1, 32)
    cache = model.new_cache(2, 8)
    pos = torch.tensor([[0], [3]])
    copied = model.new_cache(2, 8)
    with torch.inference_mode():
        model.run_layers(h, 1, 2, cache=cache, ctx=model.context(pos, cache))
        model.write_kv(h[1:], 1, pos[1:], copied, torch.tensor([1]))
    torch.testing.assert_close(copied.keys[1][1, :, 3], cache.keys[1][1, :, 3])
    torch.testing.assert_close(copied.values[1][1, :, 3], cache.values[1][1, :, 3])
    assert float(copied.keys[1][0].abs().sum()) == 0.0  # row 0 untouched


def test_sampling_and_stop_tokens_per_sequence() -> None:
    model = ee_model("linear")
    prompts = random_prompts()
    a = generate(model, None, prompts, strategy="early-exit", threshold=0.4, temperature=0.8,
                 seed=3, max_new_tokens=NEW)
    b = generate(model, None, prompts, strategy="early-exit", threshold=0.4, temperature=0.8,
                 seed=3, max_new_tokens=NEW)
    assert a.token_ids == b.token_ids
    stop = a.token_ids[0][3]
    c = generate(model, None, prompts, strategy="early-exit", threshold=0.4, temperature=0.8,
                 seed=3, max_new_tokens=NEW, stop_token_ids=(stop,))
    assert c.sequences[0].finish_reason == "stop_token"
    assert c.token_ids[0][-1] == stop


def test_config_errors() -> None:
    model = ee_model("linear", layers=(2,))
    with pytest.raises(ConfigError, match="1 is not an exit"):
        generate(model, None, [1, 2], strategy="early-exit", exit_layers=(1,))
    with pytest.raises(ConfigError, match="max_pending"):
        generate(model, None, [1, 2], strategy="early-exit", max_pending=0)


def _with_threshold(model: torch.nn.Module, threshold: float | None) -> torch.nn.Module:
    model.config = model.config.with_threshold(threshold)  # type: ignore[union-attr]
    return model


def test_a_recorded_threshold_is_the_default_and_an_explicit_one_wins() -> None:
    """``exits.threshold`` (the confidence a model records as keeping plain decoding's output)
    is early exit's default for that model; ``--threshold`` and a request's own threshold
    override it; without one the default stays 0.9."""
    torch.manual_seed(5)
    prompts = random_prompts()
    kw = {"strategy": "early-exit", "max_new_tokens": 16, "ignore_eos": True}

    def run(model: torch.nn.Module, **opts: object) -> tuple[list, list, float]:
        res = generate(model, None, prompts, **kw, **opts)
        return res.token_ids, [s.exit_layers for s in res.sequences], res.options["threshold"]

    plain = ee_model("linear", scale=0.6)
    low = run(plain, threshold=0.3)
    default = run(plain)
    assert default == run(plain, threshold=0.9) and default[2] == 0.9
    assert low[1] != default[1]  # the thresholds differ in where tokens exit
    recorded = _with_threshold(ee_model("linear", scale=0.6), 0.3)
    assert run(recorded) == low  # the recorded threshold is the default
    assert run(recorded, threshold=0.9) == default  # an explicit one wins
    engine = Engine(recorded, strategy="early-exit", max_batch=2)
    try:
        own = engine.submit(prompts[0], SamplingOptions(max_new_tokens=16, ignore_eos=True),
                            threshold=0.9)
        inherits = engine.submit(prompts[0], SamplingOptions(max_new_tokens=16,
                                                             ignore_eos=True))
        engine.run()
        assert own.token_ids == default[0][0]
        assert (inherits.token_ids, inherits.exit_layers) == (low[0][0], low[1][0])
    finally:
        engine.close()


def test_a_recorded_threshold_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"exits.threshold.*\[0, 1\]|threshold.*1.5"):
        _with_threshold(ee_model("linear"), 1.5)
