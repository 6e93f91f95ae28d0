"""Decoding steps in one native call against the Python loops they replace: greedy
self-drafting (LeanLM.draft_greedy, block.c's exitlm_draft_greedy) and confidence early exit
with KV recomputation (LeanLM.early_exit_step, exitlm_early_exit_step); self-speculative
decoding through the drafts equals plain decoding, early exit equals the cache-free
reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from _byte_models import sharp_model
from exitlm.backend import native
from exitlm.backend.cpu import prepare_for_decoding
from exitlm.backend.decode_block import LeanLM
from exitlm.backend.quantized import quantize_model
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import EarlyExitOptions, Engine, SamplingOptions, generate
from exitlm.infer.kv_recompute import reference_decode
from exitlm.model.transformer import EarlyExitLM

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason())

KINDS = (None, "int8", "int4")


def _model(kind: str | None, exits: ExitConfig | None = None, max_seq_len: int = 96
           ) -> EarlyExitLM:
    model = sharp_model(ModelConfig(
        vocab_size=48, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=max_seq_len, exits=exits or ExitConfig(every_layer=True, norm="final")))
    model = model if kind is None else quantize_model(model, kind)
    return prepare_for_decoding(model)


def _counting(name: str) -> tuple[Callable[..., Any], list[bool]]:
    """A stand-in for ``LeanLM.<name>`` that calls it and records, per call, whether the
    native call took the step (returned something), and that record."""
    calls: list[bool] = []
    real = getattr(LeanLM, name)

    def counting(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(out is not None)
        return out

    return counting, calls


def _caches(model: EarlyExitLM, start: int, seed: int):
    """Two caches holding the same random keys/values before ``start``."""
    gen = torch.Generator().manual_seed(seed)
    caches = [model.new_cache(1, 96), model.new_cache(1, 96)]
    for i, t in enumerate((*caches[0].keys, *caches[0].values)):
        t[:, :, :start] = torch.randn(t[:, :, :start].shape, generator=gen)
        (*caches[1].keys, *caches[1].values)[i].copy_(t)
    for c in caches:
        c.fill[:] = start
        c.lengths = torch.tensor([start])
    return caches


def _loop(model: EarlyExitLM, token: int, n: int, exit_layer: int, cache, start: int,
          vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What SelfSpecDecoder._draft computes for one greedy sequence, step by step."""
    drafts, queries = [], []
    for j in range(n + 1):
        pos = torch.tensor([[start + j]])
        ctx = model.context(pos, cache)
        h = EarlyExitLM.run_layers(model, model.embed(torch.tensor([[token]]), pos), 0,
                                   exit_layer, cache=cache, ctx=ctx)
        queries.append(h[0, 0])
        if j < n:
            feats, weight = model.exit_features(h, exit_layer, cache=cache, ctx=ctx)
            token = int(torch.argmax(model.project(feats, weight[:vocab])[0, 0]))
            drafts.append(token)
    return torch.tensor(drafts, dtype=torch.long), torch.stack(queries)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_native_drafts_equal_the_step_by_step_loop(kind: str | None) -> None:
    """Drafts, exit queries (bit for bit), the draft layers' keys/values and fill equal the
    loop's; the layers after the exit are left alone. Whole vocabulary and a restricted
    draft vocabulary, at several offsets, 0 to 6 drafts."""
    model = _model(kind)
    assert type(model) is LeanLM
    for seed, (start, n, exit_layer, vocab) in enumerate(
            ((0, 4, 2, 48), (7, 6, 1, 48), (30, 3, 3, 20), (11, 0, 2, 48))):
        native_cache, loop_cache = _caches(model, start, seed)
        token = 5 + seed
        got = model.draft_greedy(token, n, exit_layer, native_cache, start, vocab)
        assert got is not None
        drafts, queries = got
        want_drafts, want_queries = _loop(model, token, n, exit_layer, loop_cache, start, vocab)
        assert drafts.tolist() == want_drafts.tolist()
        assert all(t < vocab for t in drafts.tolist())
        assert torch.equal(queries, want_queries)
        for a, b in zip((*native_cache.keys, *native_cache.values),
                        (*loop_cache.keys, *loop_cache.values), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(native_cache.fill, loop_cache.fill)
        assert native_cache.fill[:exit_layer].eq(start + n + 1).all()
        assert native_cache.fill[exit_layer:].eq(start).all()


@pytest.mark.parametrize("kind", KINDS)
def test_self_speculative_decoding_through_native_drafts_equals_plain_decoding(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy self-spec takes the native drafts (counted) and emits plain decoding's tokens
    with the loop's acceptance; a draft threshold or sampling keeps the loop."""
    model = _model(kind)
    counting, calls = _counting("draft_greedy")

    monkeypatch.setattr(LeanLM, "draft_greedy", counting)
    prompt = [3, 7, 1, 9, 4]
    kw = {"max_new_tokens": 24, "threads": 1, "ignore_eos": True}
    ar = generate(model, None, prompt, **kw).token_ids
    for e, d in ((1, 3), (2, 4), (3, 6)):
        calls.clear()
        res = generate(model, None, prompt, strategy="self-spec", exit_layer=e,
                       num_speculations=d, **kw)
        assert res.token_ids == ar
        assert calls and all(calls)
        with monkeypatch.context() as mp:  # the loop: same drafts, so the same acceptance
            mp.setattr(LeanLM, "draft_greedy", lambda *a, **k: None)
            loop = generate(model, None, prompt, strategy="self-spec", exit_layer=e,
                            num_speculations=d, **kw)
        assert loop.token_ids == ar
        assert loop.stats.accepted == res.stats.accepted
        assert loop.stats.drafted == res.stats.drafted
    calls.clear()
    thr = generate(model, None, prompt, strategy="self-spec", exit_layer=2,
                   draft_threshold=0.5, **kw)
    assert thr.token_ids == ar and not calls
    generate(model, None, prompt, strategy="self-spec", exit_layer=2, temperature=0.8,
             seed=1, **kw)
    assert not calls


@torch.no_grad()
def test_models_and_caches_the_call_does_not_take() -> None:
    """None (the loop drafts) for a hooked final norm, an fp16 model, a batch of two, an
    exit with a head of its own, and a cache too short for the round."""
    model = _model(None)
    cache = _caches(model, 4, 0)[0]
    assert model.draft_greedy(1, 3, 2, cache, 4, 48) is not None
    handle = model.norm.register_forward_hook(lambda *_: None)
    try:
        assert model.draft_greedy(1, 3, 2, cache, 4, 48) is None
    finally:
        handle.remove()
    assert model.draft_greedy(1, 3, 2, model.new_cache(2, 96), 4, 48) is None
    assert model.draft_greedy(1, 3, 2, model.new_cache(1, 6), 4, 48) is None
    half = prepare_for_decoding(sharp_model(ModelConfig(
        vocab_size=48, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=96, exits=ExitConfig(every_layer=True, norm="final"))).half())
    assert type(half) is LeanLM
    assert half.draft_greedy(1, 3, 2, half.new_cache(1, 96), 4, 48) is None
    own = _model(None, ExitConfig(layers=(2,)))
    assert own.draft_greedy(1, 3, 2, own.new_cache(1, 96), 4, 48) is None


def _early_exit_run(model: EarlyExitLM, prompt: list[int], opts: EarlyExitOptions, steps: int
                    ) -> tuple[list[int], list[int], int, tuple[int, int], list[torch.Tensor]]:
    """Tokens, exit layers, layer evaluations, (recompute evaluations, forced passes) and the
    final cache/hidden state of one sequence decoded by the engine."""
    engine = Engine(model, None, "early-exit", opts, max_batch=1)
    req = engine.submit(prompt, SamplingOptions(max_new_tokens=steps + 4, ignore_eos=True))
    for _ in range(steps):
        engine.step()
    cache = engine.pool.cache
    assert cache is not None
    n = int(cache.lengths[0])
    state = [t[0, :, :n].clone() for t in (*cache.keys, *cache.values)]
    state += [cache.fill[:, 0].clone(), engine.pool.aux["hidden"][0, :n].clone()]
    stats = req.stats
    return (list(req.token_ids), list(req.exit_layers), req.layer_evaluations,
            (stats.recompute_evaluations, stats.forced_full), state)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", KINDS)
def test_native_early_exit_equals_the_segment_loop(kind: str | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens, exit layers, layer evaluations, recomputation counts, every layer's
    keys/values, fill and the pending tokens' hidden states equal the segment-by-segment
    decoder's, at thresholds that exit often (with forced full passes) and never."""
    model = _model(kind)
    counting, calls = _counting("early_exit_step")

    prompt = [3, 7, 1, 9, 4, 11]
    early = 0
    for threshold, pending, checks in ((0.0, 3, (2,)), (0.3, 2, None), (0.6, 8, (1, 2, 3)),
                                       (0.9, 4, (1, 3)), (1.0, 8, None)):
        opts = EarlyExitOptions(threshold=threshold, max_pending=pending, exit_layers=checks)
        calls.clear()
        with monkeypatch.context() as mp:
            mp.setattr(LeanLM, "early_exit_step", counting)
            got = _early_exit_run(model, prompt, opts, 20)
        assert calls and all(calls)
        with monkeypatch.context() as mp:
            mp.setattr(LeanLM, "early_exit_step", lambda *a, **k: None)
            want = _early_exit_run(model, prompt, opts, 20)
        assert got[:4] == want[:4], (threshold, pending, checks)
        for a, b in zip(got[4], want[4], strict=True):
            assert torch.equal(a, b)
        early += sum(x < model.num_layers for x in got[1])
        if threshold == 1.0:
            assert set(got[1]) == {model.num_layers}
    assert early > 0


@torch.no_grad()
def test_native_early_exit_equals_the_cache_free_reference() -> None:
    """The native steps decode what the slow reference (whole prefix, no cache, same exit
    rule) decodes."""
    model = _model(None)
    checks = (1, 2, 3)
    for prompt, threshold, pending in (([3, 7, 1, 9, 4], 0.3, 3), ([5, 2, 8], 0.6, 8),
                                       ([1, 1, 2, 3, 5, 8, 13], 0.3, 1)):
        got = generate(model, None, prompt, strategy="early-exit", threshold=threshold,
                       max_pending=pending, exit_layers=checks, max_new_tokens=16)
        ref, layers = reference_decode(model, prompt, 16, checks, threshold, pending)
        assert got.token_ids[0] == ref
        assert got.sequences[0].exit_layers == layers


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_native_plain_step_gives_the_bits_of_embedding_and_layers(kind: str | None) -> None:
    """LeanLM.step_hidden (a plain step's embedding and layers in one call) returns and
    writes the bits of embed + run_layers, up to the last layer or an exit."""
    model = _model(kind)
    for seed, (start, end) in enumerate(((0, 4), (9, 4), (30, 2))):
        native_cache, loop_cache = _caches(model, start, seed)
        got = model.step_hidden(7 + seed, end, native_cache, start)
        assert got is not None and got.shape == (1, 1, 64)
        pos = torch.tensor([[start]])
        want = EarlyExitLM.run_layers(model, model.embed(torch.tensor([[7 + seed]]), pos), 0,
                                      end, cache=loop_cache, ctx=model.context(pos, loop_cache))
        assert torch.equal(got, want)
        for a, b in zip((*native_cache.keys, *native_cache.values),
                        (*loop_cache.keys, *loop_cache.values), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(native_cache.fill, loop_cache.fill)


@pytest.mark.parametrize("kind", KINDS)
def test_plain_and_fixed_exit_decoding_through_the_native_step(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """AR and fixed-layer exit of one sequence take the native step (counted) and emit the
    tokens of the step-by-step path; a batch of two keeps the general step."""
    model = _model(kind)
    counting, calls = _counting("step_hidden")

    prompt = [3, 7, 1, 9, 4]
    kw = {"max_new_tokens": 20, "threads": 1, "ignore_eos": True}
    for extra in ({}, {"strategy": "early-exit", "exit_layer": 2}):
        monkeypatch.setattr(LeanLM, "step_hidden", counting)
        calls.clear()
        got = generate(model, None, prompt, **kw, **extra)
        assert len(calls) == 19 and all(calls)
        calls.clear()
        generate(model, None, [prompt, [5, 2, 8]], **kw, **extra)
        assert not calls
        monkeypatch.setattr(LeanLM, "step_hidden", lambda *a, **k: None)
        want = generate(model, None, prompt, **kw, **extra)
        assert got.token_ids == want.token_ids
        assert got.sequences[0].exit_layers == want.sequences[0].exit_layers


def test_long_pending_runs_take_the_segment_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """More pending positions than the native blocks take (NATIVE_ROWS) leave the step to
    the segment loop, which runs them as before: the output equals the loop's throughout."""
    from exitlm.backend.decode_block import NATIVE_ROWS

    model = _model(None, max_seq_len=256)
    counting, calls = _counting("early_exit_step")

    opts = EarlyExitOptions(threshold=0.0, max_pending=NATIVE_ROWS + 20, exit_layers=(1,))
    with monkeypatch.context() as mp:
        mp.setattr(LeanLM, "early_exit_step", counting)
        got = _early_exit_run(model, [3, 7, 1], opts, NATIVE_ROWS + 30)
    assert calls[:NATIVE_ROWS - 1] == [True] * (NATIVE_ROWS - 1)
    assert False in calls  # the long pending runs went to the loop
    with monkeypatch.context() as mp:
        mp.setattr(LeanLM, "early_exit_step", lambda *a, **k: None)
        want = _early_exit_run(model, [3, 7, 1], opts, NATIVE_ROWS + 30)
    assert got[:4] == want[:4]
    for a, b in zip(got[4], want[4], strict=True):
        assert torch.equal(a, b)
