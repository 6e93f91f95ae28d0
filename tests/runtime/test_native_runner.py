"""The CPU runner's fused native calls against the same runner's primitive-by-primitive code:
a chain (``exitlm_chain``) against its steps through :meth:`NativeRunner.layers` and the head,
segments (``exitlm_segments``) against the segment loop, runs of blocks against blocks one by
one - bit for bit, keys/values and fill included - and the cases the calls leave to the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from _byte_models import sharp_model
from _native import needs_native
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import EarlyExitOptions, Engine, SamplingOptions, generate
from exitlm.kernels.quantized import quantize_model
from exitlm.model.kv_cache import KVCache
from exitlm.runtime import NativeRunner, prepare
from exitlm.runtime import native as native_runner
from exitlm.runtime.runner import Runner

pytestmark = needs_native

KINDS = (None, "int8", "int4")
CHAIN_KINDS = (*KINDS, "fp16")
"""Chains also run float16 models (a float16 stream, the head in fp32)."""


def _runner(kind: str | None, exits: ExitConfig | None = None, max_seq_len: int = 96,
            half: bool = False) -> NativeRunner:
    if kind == "fp16":
        kind, half = None, True
    model = sharp_model(ModelConfig(
        vocab_size=48, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=max_seq_len, exits=exits or ExitConfig(every_layer=True, norm="final")))
    model = model if kind is None else quantize_model(model, kind)
    runner = prepare(model.half() if half else model, backend="native")
    assert isinstance(runner, NativeRunner)
    return runner


def _counting(name: str) -> tuple[Callable[..., Any], list[bool]]:
    """A stand-in for ``NativeRunner.<name>`` recording, per call, whether the native call
    took it (returned something)."""
    calls: list[bool] = []
    real = getattr(NativeRunner, name)

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        out = real(self, *a, **kw)
        calls.append(out is not None)
        return out

    return counting, calls


def _caches(runner: Runner, start: int, seed: int) -> list[KVCache]:
    """Two one-row caches holding the same random keys/values before ``start``."""
    gen = torch.Generator().manual_seed(seed)
    caches = [runner.new_cache(1, 96), runner.new_cache(1, 96)]
    for i, t in enumerate((*caches[0].keys, *caches[0].values)):
        t[:, :, :start] = torch.randn(t[:, :, :start].shape, generator=gen)
        (*caches[1].keys, *caches[1].values)[i].copy_(t)
    for c in caches:
        c.fill[:] = start
        c.lengths = torch.tensor([start])
    return caches


def _same_caches(a: KVCache, b: KVCache) -> None:
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.fill, b.fill)


@pytest.mark.parametrize("kind", CHAIN_KINDS)
@torch.no_grad()
def test_a_native_chain_equals_its_steps(kind: str | None) -> None:
    """Tokens, hidden states (bit for bit), the chain's layers' keys/values and fill equal the
    eager chain's on the same runner (one native layers call per step, the head, the argmax);
    the layers after ``depth`` are left alone. Whole and restricted vocabularies, several
    offsets, 0 to 6 steps. (A float16 model's drafts could differ where two logits tie in
    float16, which the eager head rounds to and the call does not; this model has none.)"""
    runner = _runner(kind)
    for seed, (start, n, depth, vocab) in enumerate(
            ((0, 4, 2, 48), (7, 6, 1, 48), (30, 3, 3, 20), (11, 0, 2, 48), (5, 0, 4, 48))):
        fused, loop = _caches(runner, start, seed)
        token = torch.tensor([5 + seed])
        got = runner.chain(token, fused, n, depth, vocab=vocab, logits=True)
        want = Runner.chain(runner, token, loop, n, depth, vocab=vocab, logits=True)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert all(t < vocab for t in got.tokens[0].tolist())
        assert torch.equal(got.hidden, want.hidden)
        assert got.logits is not None and want.logits is not None
        assert torch.equal(got.logits, want.logits)
        _same_caches(fused, loop)
        assert fused.fill[:depth].eq(start + n + 1).all()
        assert fused.fill[depth:].eq(start).all()


@pytest.mark.parametrize("kind", (None, "int8", "fp16"))
@torch.no_grad()
def test_runs_of_native_blocks_equal_blocks_one_by_one(kind: str | None) -> None:
    """:meth:`NativeRunner.layers` runs consecutive blocks in one call: the hidden states,
    keys/values and fill equal those of the blocks called one layer at a time, for one
    position and for a verification-sized chunk."""
    runner = _runner(None, half=True) if kind == "fp16" else _runner(kind)
    dtype = torch.float16 if kind == "fp16" else torch.float32
    n = runner.num_layers
    gen = torch.Generator().manual_seed(5)
    for start, m in ((0, 1), (4, 1), (5, 6)):
        h = torch.randn(1, m, 64, generator=gen).to(dtype)
        whole, single = _caches(runner, start, start)
        pos = torch.arange(start, start + m)[None]
        chained = runner.layers(h, 0, n, pos, whole)
        one_by_one = h
        for i in range(n):
            one_by_one = runner.layers(one_by_one, i, i + 1, pos, single)
        assert torch.equal(chained, one_by_one)
        _same_caches(whole, single)


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_self_speculation_through_native_chains_equals_plain_decoding(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy self-spec takes the native chain (counted) and emits plain decoding's tokens
    with the loop's acceptance, also with a draft threshold (the chain's own stop);
    sampling keeps the loop."""
    runner = _runner(kind)
    counting, calls = _counting("_native_chain")
    monkeypatch.setattr(NativeRunner, "_native_chain", counting)
    prompt = [3, 7, 1, 9, 4]
    kw = {"max_new_tokens": 24, "threads": 1, "ignore_eos": True}
    ar = generate(runner, None, prompt, **kw).token_ids
    for e, d in ((1, 3), (2, 4), (3, 6)):
        calls.clear()
        res = generate(runner, None, prompt, strategy="self-spec", exit_layer=e,
                       num_speculations=d, **kw)
        assert res.token_ids == ar
        assert calls and all(calls)
        with monkeypatch.context() as mp:  # the loop: same drafts, so the same acceptance
            mp.setattr(NativeRunner, "_native_chain", lambda *a, **k: None)
            loop = generate(runner, None, prompt, strategy="self-spec", exit_layer=e,
                            num_speculations=d, **kw)
        assert loop.token_ids == ar
        if kind != "fp16":  # (fp16: the eager drafts' head rounds to fp16, so near-ties can
            # pick other drafts than the call's fp32 head; the output is plain decoding's)
            assert (loop.stats.accepted, loop.stats.drafted) == (res.stats.accepted,
                                                                 res.stats.drafted)
    calls.clear()
    thr = generate(runner, None, prompt, strategy="self-spec", exit_layer=2,
                   num_speculations=4, draft_threshold=0.5, **kw)
    assert thr.token_ids == ar and calls and all(calls)  # the chain stops at unsure drafts
    calls.clear()
    generate(runner, None, prompt, strategy="self-spec", exit_layer=2, num_speculations=4,
             temperature=0.8, seed=1, **kw)
    assert not calls


@torch.no_grad()
def test_chains_the_native_call_does_not_take() -> None:
    """The eager chain runs (with the same result shape) for a hooked final norm, a batch of
    two, a cache too short and an exit with a head of its own; an fp16 model's drafts take
    the call."""
    runner = _runner(None)
    token = torch.tensor([1])

    def native_took(r: NativeRunner, cache: KVCache, n: int = 3, tokens: torch.Tensor = token
                    ) -> bool:
        took: list[bool] = []
        real = NativeRunner._native_chain

        def spy(self, *a, **k):  # type: ignore[no-untyped-def]
            out = real(self, *a, **k)
            took.append(out is not None)
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(NativeRunner, "_native_chain", spy)
            out = r.chain(tokens, cache, n, 2)
        assert out.tokens.shape == (tokens.shape[0], n)
        return bool(took and took[0])

    assert native_took(runner, _caches(runner, 4, 0)[0])
    handle = runner.model.norm.register_forward_hook(lambda *_: None)
    try:
        assert not native_took(runner, _caches(runner, 4, 0)[0])
    finally:
        handle.remove()
    assert not native_took(runner, runner.new_cache(2, 96), tokens=torch.tensor([1, 2]))
    short = runner.new_cache(1, 6)
    short.lengths = torch.tensor([4])
    with pytest.raises(ValueError, match="KV cache overflow"):
        runner.chain(token, short, 3, 2)
    half = _runner(None, half=True)
    assert native_took(half, half.new_cache(1, 96))
    own = _runner(None, ExitConfig(layers=(2,)))
    assert not native_took(own, own.new_cache(1, 96))
    assert native_took(own, own.new_cache(1, 96), n=0)  # no head in the call: it takes it


def _early_exit_run(runner: Runner, prompt: list[int], opts: EarlyExitOptions, steps: int
                    ) -> tuple[list[int], list[int], int, tuple[int, int], list[torch.Tensor]]:
    """Tokens, exit layers, layer evaluations, (recompute evaluations, forced passes) and the
    final cache/hidden state of one sequence decoded by the engine."""
    engine = Engine(runner, None, "early-exit", opts, max_batch=1)
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
def test_native_segments_equal_the_segment_loop(kind: str | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens, exit layers, layer evaluations, recomputation counts, every layer's
    keys/values, fill and the pending tokens' hidden states equal the segment loop's, at
    thresholds that exit often (with forced full passes) and never."""
    runner = _runner(kind)
    counting, calls = _counting("_native_segments")
    prompt = [3, 7, 1, 9, 4, 11]
    early = 0
    for threshold, pending, checks in ((0.0, 3, (2,)), (0.3, 2, None), (0.6, 8, (1, 2, 3)),
                                       (0.9, 4, (1, 3)), (1.0, 8, None)):
        opts = EarlyExitOptions(threshold=threshold, max_pending=pending, exit_layers=checks)
        calls.clear()
        with monkeypatch.context() as mp:
            mp.setattr(NativeRunner, "_native_segments", counting)
            got = _early_exit_run(runner, prompt, opts, 20)
        assert calls and all(calls)
        with monkeypatch.context() as mp:
            mp.setattr(NativeRunner, "_native_segments", lambda *a, **k: None)
            want = _early_exit_run(runner, prompt, opts, 20)
        assert got[:4] == want[:4], (threshold, pending, checks)
        for a, b in zip(got[4], want[4], strict=True):
            assert torch.equal(a, b)
        early += sum(x < runner.num_layers for x in got[1])
        if threshold == 1.0:
            assert set(got[1]) == {runner.num_layers}
    assert early > 0


def test_long_pending_runs_take_the_segment_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """More pending positions than the native blocks take (NATIVE_ROWS) leave the step to
    the segment loop: the output equals the loop's throughout."""
    rows = native_runner.NATIVE_ROWS
    runner = _runner(None, max_seq_len=256)
    counting, calls = _counting("_native_segments")
    opts = EarlyExitOptions(threshold=0.0, max_pending=rows + 20, exit_layers=(1,))
    with monkeypatch.context() as mp:
        mp.setattr(NativeRunner, "_native_segments", counting)
        got = _early_exit_run(runner, [3, 7, 1], opts, rows + 30)
    assert calls[:rows - 1] == [True] * (rows - 1)
    assert False in calls  # the long pending runs went to the loop
    with monkeypatch.context() as mp:
        mp.setattr(NativeRunner, "_native_segments", lambda *a, **k: None)
        want = _early_exit_run(runner, [3, 7, 1], opts, rows + 30)
    assert got[:4] == want[:4]
    for a, b in zip(got[4], want[4], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_plain_and_fixed_exit_steps_take_the_native_chain(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """AR and fixed-layer exit of one sequence take the native chain (counted) and emit the
    tokens of the loop; a batch of two keeps the eager chain."""
    runner = _runner(kind)
    counting, calls = _counting("_native_chain")
    prompt = [3, 7, 1, 9, 4]
    kw = {"max_new_tokens": 20, "threads": 1, "ignore_eos": True}
    for extra in ({}, {"strategy": "early-exit", "exit_layer": 2}):
        monkeypatch.setattr(NativeRunner, "_native_chain", counting)
        calls.clear()
        got = generate(runner, None, prompt, **kw, **extra)
        assert len(calls) == 19 and all(calls)
        calls.clear()
        generate(runner, None, [prompt, [5, 2, 8]], **kw, **extra)
        assert not any(calls)
        monkeypatch.setattr(NativeRunner, "_native_chain", lambda *a, **k: None)
        want = generate(runner, None, prompt, **kw, **extra)
        assert got.token_ids == want.token_ids
        assert got.sequences[0].exit_layers == want.sequences[0].exit_layers


@torch.no_grad()
def test_moved_weights_rebuild_the_call_and_hooks_take_the_torch_path() -> None:
    runner = _runner(None)
    model = runner.model
    cache = runner.new_cache(1, 96)
    assert runner._serves(1, cache)
    lin = model.layers[1].mlp.w_in
    lin.weight.data = lin.weight.data.clone().share_memory_()  # storage moved, same module
    assert runner._serves(1, cache)  # a new call points at the new storage
    seen: list[int] = []
    handle = model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
    try:
        assert not runner._serves(1, cache)
        generate(runner, None, [1, 2, 3], max_new_tokens=3, threads=1)
        assert seen
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", CHAIN_KINDS)
@torch.no_grad()
def test_a_short_prompt_is_prefilled_through_the_blocks(kind: str | None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A short prompt goes through the native blocks without the eager layers: hidden
    states and keys/values equal those of one-position steps bit for bit (every row's
    arithmetic is that of a step); so do a batch of short prompts, each row's real positions
    with its own bits; long prompts (96 rows here) take the eager layers."""
    from exitlm.model.transformer import EarlyExitLM

    runner = _runner(kind)
    eager: list[int] = []
    real = EarlyExitLM.run_layers
    monkeypatch.setattr(EarlyExitLM, "run_layers",
                        lambda self, *a, **k: eager.append(1) or real(self, *a, **k))
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    cache = runner.new_cache(1, 96)
    h = runner.prefill(tokens, torch.tensor([6]), cache)
    assert not eager and cache.lengths.tolist() == [6]
    ref = runner.new_cache(1, 96)
    steps = []
    for i in range(6):
        pos = torch.tensor([[i]])
        steps.append(runner.layers(runner.embed(tokens[:, i : i + 1], pos), 0, 4, pos, ref))
    assert torch.equal(h, torch.cat(steps, 1))
    for a, b in zip((*cache.keys, *cache.values), (*ref.keys, *ref.values), strict=True):
        assert torch.equal(a[:, :, :6], b[:, :, :6])
    pair = runner.new_cache(2, 96)
    both = runner.prefill(torch.tensor([[3, 1, 4, 1, 5, 9], [2, 7, 1, 0, 0, 0]]),
                          torch.tensor([6, 3]), pair)
    assert not eager and pair.lengths.tolist() == [6, 3]
    assert torch.equal(both[0], h[0])
    short = runner.prefill(torch.tensor([[2, 7, 1]]), torch.tensor([3]), runner.new_cache(1, 96))
    assert torch.equal(both[1, :3], short[0])
    runner.prefill(torch.randint(0, 40, (2, 48)), torch.tensor([48, 48]), runner.new_cache(2, 96))
    assert eager


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.no_grad()
def test_a_long_prompt_of_quantized_blocks_is_prefilled_in_chunks(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than one native call takes (quantized weights) goes through the blocks
    in chunks, each attending to those before it: the bits of one-position steps, the states
    at an exit concatenated over the chunks, no eager layer."""
    from exitlm.model.transformer import EarlyExitLM
    from exitlm.runtime.native import NATIVE_ROWS

    runner = _runner(kind, max_seq_len=256)
    eager: list[int] = []
    real = EarlyExitLM.run_layers
    monkeypatch.setattr(EarlyExitLM, "run_layers",
                        lambda self, *a, **k: eager.append(1) or real(self, *a, **k))
    n = NATIVE_ROWS + 40
    tokens = torch.randint(0, 48, (1, n), generator=torch.Generator().manual_seed(2))
    cache = runner.new_cache(1, 256)
    taps: dict[int, torch.Tensor] = {}
    h = runner.prefill(tokens, torch.tensor([n]), cache, exits=(2,), taps=taps)
    assert not eager and cache.lengths.tolist() == [n] and taps[2].shape[1] == n
    ref = runner.new_cache(1, 256)
    for i in range(n):
        pos = torch.tensor([[i]])
        x = runner.embed(tokens[:, i : i + 1], pos)
        mid = runner.layers(x, 0, 2, pos, ref)
        assert torch.equal(taps[2][:, i : i + 1], mid)
        assert torch.equal(h[:, i : i + 1], runner.layers(mid, 2, 4, pos, ref))


@pytest.mark.parametrize("kind", CHAIN_KINDS)
@torch.no_grad()
def test_a_batch_steps_through_the_blocks_with_each_sequences_bits(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows of a batch (each at its own positions of its own cache row) go through the
    native blocks in one call per run of layers: each row's hidden states and keys/values
    are those of its sequence alone, bit for bit, so batched decoding - plain and
    self-speculative - gives every sequence the tokens it gets alone."""
    runner = _runner(kind)
    dim = runner.model.config.dim
    gen = torch.Generator().manual_seed(5)
    starts, t = [7, 2, 11], 3
    alone = [_caches(runner, s, seed=s)[0] for s in starts]
    pool = runner.new_cache(len(starts), 96)
    for b, c in enumerate(alone):  # the same history in row b of a batch's cache
        for u, v in zip((*pool.keys, *pool.values), (*c.keys, *c.values), strict=True):
            u[b] = v[0]
    h = torch.randn(len(starts), t, dim, generator=gen).to(runner.dtype)
    pos = torch.tensor([[s + j for j in range(t)] for s in starts])
    calls: list[Any] = []
    real = native_runner.run_chain
    monkeypatch.setattr(native_runner, "run_chain",
                        lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    got = runner.layers(h, 0, 4, pos, pool)
    assert len(calls) == 1 and calls[0] is not None  # one batched native call
    for b, c in enumerate(alone):
        want = runner.layers(h[b : b + 1], 0, 4, pos[b : b + 1], c)
        assert torch.equal(got[b], want[0])
        for u, v in zip((*pool.keys, *pool.values), (*c.keys, *c.values), strict=True):
            assert torch.equal(u[b, :, : starts[b] + t], v[0, :, : starts[b] + t])
        assert pool.fill[:, b].tolist() == [starts[b] + t] * 4
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [9, 9]]
    kw = {"max_new_tokens": 10, "threads": 1, "ignore_eos": True}
    single = [generate(runner, None, p, **kw).token_ids[0] for p in prompts]
    calls.clear()
    assert generate(runner, None, prompts, **kw).token_ids == single
    assert any(c is not None for c in calls)
    assert generate(runner, None, prompts, strategy="self-spec", exit_layer=2,
                    num_speculations=3, **kw).token_ids == single


@torch.no_grad()
def test_a_batch_over_long_caches_on_two_threads_keeps_each_sequences_bits() -> None:
    """Rows of a batch at 70-86 cached positions, on two threads: the blocks then share the
    attention's (head, row) items between the threads (block.c, from 1024 head x row x
    position triples); each row's hidden states are still those of its sequence alone on one
    thread, bit for bit."""
    from exitlm.kernels.blas import thread_split

    runner = _runner(None)
    dim = runner.model.config.dim
    gen = torch.Generator().manual_seed(8)
    starts, t = [70, 77, 83], 3
    alone = [_caches(runner, s, seed=s)[0] for s in starts]
    pool = runner.new_cache(len(starts), 96)
    for b, c in enumerate(alone):
        for u, v in zip((*pool.keys, *pool.values), (*c.keys, *c.values), strict=True):
            u[b] = v[0]
    h = torch.randn(len(starts), t, dim, generator=gen)
    pos = torch.tensor([[s + j for j in range(t)] for s in starts])
    with thread_split(1, 2):
        got = runner.layers(h, 0, 4, pos, pool)
    for b, c in enumerate(alone):
        want = runner.layers(h[b : b + 1], 0, 4, pos[b : b + 1], c)
        assert torch.equal(got[b], want[0]), b


@torch.no_grad()
def test_a_prepared_run_notices_changes_between_steps() -> None:
    """A step reuses the run of native calls made for its layers after one check of the whole
    run (``_intact_run``); a hook added, a weight's storage replaced, a layer swapped for
    another between two steps each fail that check, and the step then gives what a runner
    prepared afresh for the changed model gives, bit for bit."""
    import copy

    runner = _runner(None)
    model = runner.model
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, 2, model.config.dim, generator=gen)

    def step(start: int) -> None:
        mine, fresh = _caches(runner, start, seed=start)
        pos = torch.tensor([[start, start + 1]])
        got = runner.layers(h, 0, 4, pos, mine)
        want = prepare(model, backend="native").layers(h, 0, 4, pos, fresh)
        assert torch.equal(got, want)
        _same_caches(mine, fresh)

    cache = runner.new_cache(1, 96)
    runner.layers(h, 0, 4, torch.tensor([[0, 1]]), cache)
    assert runner._intact_run(0, 4, cache) is not None
    seen: list[int] = []
    handle = model.layers[2].mlp.register_forward_hook(lambda *_: seen.append(1))
    assert runner._intact_run(0, 4, cache) is None
    step(5)
    assert seen  # the hooked layer ran through the module
    handle.remove()
    assert runner._intact_run(0, 4, cache) is not None
    lin = model.layers[1].attn.wo
    lin.weight.data = lin.weight.data.clone() * 0.5  # same module, new storage
    assert runner._intact_run(0, 4, cache) is None
    step(7)
    layer = copy.deepcopy(model.layers[3])
    layer.mlp.w_out.weight.mul_(-1.0)
    model.layers[3] = layer
    assert runner._intact_run(0, 4, cache) is None
    step(9)
    runner.layers(h, 0, 4, torch.tensor([[11, 12]]), cache)
    assert runner._intact_run(0, 4, cache) is not None  # rebuilt for the changed model


def test_threads_decode_with_their_own_scratch() -> None:
    """Two threads decoding at once (PPD's branch threads) each use their own scratch."""
    import threading

    runner = _runner("int8")
    h = runner.embed(torch.tensor([[4, 5, 6]]))

    def decode() -> torch.Tensor:
        cache = runner.new_cache(1, 96)
        out = []
        with torch.no_grad():
            for i in range(3):  # one position at a time: the native blocks
                pos = torch.tensor([[i]])
                out.append(runner.layers(h[:, i:i + 1], 0, 4, pos, cache))
        return torch.cat(out, 1)

    want = decode()
    got: list[torch.Tensor] = []
    workers = [threading.Thread(target=lambda: got.append(decode())) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == 4 and all(torch.equal(g, want) for g in got)


def test_fp16_model_decodes_through_the_native_blocks() -> None:
    """fp16 weights: the blocks compute in fp32 and round the residual stream back to fp16;
    plain decoding and self-speculative decoding agree exactly; an fp16 norm weight changed
    in place stops the call."""
    runner = _runner(None, half=True)
    assert all(b is not None for b in runner.blocks)
    kw = {"max_new_tokens": 14, "threads": 1}
    ar = generate(runner, None, [3, 1, 4, 1, 5], **kw).token_ids
    ss = generate(runner, None, [3, 1, 4, 1, 5], strategy="self-spec", exit_layer=2,
                  num_speculations=3, **kw).token_ids
    assert ss == ar
    with torch.no_grad():
        runner.model.layers[0].norm_attn.weight.mul_(2)
    assert not runner._serves(0, runner.new_cache(1, 96))


def test_row_products_are_packed_only_where_eager_products_of_rows_run() -> None:
    """One sequence's verification and batches' steps run in the native blocks: no packed
    copies of the blocks' weights (twice the weight memory, ~0.7 s per engine for SmolLM2);
    for batches the weights outside the blocks get them, and with a layer the native block
    does not take, that layer's - with the same tokens either way."""
    runner = _runner(None)
    prompt = [3, 7, 1, 9, 4]
    kw = {"max_new_tokens": 12, "threads": 1, "ignore_eos": True}
    ar = generate(runner, None, prompt, **kw).token_ids
    spec = generate(runner, None, prompt, strategy="self-spec", exit_layer=2,
                    num_speculations=3, **kw)
    assert spec.token_ids == ar
    assert runner.products is not None and not runner.products.pack_rows
    runner.enable_row_products(2)  # a batch of two sequences
    assert runner.products.pack_rows
    inside = [m.weight for m in runner.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert inside and all(runner.products.pack_of(w) is None for w in inside)
    both = generate(runner, None, [prompt, prompt[:3]], strategy="self-spec", exit_layer=2,
                    num_speculations=3, **kw)
    assert both.token_ids[0] == ar[0]
    partial = _runner(None)
    partial.blocks[1] = None  # a layer the native block does not take: eager rows
    partial.enable_row_products(1)
    assert partial.products is not None and partial.products.pack_rows
