"""The CPU fast paths compute what the plain modules compute: numpy's OpenBLAS GEMV and
small-row products in ``linear``, the lean per-layer decode step of ``LeanBlock``, oneDNN
packed weights, and the thread hand-off of ``thread_split``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.backend import blas, decode_block, native
from exitlm.backend.blas import BLAS, SMALL_ROWS, thread_split
from exitlm.backend.cpu import prepare_for_decoding
from exitlm.backend.decode_block import LeanBlock
from exitlm.backend.layout import pack
from exitlm.backend.linear import FastLinear, linear

needs_numpy_blas = pytest.mark.skipif(not BLAS.enabled,
                                      reason="numpy's OpenBLAS not found: fast path unused")


def _model(**exit_kw: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exit_kw))  # type: ignore[arg-type]
    return EarlyExitLM(cfg).eval()


@needs_numpy_blas
def test_numpy_gemv_matches_f_linear() -> None:
    w = torch.randn(96, 40)
    x = torch.randn(1, 1, 40)
    b = torch.randn(96)
    with torch.no_grad():
        got = linear(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert got.shape == (1, 1, 96)
        wc = w.t().contiguous().t()  # column-major weights (exitlm.backend.layout)
        torch.testing.assert_close(linear(x, wc), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # with gradients the autograd path runs
    xg = x.clone().requires_grad_()
    linear(xg, w).sum().backward()
    assert xg.grad is not None


@needs_numpy_blas
@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9])
@pytest.mark.parametrize("col_major", [False, True])
def test_small_row_products_match_f_linear(rows: int, col_major: bool) -> None:
    """2-8 rows go through OpenBLAS' small-matrix GEMM in blocks of weight rows (several
    blocks here, the last one partial); 9 rows through ``F.linear``. Same values either way."""
    w = torch.randn(300, 1536)  # 1536 inputs: blocks shrink below 128 rows for 5+ rows
    if col_major:
        w = w.t().contiguous().t()
    x = torch.randn(1, rows, 1536)
    b = torch.randn(300)
    calls = []
    real = blas.OpenBlas.rows

    def spy(self: object, *args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape)
        return real(self, *args)  # type: ignore[arg-type]

    blas.OpenBlas.rows = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            got = linear(x, w, b)
    finally:
        blas.OpenBlas.rows = real  # type: ignore[method-assign]
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert got.shape == (1, rows, 300)
    assert len(calls) == (1 if rows <= SMALL_ROWS[1] else 0)


@needs_numpy_blas
def test_lean_decode_step_equals_the_general_block() -> None:
    """Run a 3-token prefill, three one-token steps, a 4-token and a 12-token chunk
    (verifications; products through OpenBLAS blocks, then F.linear) three times: with the
    lean step, with it disabled by a forward hook on a sub-module (the lean step never runs
    when hooks would), and on the plain unprepared model. The first two bit-identical; the
    plain model's products run on another BLAS (rounding differs)."""
    model = _model(layers=())
    cfg = model.config
    tokens = torch.randint(0, cfg.vocab_size, (1, 22))

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(1, 32)
        outs = []
        with torch.no_grad():
            for a, b in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 10), (10, 22)):
                h = model.embed(tokens[:, a:b])
                outs.append(model.run_layers(h, 0, cfg.num_layers,
                                             positions=torch.arange(a, b)[None], cache=cache))
        return outs

    plain = run()
    prepare_for_decoding(model)
    assert all(type(blk) is LeanBlock for blk in model.layers)
    for blk in model.layers:  # the torch step (the native block is tested on its own)
        blk.native = None
    calls = []
    original = decode_block.LeanBlock.decode_step

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, *args, **kwargs)

    decode_block.LeanBlock.decode_step = counting  # type: ignore[method-assign]
    try:
        fast = run()
        assert len(calls) == 6 * cfg.num_layers  # the lean step really ran
        handles = [blk.mlp.register_forward_hook(lambda *a: None) for blk in model.layers]
        try:
            slow = run()
        finally:
            for hnd in handles:
                hnd.remove()
        assert len(calls) == 6 * cfg.num_layers  # and not with hooks
    finally:
        decode_block.LeanBlock.decode_step = original  # type: ignore[method-assign]
    for a, b, c in zip(fast, slow, plain, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_thread_split_restores_torch_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with thread_split(1, 2):
            assert torch.get_num_threads() == 1  # torch's threads lent to OpenBLAS meanwhile
            assert BLAS.threads_override == 2
        assert torch.get_num_threads() == 2
        assert BLAS.threads_override is None
        with thread_split(2, 1):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prepared_layout_keeps_values(dtype: torch.dtype) -> None:
    model = _model(layers=(1,), output="own").to(dtype)
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        before = model(tokens)
        prepare_for_decoding(model)
        after = model(tokens)
    wide, narrow = model.layers[0].attn.wqkv.weight, model.layers[0].attn.wo.weight
    # column-major only for fp32 weights with out > in that OpenBLAS multiplies; the native
    # block reads its weights by rows
    assert wide.is_contiguous() == (dtype != torch.float32 or native.available())
    assert narrow.is_contiguous()
    # an output embedding: read by rows by exitlm's kernels, else OpenBLAS' layout
    head = model.exits["1"].proj.weight
    assert head.is_contiguous() == (dtype != torch.float32 or native.available())
    # fp16 prefill products run as fp32 GEMM once prepared (rounded differently)
    tol = {"atol": 2e-3, "rtol": 1e-2} if dtype == torch.float16 else {}
    torch.testing.assert_close(after.logits, before.logits, **tol)
    torch.testing.assert_close(after.exit_logits[1], before.exit_logits[1], **tol)


def test_packed_bf16_weights_follow_in_place_updates() -> None:
    """A weight changed after packing (an optimizer step) must not use the stale copy."""
    model = prepare_for_decoding(_model().to(torch.bfloat16))
    x = torch.randn(1, 1, model.config.dim, dtype=torch.bfloat16)
    lin = model.layers[0].mlp.w_in
    with torch.no_grad():
        before = lin(x)
        torch.testing.assert_close(before, F.linear(x, lin.weight))
        lin.weight.mul_(2)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize("rows", [1, 2, 5, 32, 40])
def test_packed_fp32_rows_equal_unpacked(rows: int) -> None:
    """The oneDNN copy of an fp32 weight serves products of 2-32 rows only; every row count
    gives the plain kernel's values."""
    w = torch.randn(200, 64)
    lin = FastLinear.holding(w.clone(), pack_rows=True)
    if lin.pack is None:
        pytest.skip("oneDNN cannot pack fp32 weights here")
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        assert lin.pack.serves(x, lin.weight) == (2 <= rows <= 32)
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_pack_keeps_a_valid_copy_and_replaces_a_stale_one() -> None:
    w = torch.randn(16, 8)
    first = pack(w, rows=True)
    if first is None:
        pytest.skip("oneDNN cannot pack fp32 weights here")
    assert pack(w, first, rows=True) is first
    w.add_(1)
    again = pack(w, first, rows=True)
    assert again is not first and again is not None and again.valid(w)


def test_fp16_prefill_of_a_prepared_model_matches_fp32() -> None:
    """Many-row fp16 products run as fp32 GEMM and are cast back."""
    model = _model()
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        ref = model(tokens).logits
        half = prepare_for_decoding(model.half())(tokens).logits.float()
    torch.testing.assert_close(half, ref, atol=2e-2, rtol=2e-2)
