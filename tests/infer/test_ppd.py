"""Predictive Pipelined Decoding beyond the conformance suite (test_conformance.py: greedy
tokens for every exit head, d_bar, k, with and without threads): p_correct and Theorem 4.1 in
the stats, stop tokens, configuration errors, one sequence at a time, the pool's edges."""

from __future__ import annotations

import pytest

from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401
from exitlm.config import ConfigError
from exitlm.infer import generate
from exitlm.plan.ppd_theory import expected_latency

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


def test_ppd_stats_match_theorem_4_1() -> None:
    model = ee_model(every_layer=True)
    got = generate(model, None, random_prompts(sizes=(6,))[0], strategy="ppd", ppd_layer=3,
                   ppd_k=2, max_new_tokens=NEW)
    st = got.stats
    assert st.forks == NEW - 2  # one fork per decoded token but the last
    assert 0 < st.matches < st.forks
    assert st.p_correct == pytest.approx(st.matches / st.forks)
    theory = st.theory(4, 3, 2, NEW - 1)
    assert theory["latency"] == pytest.approx(expected_latency(4, 3, 2, NEW - 1, st.p_correct))
    # layer evaluations: d for the first token; per decoded token d, minus (d - d_bar) after a
    # confirmed prediction, plus k (d - d_bar) per fork (PPD Theorem 4.1's compute)
    m = 4 - 3
    expect = 4 + (NEW - 1) * 4 - m * st.matches + 2 * m * st.forks
    assert got.sequences[0].layer_evaluations == expect


def test_ppd_stops_at_stop_tokens() -> None:
    model = ee_model(every_layer=True)
    prompt = random_prompts(sizes=(4,))[0]
    free = generate(model, None, prompt, max_new_tokens=NEW).token_ids[0]
    stop = free[5]
    got = generate(model, None, prompt, strategy="ppd", ppd_layer=2, max_new_tokens=NEW,
                   stop_token_ids=(stop,))
    assert got.token_ids[0] == free[: free.index(stop) + 1]


def test_ppd_config_errors() -> None:
    model = ee_model(every_layer=True)
    with pytest.raises(ConfigError, match="d/2 <= d_bar < d"):
        generate(model, None, [1, 2], strategy="ppd", ppd_layer=1)
    with pytest.raises(ConfigError, match="greedy"):
        generate(model, None, [1, 2], strategy="ppd", temperature=0.5)


def test_ppd_batch_runs_one_sequence_at_a_time() -> None:
    """A batch of prompts under PPD is served one sequence after the other (the engine queues
    them); each equals its greedy output."""
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    got = generate(model, None, prompts, strategy="ppd", ppd_layer=3, max_new_tokens=NEW)
    assert got.token_ids == ar
    assert got.stats.forks == len(prompts) * (NEW - 2)


@pytest.mark.parametrize(("prompt_len", "new"), [(60, 12), (150, 10)])
def test_ppd_at_the_pool_and_context_edges(prompt_len: int, new: int) -> None:
    """The branch writes one position past the main token's: the pool must hold it when a
    sequence crosses the pool's allocation unit (64 positions) or fills the whole context."""
    model = ee_model(every_layer=True)
    prompt = random_prompts(sizes=(prompt_len,))[0]
    ar = generate(model, None, prompt, max_new_tokens=new).token_ids
    # every token a candidate: every fork is confirmed and copies the branch's entry
    got = generate(model, None, prompt, strategy="ppd", ppd_layer=2, ppd_k=23,
                   max_new_tokens=new)
    assert got.token_ids == ar
    assert got.stats.matches == got.stats.forks == new - 2
