"""The native Llama block (``block.c``): equal to the torch block up to rounding, exactly
row-, chunk- and thread-invariant, used by prepared models for fp32/int8/int4 weights, and
left alone when its weights move or hooks are registered."""

from __future__ import annotations

import copy

import pytest
import torch

from _byte_models import sharp_model
from exitlm.backend import decode_block, native
from exitlm.backend.cpu import prepare_for_decoding
from exitlm.backend.decode_block import LeanBlock, LeanLM
from exitlm.backend.native_block import Scratch, build_native_block
from exitlm.backend.quantized import QuantizedLinear, quantize_model
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.model.transformer import EarlyExitLM

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason())

KINDS = (None, "int8", "int4")


def _model(kind: str | None, seed: int = 0) -> EarlyExitLM:
    model = sharp_model(ModelConfig(
        vocab_size=48, dim=64, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=96, exits=ExitConfig(every_layer=True, norm="final")), seed)
    return model if kind is None else quantize_model(model, kind)


def _call(nb, model: EarlyExitLM, h: torch.Tensor, start: int, cache, threads: int = 1):
    pos = torch.arange(start, start + h.shape[1])[None]
    rope = model.context(pos).rope
    return nb(h, rope, cache.keys[0][0], cache.values[0][0], start, threads)


def _int8_activation_products(self: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantizedLinear.forward with the native blocks' int8-activation products."""
    w, x = self.weight, x.float().contiguous()
    if w.kind == "int8":
        return native.gemm_q8(x, w.q, w.scales, int8_activations=True)
    return native.gemm_q4(x, w.q, w.scales, w.mins, int8_activations=True)


@pytest.mark.parametrize(("kind", "int8_activations"),
                         [(None, True), ("int8", False), ("int4", False), ("int8", True),
                          ("int4", True)], indirect=["int8_activations"])
@torch.no_grad()
def test_native_block_matches_torch_and_is_row_chunk_thread_invariant(
        kind: str | None, int8_activations: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tol = 1e-5
    if kind is not None and int8_activations:
        # the torch block with the same int8-activation products; a last-bit difference of
        # the norms or attention can still move one activation by a rounding step
        monkeypatch.setattr(QuantizedLinear, "forward", _int8_activation_products)
        tol = 1e-3
    model = _model(kind)
    block = model.layers[0]
    nb = build_native_block(native.library(), block, Scratch())
    assert nb is not None
    t = 11
    h = torch.randn(1, t, 64)
    pos = torch.arange(t)[None]
    ref_cache = model.new_cache(1, 96)
    ctx = model.context(pos, ref_cache)
    ref = block(h, ctx.rope, ref_cache, 0, ctx.plan, ctx.mask)  # the torch modules
    cache = model.new_cache(1, 96)
    whole = _call(nb, model, h, 0, cache)
    scale = float(ref.abs().max())  # large random weights: compare at the output's scale
    torch.testing.assert_close(whole, ref, rtol=0, atol=tol * scale)
    torch.testing.assert_close(cache.keys[0][:, :, :t], ref_cache.keys[0][:, :, :t],
                               rtol=1e-5, atol=1e-5)
    rows = model.new_cache(1, 96)
    one_by_one = torch.cat([_call(nb, model, h[:, i:i + 1], i, rows) for i in range(t)], 1)
    assert torch.equal(one_by_one, whole)
    chunks = model.new_cache(1, 96)
    parts = [_call(nb, model, h[:, :4], 0, chunks, threads=2),
             _call(nb, model, h[:, 4:], 4, chunks, threads=2)]
    assert torch.equal(torch.cat(parts, 1), whole)
    assert torch.equal(chunks.keys[0], cache.keys[0])


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_models_decode_through_native_blocks(kind: str | None) -> None:
    """Plain decoding of a prepared model matches the unprepared torch modules (sharp model,
    no near-ties), and self-speculative decoding matches plain decoding exactly."""
    plain = _model(kind)
    fast = prepare_for_decoding(copy.deepcopy(plain))
    assert all(isinstance(b, LeanBlock) and b.native is not None for b in fast.layers)
    calls = 0
    real = type(fast.layers[0].native).__call__
    real_chain = decode_block.run_chain

    def counting(self, *a, **kw):
        nonlocal calls
        calls += 1
        return real(self, *a, **kw)

    def counting_chain(blocks, *a, **kw):  # runs of blocks in one call (LeanLM)
        nonlocal calls
        calls += len(blocks)
        return real_chain(blocks, *a, **kw)

    real_steps = decode_block.draft_greedy

    def counting_steps(blocks, *a, **kw):  # embedding + blocks in one call (a plain step)
        nonlocal calls
        calls += len(blocks)
        return real_steps(blocks, *a, **kw)

    prompts = [[3, 7, 1, 9, 4], [5, 2, 8]]
    kw = {"max_new_tokens": 16, "threads": 1}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(fast.layers[0].native), "__call__", counting)
        mp.setattr(decode_block, "run_chain", counting_chain)
        mp.setattr(decode_block, "draft_greedy", counting_steps)
        ar = generate(fast, None, prompts[0], **kw).token_ids
        assert calls >= 15 * 3
        ss = generate(fast, None, prompts[0], strategy="self-spec", exit_layer=1,
                      num_speculations=3, **kw).token_ids
    assert ss == ar
    assert generate(plain, None, prompts[0], **kw).token_ids == ar


@torch.no_grad()
def test_moved_weights_and_hooks_take_the_torch_path() -> None:
    model = prepare_for_decoding(_model(None))
    block = model.layers[1]
    cache = model.new_cache(1, 96)
    assert block.native.serves(block, cache, 1)
    lin = block.mlp.w_in
    lin.weight.data = lin.weight.data.clone()  # new storage: the native call must not run
    assert not block.native.serves(block, cache, 1)
    prepare_for_decoding(model, pack_rows=True)  # preparing again rebuilds the call
    assert model.layers[1].native.serves(model.layers[1], cache, 1)
    seen = []
    handle = model.layers[1].mlp.register_forward_hook(lambda *_: seen.append(1))
    try:
        assert not model.layers[1].native.serves(model.layers[1], cache, 1)
        generate(model, None, [1, 2, 3], max_new_tokens=3, threads=1)
        assert seen
    finally:
        handle.remove()


def test_prepared_model_copies_and_threads() -> None:
    """A copy of a prepared model is prepared again (its own weights); two threads decoding
    at once (PPD's branch thread) each use their own scratch memory."""
    import threading

    model = prepare_for_decoding(_model("int8"))
    twin = copy.deepcopy(model)
    assert twin.layers[0].native is None
    prepare_for_decoding(twin)
    assert twin.layers[0].native is not None
    h = model.embed(torch.tensor([[4, 5, 6]]))

    def decode() -> torch.Tensor:
        cache = model.new_cache(1, 96)
        out = []
        with torch.no_grad():
            for i in range(3):  # one position at a time: the native block's path
                pos = torch.tensor([[i]])
                out.append(model.run_layers(h[:, i:i + 1], 0, 3, pos, cache))
        return torch.cat(out, 1)

    want = decode()
    got: list = []
    workers = [threading.Thread(target=lambda: got.append(decode())) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == 4 and all(torch.equal(g, want) for g in got)


def test_fp16_model_decodes_through_the_native_block() -> None:
    """fp16 weights: the block computes in fp32 and rounds the residual stream back to fp16;
    plain decoding and self-speculative decoding agree exactly."""
    model = prepare_for_decoding(_model(None).to(torch.float16))
    assert all(b.native is not None for b in model.layers)
    kw = {"max_new_tokens": 14, "threads": 1}
    ar = generate(model, None, [3, 1, 4, 1, 5], **kw).token_ids
    ss = generate(model, None, [3, 1, 4, 1, 5], strategy="self-spec", exit_layer=2,
                  num_speculations=3, **kw).token_ids
    assert ss == ar
    with torch.no_grad():
        model.layers[0].norm_attn.weight.mul_(2)  # an fp16 norm weight changed in place
    cache = model.new_cache(1, 96)
    assert not model.layers[0].native.serves(model.layers[0], cache, 0)


def test_rounding_to_half_is_torchs() -> None:
    """The chain's float16 rounding of the residual stream (kernels.c float_to_half) is
    torch's float -> float16 cast, bit for bit: normals, subnormals, ties, overflow, NaN."""
    lib = native.library()
    gen = torch.Generator().manual_seed(8)
    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=gen, dtype=torch.int64)
    x = torch.cat([
        bits.to(torch.int32).view(torch.float32),  # every exponent, NaNs and infinities
        torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-9, 6, (100_000,),
                                                                    generator=gen),
        # exact ties and their neighbours around every half-precision value
        torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float(),
        torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                      3 * 2.0**-26, 2.0**-14, -0.0, float("inf"), -float("inf")]),
    ])
    halves = x.to(torch.float16).float()
    mids = (halves[:-1] + halves[1:]) / 2  # halfway between neighbours (exact in fp32)
    x = torch.cat([x, mids[torch.isfinite(mids)]])
    got = x.clone()
    lib.exitlm_round_to_half(got.data_ptr(), got.numel())
    want = x.to(torch.float16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("kind", (None, "int8", "fp16"))
@torch.no_grad()
def test_a_chain_of_blocks_gives_the_bits_of_its_blocks_one_by_one(
        kind: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """LeanLM runs consecutive native blocks in one call: the hidden states, every layer's
    keys/values and the cache's fill equal those of the blocks called one at a time, for one
    position and for a verification-sized chunk; a block with a hook of its own breaks the
    chain (its hook runs)."""
    model = prepare_for_decoding(_model(None).half() if kind == "fp16" else _model(kind))
    assert type(model) is LeanLM
    dtype = torch.float16 if kind == "fp16" else torch.float32
    chains: list[int] = []
    real_chain = decode_block.run_chain

    def counting_chain(blocks, *a, **kw):
        chains.append(len(blocks))
        return real_chain(blocks, *a, **kw)

    monkeypatch.setattr(decode_block, "run_chain", counting_chain)
    n = model.num_layers
    gen = torch.Generator().manual_seed(5)
    for start, m in ((0, 1), (4, 1), (5, 6)):
        h = torch.randn(1, m, 64, generator=gen).to(dtype)
        caches = [model.new_cache(1, 96), model.new_cache(1, 96)]
        for i, t in enumerate((*caches[0].keys, *caches[0].values)):  # earlier positions
            t[:, :, :start] = torch.randn(t[:, :, :start].shape, generator=gen)
            (*caches[1].keys, *caches[1].values)[i].copy_(t)
        for c in caches:
            c.fill[:] = start
        pos = torch.arange(start, start + m)[None]
        chained = model.run_layers(h, 0, n, cache=caches[0], ctx=model.context(pos, caches[0]))
        assert chains and chains[-1] == n
        one_by_one = EarlyExitLM.run_layers(model, h, 0, n, cache=caches[1],
                                            ctx=model.context(pos, caches[1]))
        assert torch.equal(chained, one_by_one)
        for a, b in zip((*caches[0].keys, *caches[0].values), (*caches[1].keys,
                                                               *caches[1].values), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(caches[0].fill, caches[1].fill)
    chains.clear()
    seen: list[int] = []
    handle = model.layers[1].register_forward_hook(lambda *_: seen.append(1))
    try:
        generate(model, None, [1, 2, 3], max_new_tokens=3, threads=1)
    finally:
        handle.remove()
    assert seen and not chains
