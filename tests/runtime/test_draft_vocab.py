"""Ranked draft vocabularies on every runner: a chain over ``N`` draft ids drafts among the
model's ``N`` most frequent tokens (its token order), the same tokens on the eager, native and
static runners, and lossless strategies keep plain decoding's output with them."""

from __future__ import annotations

import pytest
import torch

from _byte_models import sharp_model
from _ee_models import ee_model, random_prompts
from _reference import greedy_reference
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.kernels import native
from exitlm.kernels.quantized import quantize_model
from exitlm.runtime import prepare

RUNNERS = ("eager", "native", "static")


def _order(vocab: int, seed: int = 5) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def _skip(backend: str) -> None:
    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())


@pytest.mark.parametrize("kind", [None, "int8"])
@pytest.mark.parametrize("backend", RUNNERS)
def test_chain_drafts_among_the_ranked_ids(backend: str, kind: str | None) -> None:
    _skip(backend)
    model = sharp_model(ModelConfig(
        vocab_size=48, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=64, exits=ExitConfig(every_layer=True, norm="final")))
    if kind is not None:
        model = quantize_model(model, kind)
    order = _order(48)
    model.set_token_order(order)
    chains = {}
    for name in ("eager", backend):
        runner = prepare(model, backend=name)  # type: ignore[arg-type]
        cache = runner.new_cache(1, 64)
        with torch.inference_mode():
            runner.prefill(torch.tensor([[3, 9, 27, 1, 4]]), torch.tensor([5]), cache)
            chains[name] = runner.chain(torch.tensor([7]), cache, 6, 2, vocab=12)
    tokens = chains[backend].tokens[0].tolist()
    assert set(tokens) <= set(order[:12].tolist())
    assert tokens == chains["eager"].tokens[0].tolist()
    # unranked: the first ids
    model.set_token_order(None)
    runner = prepare(model, backend=backend)  # type: ignore[arg-type]
    cache = runner.new_cache(1, 64)
    with torch.inference_mode():
        runner.prefill(torch.tensor([[3, 9, 27, 1, 4]]), torch.tensor([5]), cache)
        plain = runner.chain(torch.tensor([7]), cache, 6, 2, vocab=12)
    assert set(plain.tokens[0].tolist()) <= set(range(12))


@pytest.mark.parametrize("backend", RUNNERS)
@pytest.mark.parametrize(("strategy", "opts"), [
    ("self-spec", {"exit_layer": 2, "num_speculations": 4, "draft_vocab": 7}),
    ("self-spec", {"draft_vocab": 7}),
    ("ppd", {"ppd_layer": 2, "ppd_k": 2, "draft_vocab": 9}),
])
def test_lossless_with_a_ranked_draft_vocabulary(backend: str, strategy: str,
                                                 opts: dict) -> None:
    _skip(backend)
    model = ee_model(every_layer=True)
    model.set_token_order(_order(model.config.vocab_size))
    runner = prepare(model, backend=backend)  # type: ignore[arg-type]
    prompts = random_prompts(sizes=(5, 9))
    batch = prompts[:1] if strategy == "ppd" else prompts
    want = [greedy_reference(model, p, 16) for p in batch]
    got = generate(runner, None, batch, strategy=strategy, max_new_tokens=16, **opts)
    assert got.token_ids == want


def test_token_order_must_be_a_permutation() -> None:
    model = ee_model(every_layer=True)
    v = model.config.vocab_size
    with pytest.raises(ValueError, match="permutation"):
        model.set_token_order(torch.zeros(v, dtype=torch.long))
    with pytest.raises(ValueError, match="permutation"):
        model.set_token_order(torch.arange(v - 1))
    model.set_token_order(torch.arange(v).flip(0))
    assert model.draft_ids(3).tolist() == [v - 1, v - 2, v - 3]
    assert model.draft_ids(v) is None and model.draft_ids(None) is None
