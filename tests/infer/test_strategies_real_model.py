"""The early-exit strategies on the embedded SmolLM2-135M (LayerSkip-style exits through the
final norm + head): exact ones are token-identical to greedy decoding, single and batched."""

from __future__ import annotations

import pytest

from _default_model import requires_default_model

pytestmark = [pytest.mark.real_model, requires_default_model]

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, a small robot"]
NEW = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Batch-1 decoding of a 135M model is memory bound: one thread is fastest on a busy
    machine (two threads contend with other processes)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded():
    from exitlm.config import ExitConfig
    from exitlm.io import load_model

    return load_model("default", exits=ExitConfig(every_layer=True, norm="final"))


@pytest.fixture(scope="module")
def greedy(loaded) -> list[list[int]]:
    from exitlm.infer import generate

    return generate(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=NEW,
                    ignore_eos=True).token_ids


def test_early_exit_threshold_one_and_self_spec_batch(loaded, greedy) -> None:
    from exitlm.infer import generate

    ee = generate(loaded.model, loaded.tokenizer, PROMPTS, strategy="early-exit", threshold=1.0,
                  max_new_tokens=NEW, ignore_eos=True)
    assert ee.token_ids == greedy
    ss = generate(loaded.model, loaded.tokenizer, PROMPTS, strategy="self-spec", exit_layer=24,
                  num_speculations=3, max_new_tokens=NEW, ignore_eos=True)
    assert ss.token_ids == greedy
    assert ss.stats.accepted > 0


def test_self_spec_and_ppd_single_prompt(loaded, greedy) -> None:
    from exitlm.infer import generate

    ss = generate(loaded.model, loaded.tokenizer, PROMPTS[0], strategy="self-spec",
                  exit_layer=20, num_speculations=4, max_new_tokens=NEW, ignore_eos=True)
    assert ss.token_ids[0] == greedy[0]
    ppd = generate(loaded.model, loaded.tokenizer, PROMPTS[1], strategy="ppd", ppd_layer=20,
                   ppd_k=2, max_new_tokens=NEW, ignore_eos=True)
    assert ppd.token_ids[0] == greedy[1]
    assert 0.0 <= ppd.stats.p_correct <= 1.0


def test_kv_recompute_equals_reference(loaded) -> None:
    """A padded batch of two prompts, each against the cache-free reference."""
    from _reference import early_exit_reference as reference_decode
    from exitlm.infer import generate

    ids = [loaded.tokenizer.encode(p) for p in PROMPTS[1:]]
    got = generate(loaded.model, None, ids, strategy="early-exit", threshold=0.5,
                   exit_layers=(20, 26), max_pending=4, max_new_tokens=10, ignore_eos=True)
    early = 0
    for prompt, seq in zip(ids, got.sequences, strict=True):
        ref, layers = reference_decode(loaded.model, prompt, 10, (20, 26), 0.5, 4)
        assert seq.token_ids == ref
        assert seq.exit_layers == layers
        early += sum(x < 30 for x in layers)
    assert early > 0


def test_default_ee_heads_self_spec_and_ppd(greedy) -> None:
    """The tuned MLP exit heads of default-ee draft; the output stays exactly greedy."""
    from exitlm.infer import generate
    from exitlm.io import load_model

    try:
        ee = load_model("default-ee")
    except Exception as err:  # the bundle ships with exitlm; skip on installs without it
        pytest.skip(f"default-ee unavailable: {err}")
    ss = generate(ee.model, ee.tokenizer, PROMPTS, strategy="self-spec", exit_layer=20,
                  num_speculations=2, max_new_tokens=NEW, ignore_eos=True)
    assert ss.token_ids == greedy
    assert ss.stats.acceptance_rate > 0.05
    ppd = generate(ee.model, ee.tokenizer, PROMPTS[2], strategy="ppd", ppd_layer=20,
                   max_new_tokens=NEW, ignore_eos=True)
    assert ppd.token_ids[0] == greedy[2]
