"""The CUDA-graph runner's static code, run eagerly on CPU (``capture=False``).

A CUDA graph replays exactly the static code these tests run, so what is checked here -
positions kept on the device, keys/values scattered to their positions, attention over a
power-of-two window under a mask, fill bookkeeping after the program, greedy chains without
the host - is what a GPU replays (tests/infer/test_cuda.py captures the same programs there).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from _ee_models import BUDGETS, ee_model, random_prompts, self_spec_with_budgets
from exitlm.infer import generate
from exitlm.runtime import GraphRunner, prepare
from exitlm.runtime.graphs import attended_slots
from exitlm.runtime.runner import Runner

NEW = 20


def _static(model: torch.nn.Module) -> tuple[GraphRunner, Counter[str]]:
    """A graph runner running its static code eagerly, and a count of its programs' runs by
    primitive (chain, layers, logits)."""
    runner = prepare(model, backend="static")
    assert isinstance(runner, GraphRunner)
    calls: Counter[str] = Counter()
    real = runner._run

    def counting(key, *a, **k):  # type: ignore[no-untyped-def]
        calls[key[0]] += 1
        return real(key, *a, **k)

    runner._run = counting  # type: ignore[method-assign]
    return runner, calls


def test_attended_slots_is_a_bounded_power_of_two() -> None:
    assert attended_slots(0, 160) == 64
    assert attended_slots(63, 160) == 64
    assert attended_slots(64, 160) == 128
    assert attended_slots(130, 160) == 160  # capped by the cache
    with pytest.raises(ValueError, match="overflow"):
        attended_slots(160, 160)


@pytest.mark.parametrize("gpt2", [False, True])
@torch.no_grad()
def test_static_primitives_match_the_eager_ones(gpt2: bool) -> None:
    """A plain step (chain of no draft with logits), a greedy chain, a verification's layers
    and a head: values, keys/values and fill equal the eager runner's, rows at different
    positions (a padded batch)."""
    model = ee_model("linear", every_layer=True, gpt2=gpt2)
    static, eager = GraphRunner(model, capture=False), Runner(model)
    caches = [model.new_cache(2, 96) for _ in range(2)]
    prompt = torch.randint(0, 23, (2, 9))
    lengths = torch.tensor([9, 5])
    for r, cache in zip((static, eager), caches, strict=True):
        r.prefill(prompt, lengths, cache)
    tok = torch.tensor([3, 7])
    got = static.chain(tok, caches[0], 0, 4, logits=True)
    want = eager.chain(tok, caches[1], 0, 4, logits=True)
    assert got.logits is not None and want.logits is not None
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    for c in caches:
        c.lengths += 1
    got = static.chain(tok, caches[0], 3, 2, vocab=17)
    want = eager.chain(tok, caches[1], 3, 2, vocab=17)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-5)
    pos = caches[0].lengths[:, None] + torch.arange(4)[None]
    hv = [r.layers(got.hidden, 2, 4, pos, c) for r, c in zip((static, eager), caches,
                                                              strict=True)]
    torch.testing.assert_close(hv[0], hv[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(static.logits(hv[0], 4), eager.logits(hv[1], 4), rtol=1e-4,
                               atol=1e-5)
    assert torch.equal(caches[0].fill, caches[1].fill)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values,
                    strict=True):
        for row, n in enumerate((14, 10)):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gpt2", [False, True])
def test_static_ar_and_fixed_exit_match_eager_decoding(gpt2: bool) -> None:
    model = ee_model("linear", every_layer=True, gpt2=gpt2)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    fixed = generate(model, None, prompts, strategy="early-exit", exit_layer=2,
                     max_new_tokens=NEW).token_ids
    runner, calls = _static(model)
    assert generate(runner, None, prompts, max_new_tokens=NEW).token_ids == ar
    assert generate(runner, None, prompts, strategy="early-exit", exit_layer=2,
                    max_new_tokens=NEW).token_ids == fixed
    assert calls["chain"] == 2 * (NEW - 1)  # every decoding step went through the program


@pytest.mark.parametrize(("head", "every", "exit_layer"),
                         [("linear", True, 2), ("linear", False, 2), ("mlp", False, 1)])
@pytest.mark.parametrize("d", [1, 3, 6])
def test_static_self_spec_rounds_equal_greedy(head: str, every: bool, exit_layer: int,
                                              d: int) -> None:
    """Greedy rounds on the static primitives (a chain of drafts, the verification's layers
    and head) give plain greedy decoding's tokens, padded batch, through the shared head or
    an exit's own head."""
    model = ee_model(head, every_layer=every)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    runner, calls = _static(model)
    got = generate(runner, None, prompts, strategy="self-spec", exit_layer=exit_layer,
                   num_speculations=d, max_new_tokens=NEW)
    assert got.token_ids == ar
    rounds = max(s.stats.rounds for s in got.sequences)
    assert calls["chain"] == calls["layers"] == rounds > 0


def test_static_rounds_with_rows_of_different_budgets() -> None:
    """Rows whose own limit is below the round's draft count ride along as dummies; each
    row's tokens are what it gets decoded alone, and rows leave the batch at different
    steps (programs are made for fewer rows)."""
    model = ee_model("linear", every_layer=True)
    prompts = random_prompts(sizes=(4, 7, 6, 2))
    alone = [generate(model, None, [p], max_new_tokens=n).token_ids[0]
             for p, n in zip(prompts, BUDGETS, strict=True)]
    runner, calls = _static(model)
    assert self_spec_with_budgets(runner, prompts, 2) == alone
    assert calls["chain"] > 0


def test_sampled_rows_and_block_exits_keep_the_eager_chain() -> None:
    """What the static chain leaves out - sampled drafts, exits with a block of their own -
    takes the eager chain, with the same results as before; log-probabilities too."""
    model = ee_model("linear", every_layer=True)
    prompts = random_prompts(sizes=(5, 4))
    kw = {"strategy": "self-spec", "exit_layer": 2, "num_speculations": 4,
          "max_new_tokens": NEW, "temperature": 0.8, "seed": 3}
    before = generate(model, None, prompts, **kw).token_ids
    with_lp = generate(model, None, prompts, strategy="self-spec", exit_layer=2,
                       max_new_tokens=4, logprobs=2)
    runner, calls = _static(model)
    assert generate(runner, None, prompts, **kw).token_ids == before
    assert calls["chain"] == 0
    again = generate(runner, None, prompts, strategy="self-spec", exit_layer=2,
                     max_new_tokens=4, logprobs=2)
    assert again.token_ids == with_lp.token_ids
    for a, b in zip(again.sequences, with_lp.sequences, strict=True):
        assert a.logprobs and b.logprobs
        assert [x.top[1][0] for x in a.logprobs] == [x.top[1][0] for x in b.logprobs]
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs],
                                                                abs=1e-5)
    block = ee_model("block", layers=(2,))
    ar = generate(block, None, prompts, max_new_tokens=NEW).token_ids
    runner, calls = _static(block)
    got = generate(runner, None, prompts, strategy="self-spec", exit_layer=2,
                   max_new_tokens=NEW).token_ids
    assert got == ar
    assert calls["chain"] == 0
    # plain decoding of that model leaves through the final head: its steps are static
    assert generate(runner, None, prompts, max_new_tokens=NEW).token_ids == ar
    assert calls["chain"] == NEW - 1


@pytest.mark.parametrize(("head", "every", "d_bar", "k"),
                         [("linear", True, 2, 1), ("linear", True, 3, 2), ("mlp", False, 2, 3),
                          ("mlp", False, 3, 1)])
def test_static_ppd_equals_greedy_with_the_same_predictions(head: str, every: bool, d_bar: int,
                                                            k: int) -> None:
    """PPD on the static primitives (early part, head, k branch chains, the main token's
    rest) gives greedy decoding's tokens and the serial PPD's forks and confirmed
    predictions, from the first layer and from a confirmed branch's state."""
    model = ee_model(head, every_layer=every)
    prompts = random_prompts(sizes=(5, 9, 3))
    opts = {"strategy": "ppd", "ppd_layer": d_bar, "ppd_k": k, "max_new_tokens": NEW}
    want = [generate(model, None, [p], max_new_tokens=NEW).token_ids for p in prompts]
    eager = [generate(model, None, [p], parallel=False, **opts) for p in prompts]
    runner, calls = _static(model)
    for p, w, e in zip(prompts, want, eager, strict=True):
        got = generate(runner, None, [p], parallel=False, **opts)
        assert got.token_ids == w == e.token_ids
        assert (got.stats.forks, got.stats.matches) == (e.stats.forks, e.stats.matches)
    forks = sum(e.stats.forks for e in eager)
    assert calls["chain"] == k * forks  # every branch went through the program
    assert sum(e.stats.matches for e in eager) > 0  # the branch state was carried on
    long = {**opts, "max_new_tokens": 90}  # the engine's pool grows (64 -> 128 positions)
    got = generate(runner, None, [prompts[0]], parallel=False, **long)
    assert got.token_ids == generate(model, None, [prompts[0]], max_new_tokens=90).token_ids
    e = generate(model, None, [prompts[0]], parallel=False, **long)
    assert (got.stats.forks, got.stats.matches) == (e.stats.forks, e.stats.matches)


def test_release_forgets_a_cache_s_programs() -> None:
    """The engine's pool releases its old storage when it grows: programs that read it are
    dropped (with capture off there are none to keep; the call must be harmless), and
    close() drops everything."""
    model = ee_model("linear", every_layer=True)
    runner = GraphRunner(model, capture=False)
    cache = model.new_cache(1, 64)
    runner.release(cache)
    runner.close()
    assert not runner._programs
