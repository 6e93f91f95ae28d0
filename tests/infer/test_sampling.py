"""Sampling: filters on hand-made logits, seeding, greedy limits, empirical distribution."""

from __future__ import annotations

import math

import pytest
import torch

from _tiny import tiny_text_model
from exitlm.config import ConfigError
from exitlm.infer import SamplingOptions, generate
from exitlm.infer.sampling import (
    NonFiniteLogits,
    choose,
    probabilities,
    top_k_filter,
    top_p_filter,
)

PROMPTS = [[5, 17, 99, 3], [42, 7]]


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = top_p_filter(logits, 0.7).isfinite()  # 0.5 + 0.2 reaches 0.7
    assert kept.tolist() == [[True, True, False, False, False]]
    kept = top_p_filter(logits, 0.75).isfinite()  # needs the third token
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = top_p_filter(logits, 0.01).isfinite()  # the top token always survives
    assert kept.tolist() == [[True, False, False, False, False]]
    # Unsorted input and a batch of rows are handled per row.
    rows = torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15], [0.2] * 5]).log()
    kept = top_p_filter(rows, 0.7).isfinite()
    assert kept[0].tolist() == [False, True, False, True, False]
    assert int(kept[1].sum()) >= 4


def test_top_k_and_filtered_probabilities() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert top_k_filter(logits, 2).isfinite().tolist() == [[False, True, True, False]]
    p = probabilities(logits, SamplingOptions(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    torch.testing.assert_close(p[0, 1:3], expected)
    assert float(p[0, 0]) == 0.0 and float(p[0, 3]) == 0.0


def test_single_step_empirical_distribution_matches_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    opts = SamplingOptions(temperature=0.8, seed=123)
    gen = torch.Generator().manual_seed(123)
    n = 20000
    draws = choose(logits.expand(n, -1), opts, gen)
    freq = torch.bincount(draws, minlength=5).float() / n
    target = torch.softmax(logits[0] / 0.8, 0)
    # 4 standard errors of a binomial proportion
    tol = 4 * torch.sqrt(target * (1 - target) / n)
    assert bool(((freq - target).abs() <= tol).all()), (freq, target)


def test_same_seed_same_output_and_different_seed_differs() -> None:
    model = tiny_text_model()
    opts = SamplingOptions(temperature=1.0, top_k=50, top_p=0.95, seed=7, max_new_tokens=20,
                           ignore_eos=True)
    a = generate(model, None, PROMPTS, sampling=opts).token_ids
    b = generate(model, None, PROMPTS, sampling=opts).token_ids
    c = generate(model, None, PROMPTS, sampling=opts.replace(seed=8)).token_ids
    assert a == b
    assert a != c


def test_low_temperature_and_top_k_1_equal_greedy() -> None:
    model = tiny_text_model()
    greedy = generate(model, None, PROMPTS, max_new_tokens=16, ignore_eos=True).token_ids
    cold = generate(model, None, PROMPTS, max_new_tokens=16, ignore_eos=True,
                    temperature=1e-4, seed=0).token_ids
    top1 = generate(model, None, PROMPTS, max_new_tokens=16, ignore_eos=True,
                    temperature=1.5, top_k=1, seed=0).token_ids
    assert cold == greedy
    assert top1 == greedy


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-300, 5e-324])
def test_temperatures_too_small_for_the_dtype_sample_the_top_logits(temperature: float) -> None:
    """logits / 1e-40 overflows to inf in fp32 (softmax: NaN); the distribution it stands for
    puts everything on the largest logits, ties shared."""
    logits = torch.tensor([[3.0, 1.0, 3.0, -2.0], [0.5, -1.0, 0.2, 0.1]])
    p = probabilities(logits, SamplingOptions(temperature=temperature))
    assert p.tolist() == [[0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]
    gen = torch.Generator().manual_seed(0)
    draws = choose(logits[:1].expand(200, -1), SamplingOptions(temperature=temperature), gen)
    assert set(draws.tolist()) == {0, 2}
    with pytest.raises(NonFiniteLogits):  # NaN logits still refuse to sample
        choose(torch.tensor([[1.0, math.nan]]), SamplingOptions(temperature=temperature))


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="top_p"):
        SamplingOptions(top_p=0.0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingOptions(temperature=-1)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingOptions(temperature=math.nan)
    assert SamplingOptions(stop_strings="x").stop_strings == ("x",)
