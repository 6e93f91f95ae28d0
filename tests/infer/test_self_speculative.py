"""Self-speculative decoding beyond the conformance suite (test_conformance.py: greedy output is
the reference's for every exit, draft length and vocabulary): draft thresholds, bonus tokens,
batch independence, speculative sampling matches the target distribution, the cache is rolled
back to the accepted tokens, lazy verification."""

from __future__ import annotations

import math

import pytest
import torch

from _ee_models import chi_square, ee_model, exact_joint, one_thread, random_prompts  # noqa: F401
from exitlm.config import ConfigError
from exitlm.infer import generate
from exitlm.infer.self_speculative import _accept_sampled

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


def test_draft_threshold_stops_drafting_without_changing_output() -> None:
    """Stopping a round's drafting at an unsure draft (batch: when every running row is
    unsure) leaves the output identical; threshold 1.0 drafts one token per round, 0.0 the
    full ``d``."""
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    kw = {"strategy": "self-spec", "exit_layer": 2, "num_speculations": 4,
          "max_new_tokens": NEW}
    full = generate(model, None, prompts, **kw)
    for batch in (prompts, [prompts[0]]):
        want = ar if len(batch) > 1 else ar[:1]
        drafted = {}
        for tau in (0.0, 0.5, 0.9, 1.0):
            got = generate(model, None, batch, draft_threshold=tau, **kw)
            assert got.token_ids == want, tau
            assert got.options["draft_threshold"] == tau
            drafted[tau] = got.stats.drafted / got.stats.rounds
        assert drafted[1.0] <= 1.0 < drafted[0.5] <= drafted[0.0]
    assert generate(model, None, prompts, draft_threshold=0.0, **kw).stats.drafted == \
        full.stats.drafted
    with pytest.raises(ConfigError, match="draft_threshold"):
        generate(model, None, prompts, draft_threshold=1.5, **kw)


def _perfect_draft_model() -> torch.nn.Module:
    """Layer 4 is an identity (zero residual branches), so exit 3 (through the final norm and
    head) equals the final output: every draft passes and every round ends with a bonus."""
    model = ee_model(every_layer=True)
    with torch.no_grad():
        model.layers[3].attn.wo.weight.zero_()
        model.layers[3].mlp.w_out.weight.zero_()
    return model


def test_all_drafts_accepted_gives_bonus_tokens() -> None:
    model = _perfect_draft_model()
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW)
    ss = generate(model, None, prompts, strategy="self-spec", exit_layer=3,
                  num_speculations=4, max_new_tokens=NEW)
    assert ss.token_ids == ar.token_ids
    assert ss.stats.acceptance_rate == 1.0
    # first token from the prompt, then rounds of 4 drafts + 1 bonus: 1 + 5 + 5 + ...
    seq = ss.sequences[0]
    assert seq.exit_layers[:7] == [4, 3, 3, 3, 3, 4, 3]
    assert ss.stats.rounds == len(prompts) * math.ceil((NEW - 1) / 5)


def test_stop_token_mid_round_and_batch_independence() -> None:
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    free = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    stop = free[1][6]
    ar = generate(model, None, prompts, max_new_tokens=NEW, stop_token_ids=(stop,))
    ss = generate(model, None, prompts, strategy="self-spec", exit_layer=2, num_speculations=5,
                  max_new_tokens=NEW, stop_token_ids=(stop,))
    assert ss.token_ids == ar.token_ids
    assert [s.finish_reason for s in ss.sequences] == [s.finish_reason for s in ar.sequences]


def test_cache_rollback_keeps_only_accepted_tokens() -> None:
    """After every round, each row's fill equals its committed length, and the kept keys
    equal those of a plain cached forward over prompt + output (nothing stale)."""
    from exitlm.infer import Engine, SamplingOptions, SelfSpecOptions

    model = ee_model(every_layer=True)
    prompts = random_prompts()
    engine = Engine(model, None, "self-spec", SelfSpecOptions(exit_layer=2, num_speculations=3),
                    max_batch=3)
    reqs = [engine.submit(p, SamplingOptions(max_new_tokens=10, ignore_eos=True))
            for p in prompts]
    engine.step()  # prefill + one round
    engine.step()  # another round
    cache = engine.pool.cache
    assert cache is not None
    for i, req in enumerate(engine.running):
        full = req.prompt_ids + req.token_ids[:-1]  # the last token is x0 of the next round
        m = int(cache.lengths[i])
        assert m == len(full)
        assert bool((cache.fill[:4, i] == m).all())
        ref = model.new_cache(1, 64)
        with torch.inference_mode():
            model(torch.tensor([full]), cache=ref)
        for layer in range(4):
            torch.testing.assert_close(cache.keys[layer][i, :, :m], ref.keys[layer][0, :, :m],
                                       atol=1e-4, rtol=1e-4)
    assert len(engine.running) == len(reqs)


@pytest.mark.parametrize(("temperature", "draft_vocab", "tau", "order"),
                         [(1.0, None, None, None), (0.7, 3, None, None), (1.0, None, 1.0, None),
                          (0.7, 3, None, (4, 2, 0, 1, 3))])
def test_speculative_sampling_matches_target_distribution(
    temperature: float, draft_vocab: int | None, tau: float | None,
    order: tuple[int, ...] | None
) -> None:
    """Chi-square goodness of fit of 3-token continuations (125 cells) from 8,000 sequences
    sampled as one batch: token 1 comes from the prompt forward, tokens 2-3 from one
    speculative round with 2 drafts (rejections and bonus tokens both occur); with a draft
    vocabulary of 3 ids, tokens 3 and 4 are only reachable through the residual (with a
    ranked vocabulary, tokens 1 and 3). With a draft threshold of 1.0 the round stops after
    its first draft (fewer drafts than asked)."""
    model = ee_model(every_layer=True, vocab=5, scale=0.5, seed=1)
    if order is not None:
        model.set_token_order(torch.tensor(order))
    prompt = [1, 3, 0, 2]
    exact = exact_joint(model, prompt, 3, temperature)
    n = 8000
    out = generate(model, None, [prompt] * n, strategy="self-spec", exit_layer=1,
                   num_speculations=2, max_new_tokens=3, temperature=temperature, seed=7,
                   ignore_eos=True, draft_vocab=draft_vocab, draft_threshold=tau)
    assert 0.03 < out.stats.acceptance_rate < 0.95
    if tau is not None:
        assert out.stats.drafted == n  # one draft per sequence, not two
    chi2, dof = chi_square(out.token_ids, exact)
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)
    # ... and the draft really differs from the target (the test is not vacuous)
    plain = generate(model, None, [prompt] * n, strategy="early-exit", exit_layer=1,
                     max_new_tokens=3, temperature=temperature, seed=7, ignore_eos=True)
    chi2_q, _ = chi_square(plain.token_ids, exact)
    assert chi2_q > dof + 10 * math.sqrt(2 * dof)


def test_rejection_sampling_step_distribution() -> None:
    """One position, exact: P(output = x) = p(x) for arbitrary q (Leviathan et al. Thm. 1)."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    q = torch.tensor([[0.5, 0.1, 0.3, 0.1]])
    n = 60000
    drafts = torch.multinomial(q.expand(n, 4), 1, replacement=True, generator=gen)  # (n, 1)
    p = torch.softmax(p_logits, -1)[:, None].expand(n, 2, 4)  # (n, n_drafts + 1, V)
    n_acc, final = _accept_sampled(drafts, q.expand(n, 4)[:, None], p, gen)
    first = torch.where(n_acc >= 1, drafts[:, 0], final)
    freq = torch.bincount(first, minlength=4).double() / n
    torch.testing.assert_close(freq, torch.softmax(p_logits[0].double(), 0), atol=0.01, rtol=0)


def test_config_errors() -> None:
    model = ee_model(layers=(2,))
    with pytest.raises(ConfigError, match="1 is not an exit of this model"):
        generate(model, None, [1, 2], strategy="self-spec", exit_layer=1)
    with pytest.raises(ConfigError, match="num_speculations"):
        generate(model, None, [1, 2], strategy="self-spec", num_speculations=0)


def test_lazy_and_batched_greedy_verification_agree() -> None:
    from exitlm.infer.self_speculative import _accept_greedy, _accept_greedy_lazy

    model = ee_model(every_layer=True)
    hv = torch.randn(6, 4, 32)
    with torch.inference_mode():
        target = model.final_logits(hv).argmax(-1)  # (6, 4)
    head = model.final_logits
    drafts = target[:, :3].clone()
    drafts[1, 0] += 1  # reject at 0
    drafts[2, 2] += 1  # reject at 2
    drafts[3, 1] += 1
    limit = torch.tensor([3, 3, 3, 3, 3, 1])  # the last row may keep one draft only
    with torch.inference_mode():
        a = _accept_greedy(head, drafts, hv, limit)
        b = _accept_greedy_lazy(head, drafts, hv, limit)
    assert a[0].tolist() == b[0].tolist() == [3, 0, 2, 1, 3, 1]
    assert a[1].tolist() == b[1].tolist()
    assert a[1].tolist() == [int(target[i, j]) for i, j in enumerate([3, 0, 2, 1, 3, 1])]


def test_verification_is_lazy_for_large_heads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy verification projects one position at a time when the runner says a product
    over several positions does not pay (a large CPU fp32 LM head, LAZY_HEAD_BYTES) and all
    positions at once otherwise; the output is AR's both ways."""
    import exitlm.infer.self_speculative as ss
    import exitlm.runtime.runner as runner

    model = ee_model(every_layer=True)
    prompts = random_prompts()
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    calls = {"lazy": 0, "all": 0}
    real_lazy, real_all = ss._accept_greedy_lazy, ss._accept_greedy

    def lazy(*a, **kw):
        calls["lazy"] += 1
        return real_lazy(*a, **kw)

    def at_once(*a, **kw):
        calls["all"] += 1
        return real_all(*a, **kw)

    monkeypatch.setattr(ss, "_accept_greedy_lazy", lazy)
    monkeypatch.setattr(ss, "_accept_greedy", at_once)
    kw = {"strategy": "self-spec", "exit_layer": 2, "num_speculations": 3,
          "max_new_tokens": NEW}
    assert generate(model, None, prompts, **kw).token_ids == ar
    assert calls["all"] > 0 and calls["lazy"] == 0  # a 23 x 32 head: one product
    monkeypatch.setattr(runner, "LAZY_HEAD_BYTES", 0)
    calls.update(lazy=0, all=0)
    assert generate(model, None, prompts, **kw).token_ids == ar
    assert calls["lazy"] > 0 and calls["all"] == 0
