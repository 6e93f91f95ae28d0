"""Early exit: threshold 1.0 is greedy; KV recomputation equals a cache-free reference under the
same exit decisions; fixed-layer exit is the truncated model; state copying; cache fill."""

from __future__ import annotations

import pytest
import torch
from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401

from exitlm.config import ConfigError
from exitlm.infer import EarlyExitOptions, Engine, SamplingOptions, generate
from exitlm.infer.kv_recompute import reference_decode

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 16


@pytest.mark.parametrize("head", ["linear", "mlp", "block"])
def test_threshold_one_is_greedy(head: str) -> None:
    model = ee_model(head)
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW)
    ee = generate(model, None, prompts, strategy="early-exit", threshold=1.0, max_new_tokens=NEW)
    assert ee.token_ids == ar.token_ids
    assert all(x == 4 for s in ee.sequences for x in s.exit_layers)


@pytest.mark.parametrize(
    ("head", "gpt2", "every"),
    [("linear", False, True), ("mlp", True, False), ("block", False, False)],
)
@pytest.mark.parametrize(("threshold", "max_pending"), [(0.3, 1), (0.3, 3), (0.6, 8)])
def test_kv_recompute_equals_cache_free_reference(
    head: str, gpt2: bool, every: bool, threshold: float, max_pending: int
) -> None:
    model = ee_model(head, gpt2=gpt2, every_layer=every)
    prompts = random_prompts()
    checks = (1, 2, 3)
    got = generate(model, None, prompts, strategy="early-exit", threshold=threshold,
                   max_pending=max_pending, exit_layers=checks, max_new_tokens=NEW)
    early = 0
    for prompt, seq in zip(prompts, got.sequences, strict=True):
        ref, layers = reference_decode(model, prompt, NEW, checks, threshold, max_pending)
        assert seq.token_ids == ref
        assert seq.exit_layers == layers
        early += sum(x < 4 for x in layers)
        # never more than max_pending consecutive early exits
        run = 0
        for x in layers:
            run = run + 1 if x < 4 else 0
            assert run <= max_pending
    assert early > 0  # the test really exercises early exits
    # each sequence of the padded batch equals its own unbatched run
    alone = generate(model, None, prompts[1], strategy="early-exit", threshold=threshold,
                     max_pending=max_pending, exit_layers=checks, max_new_tokens=NEW)
    assert alone.token_ids[0] == got.token_ids[1]


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


def test_fixed_layer_exit_is_the_truncated_model() -> None:
    model = ee_model("mlp")
    prompts = random_prompts()
    got = generate(model, None, prompts, strategy="early-exit", exit_layer=2, max_new_tokens=NEW)
    for prompt, seq in zip(prompts, got.sequences, strict=True):
        seqn = list(prompt)
        with torch.inference_mode():
            for _ in range(NEW):
                out = model(torch.tensor([seqn]), exit_layers=(2,))
                seqn.append(int(out.exit_logits[2][0, -1].argmax()))
        assert seq.token_ids == seqn[len(prompt):]
        assert seq.exit_layers == [2] * NEW
        assert seq.layer_evaluations == 2 * NEW


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
