"""The static decoding programs of :mod:`exitlm.backend.cuda_graphs`, run eagerly on CPU.

A CUDA graph replays exactly the static code these tests run (``capture=False``), so what is
checked here - positions kept on the device, keys/values scattered to their positions,
attention over a power-of-two window under a mask, fill bookkeeping by the caller, a whole
self-speculative round without the host - is what the GPU replays
(``tests/infer/test_cuda.py`` captures the same programs on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from _ee_models import BUDGETS, ee_model, random_prompts, self_spec_with_budgets

from exitlm.backend.cuda_graphs import StaticSteps, attended_slots, use_static_steps
from exitlm.infer import generate

NEW = 20


def _static(model: torch.nn.Module) -> StaticSteps:
    return use_static_steps(model, capture=False)


def _counting(steps: StaticSteps) -> dict[str, int]:
    """Count the calls of each static program."""
    calls = {"step": 0, "spec_round": 0, "ppd_step": 0}
    for name in calls:
        inner = getattr(steps, name)

        def wrapped(*a: object, _inner=inner, _name=name, **k: object) -> object:
            calls[_name] += 1
            return _inner(*a, **k)

        setattr(steps, name, wrapped)
    return calls


def test_attended_slots_is_a_bounded_power_of_two() -> None:
    assert attended_slots(0, 160) == 64
    assert attended_slots(63, 160) == 64
    assert attended_slots(64, 160) == 128
    assert attended_slots(130, 160) == 160  # capped by the cache
    with pytest.raises(ValueError, match="overflow"):
        attended_slots(160, 160)


@pytest.mark.parametrize("gpt2", [False, True])
def test_static_step_matches_the_eager_step(gpt2: bool) -> None:
    """Logits, keys/values and fill of one static step equal the eager model's, rows at
    different positions (a padded batch)."""
    model = ee_model("linear", every_layer=True, gpt2=gpt2)
    steps = StaticSteps(model, capture=False)
    caches = [model.new_cache(2, 96) for _ in range(2)]
    prompt = torch.randint(0, 23, (2, 9))
    lengths = torch.tensor([9, 5])
    for cache in caches:
        with torch.no_grad():
            model(prompt, cache=cache)
        cache.lengths = lengths
        cache.crop(lengths)
    tok = torch.tensor([3, 7])
    with torch.no_grad():
        got = steps.step(tok, caches[0], 4).clone()
        pos = lengths[:, None]
        ctx = model.context(pos, caches[1])
        h = model.run_layers(model.embed(tok[:, None], pos), 0, 4, cache=caches[1], ctx=ctx)
        want = model.exit_logits(h, 4)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(caches[0].fill, caches[1].fill)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values,
                    strict=True):
        for row, n in enumerate((10, 6)):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gpt2", [False, True])
def test_static_ar_and_fixed_exit_match_eager_decoding(gpt2: bool) -> None:
    model = ee_model("linear", every_layer=True, gpt2=gpt2)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    fixed = generate(model, None, prompts, strategy="early-exit", exit_layer=2,
                     max_new_tokens=NEW).token_ids
    calls = _counting(_static(model))
    assert generate(model, None, prompts, max_new_tokens=NEW).token_ids == ar
    assert generate(model, None, prompts, strategy="early-exit", exit_layer=2,
                    max_new_tokens=NEW).token_ids == fixed
    assert calls["step"] == 2 * (NEW - 1)  # every decoding step went through the program


@pytest.mark.parametrize(("head", "every", "exit_layer"),
                         [("linear", True, 2), ("linear", False, 2), ("mlp", False, 1)])
@pytest.mark.parametrize("d", [1, 3, 6])
def test_static_self_spec_rounds_equal_greedy(head: str, every: bool, exit_layer: int,
                                              d: int) -> None:
    """Whole greedy rounds in one program give plain greedy decoding's tokens, padded batch,
    through the shared head or an exit's own head."""
    model = ee_model(head, every_layer=every)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    calls = _counting(_static(model))
    got = generate(model, None, prompts, strategy="self-spec", exit_layer=exit_layer,
                   num_speculations=d, max_new_tokens=NEW)
    assert got.token_ids == ar
    # every round went through the program (the longest-running sequence was in each)
    assert calls["spec_round"] == max(s.stats.rounds for s in got.sequences) > 0


def test_static_rounds_with_rows_of_different_budgets() -> None:
    """Rows whose own limit is below the round's draft count ride along as dummies; each
    row's tokens are what it gets decoded alone, and rows leave the batch at different
    steps (the program is re-made for fewer rows)."""
    model = ee_model("linear", every_layer=True)
    prompts = random_prompts(sizes=(4, 7, 6, 2))
    alone = [generate(model, None, [p], max_new_tokens=n).token_ids[0]
             for p, n in zip(prompts, BUDGETS, strict=True)]
    calls = _counting(_static(model))
    assert self_spec_with_budgets(model, prompts, 2) == alone
    assert calls["spec_round"] > 0


def test_sampled_rows_and_block_exits_keep_the_step_loop() -> None:
    """What the static round leaves out - sampling, log-probabilities, exits with a block of
    their own - goes through the step-by-step round, with the same results as before."""
    model = ee_model("linear", every_layer=True)
    prompts = random_prompts(sizes=(5, 4))
    kw = {"strategy": "self-spec", "exit_layer": 2, "max_new_tokens": NEW, "temperature": 0.8,
          "seed": 3}
    before = generate(model, None, prompts, **kw).token_ids
    with_lp = generate(model, None, prompts, strategy="self-spec", exit_layer=2,
                       max_new_tokens=4, logprobs=2)
    calls = _counting(_static(model))
    assert generate(model, None, prompts, **kw).token_ids == before
    again = generate(model, None, prompts, strategy="self-spec", exit_layer=2,
                     max_new_tokens=4, logprobs=2)
    assert again.token_ids == with_lp.token_ids
    assert all(s.logprobs for s in again.sequences)
    assert [s.logprobs for s in again.sequences] == [s.logprobs for s in with_lp.sequences]
    assert calls["spec_round"] == 0
    block = ee_model("block", layers=(2,))
    ar = generate(block, None, prompts, max_new_tokens=NEW).token_ids
    calls = _counting(_static(block))
    got = generate(block, None, prompts, strategy="self-spec", exit_layer=2,
                   max_new_tokens=NEW).token_ids
    assert got == ar
    assert calls["spec_round"] == 0
    # plain decoding of that model leaves through the final head: its steps are static
    assert generate(block, None, prompts, max_new_tokens=NEW).token_ids == ar
    assert calls["step"] == NEW - 1


@pytest.mark.parametrize(("head", "every", "d_bar", "k"),
                         [("linear", True, 2, 1), ("linear", True, 3, 2), ("mlp", False, 2, 3),
                          ("mlp", False, 3, 1)])
def test_static_ppd_equals_greedy_with_the_same_predictions(head: str, every: bool, d_bar: int,
                                                            k: int) -> None:
    """PPD as static programs (early part + top-k, k branches, the main token's rest) gives
    greedy decoding's tokens and the step-by-step PPD's forks and confirmed predictions,
    from the first layer and from a confirmed branch's state."""
    model = ee_model(head, every_layer=every)
    prompts = random_prompts(sizes=(5, 9, 3))
    opts = {"strategy": "ppd", "ppd_layer": d_bar, "ppd_k": k, "max_new_tokens": NEW}
    want = [generate(model, None, [p], max_new_tokens=NEW).token_ids for p in prompts]
    eager = [generate(model, None, [p], parallel=False, **opts) for p in prompts]
    calls = _counting(_static(model))
    for p, w, e in zip(prompts, want, eager, strict=True):
        got = generate(model, None, [p], **opts)
        assert got.token_ids == w == e.token_ids
        assert (got.stats.forks, got.stats.matches) == (e.stats.forks, e.stats.matches)
    assert calls["ppd_step"] == len(prompts) * (NEW - 2)  # every fork went through them
    assert sum(e.stats.matches for e in eager) > 0  # the branch state was carried on
    # a long sequence grows the engine's pool (64 -> 128 positions) and the branches with it
    long = {**opts, "max_new_tokens": 90}
    got = generate(model, None, [prompts[0]], **long)
    assert got.token_ids == generate(model, None, [prompts[0]], max_new_tokens=90).token_ids
    e = generate(model, None, [prompts[0]], parallel=False, **long)
    assert (got.stats.forks, got.stats.matches) == (e.stats.forks, e.stats.matches)
