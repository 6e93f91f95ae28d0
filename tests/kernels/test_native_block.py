"""The native Llama block (``block.c``): equal to the torch block up to rounding, exactly
row-, chunk- and thread-invariant; its float16 rounding is torch's. (How a runner uses it:
tests/runtime/test_native_runner.py.)"""

from __future__ import annotations

import pytest
import torch

from _byte_models import sharp_model
from _native import needs_native
from exitlm.config import ExitConfig, ModelConfig
from exitlm.kernels import native
from exitlm.kernels.native_block import Scratch, build_native_block
from exitlm.kernels.quantized import QuantizedLinear, quantize_model
from exitlm.model.transformer import EarlyExitLM

pytestmark = needs_native

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


@pytest.mark.parametrize("int8_activations", [False, True], indirect=True)
@torch.no_grad()
def test_q4_0_weights_read_no_mins_and_keep_their_bits(
        int8_activations: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of Q4_0 weights (mins = -8 * scales: the kernels compute the mins, block.c gets
    no mins array) gives the bits of the same block reading the explicit mins."""
    from exitlm.kernels.quant import QuantizedWeight

    model = _model("int4")
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            w = mod.weight
            mod.hold(QuantizedWeight("int4", w.q, w.scales, w.scales * -8.0))
    block = model.layers[0]
    h = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    outs = []
    for explicit in (False, True):
        if explicit:  # as if the mins had been other numbers
            monkeypatch.setattr(QuantizedWeight, "kernel_mins", lambda self: self.mins)
        assert (block.attn.wo.weight.kernel_mins() is None) != explicit
        nb = build_native_block(native.library(), block, Scratch())
        assert nb is not None
        outs.append([_call(nb, model, h, 0, model.new_cache(1, 96), threads=t) for t in (1, 2)])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 4, 2), (40, 2, 2), (12, 3, 1)])
@torch.no_grad()
def test_rows_after_a_cache_attend_with_each_rows_bits_on_any_threads(
        head_dim: int, heads: int, kv_heads: int) -> None:
    """Every row of a call of 1-9 rows (verifying drafts) after a cache of 37 or 300 positions
    has the bits of that row called alone on one thread, with 1, 2 or 3 threads (block.c runs
    the attention's (head, row) items on the pool from 1024 (head, row, position) triples):
    the attention's four-position blocks of scores, their tails and the value sums, for a
    head_dim of 64 (attention_values' one pass), 40 (a pass of 32 and 8 values one by one)
    and 12 (not a multiple of 8: dot products one by one)."""
    dim = heads * head_dim
    model = sharp_model(ModelConfig(
        vocab_size=48, dim=dim, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, hidden_dim=96, max_seq_len=320,
        exits=ExitConfig(every_layer=True, norm="final")), 3)
    nb = build_native_block(native.library(), model.layers[0], Scratch())
    assert nb is not None
    gen = torch.Generator().manual_seed(head_dim)
    for before in (37, 300):
        prefix = torch.randn(1, before, dim, generator=gen)
        cache = model.new_cache(1, 320)
        _call(nb, model, prefix, 0, cache)

        def fresh(cache=cache):  # a copy of the cache after the prefix
            c = model.new_cache(1, 320)
            c.keys[0].copy_(cache.keys[0])
            c.values[0].copy_(cache.values[0])
            return c

        for m in (1, 2, 3, 5, 8, 9):
            h = torch.randn(1, m, dim, generator=gen)
            alone = fresh()
            one_by_one = torch.cat([_call(nb, model, h[:, i:i + 1], before + i, alone)
                                    for i in range(m)], 1)
            for threads in (1, 2, 3):
                rows = _call(nb, model, h, before, fresh(), threads=threads)
                assert torch.equal(rows, one_by_one), (head_dim, before, m, threads)
                if m == 1:
                    continue
                steps = fresh()
                singles = torch.cat([_call(nb, model, h[:, i:i + 1], before + i, steps,
                                           threads=threads) for i in range(m)], 1)
                assert torch.equal(singles, one_by_one), (head_dim, before, m, threads)
