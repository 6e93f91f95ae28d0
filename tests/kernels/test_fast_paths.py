"""The CPU products compute what ``F.linear`` computes: numpy's OpenBLAS GEMV and small-row
products in ``linear``, oneDNN packed weights, and the thread hand-off of ``thread_split``.
(How a runner uses them: tests/runtime/test_products.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exitlm.kernels import blas
from exitlm.kernels.blas import BLAS, SMALL_ROWS, thread_split
from exitlm.kernels.layout import pack
from exitlm.kernels.linear import linear

needs_numpy_blas = pytest.mark.skipif(not BLAS.enabled,
                                      reason="numpy's OpenBLAS not found: fast path unused")


@needs_numpy_blas
def test_numpy_gemv_matches_f_linear() -> None:
    w = torch.randn(96, 40)
    x = torch.randn(1, 1, 40)
    b = torch.randn(96)
    with torch.no_grad():
        got = linear(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert got.shape == (1, 1, 96)
        wc = w.t().contiguous().t()  # column-major weights (exitlm.kernels.layout)
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


@pytest.mark.parametrize("rows", [1, 2, 5, 32, 40])
def test_packed_fp32_rows_equal_unpacked(rows: int) -> None:
    """The oneDNN copy of an fp32 weight serves products of 2-32 rows only; every row count
    gives the plain kernel's values."""
    w = torch.randn(200, 64)
    packed = pack(w, rows=True)
    if packed is None:
        pytest.skip("oneDNN cannot pack fp32 weights here")
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        assert packed.serves(x, w) == (2 <= rows <= 32)
        torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5,
                                   atol=1e-5)


def test_pack_keeps_a_valid_copy_and_replaces_a_stale_one() -> None:
    w = torch.randn(16, 8)
    first = pack(w, rows=True)
    if first is None:
        pytest.skip("oneDNN cannot pack fp32 weights here")
    assert pack(w, first, rows=True) is first
    w.add_(1)
    again = pack(w, first, rows=True)
    assert again is not first and again is not None and again.valid(w)


def test_fp16_products_of_few_rows_are_row_invariant() -> None:
    """fp16 products of fewer than F16_NATIVE_ROWS rows run on the native kernel: each row's
    output has the bits of its one-row product (batches and verification agree with plain
    steps), close to fp32 arithmetic; more rows take torch's fp32 GEMM."""
    from exitlm.kernels import native
    from exitlm.kernels.linear import F16_NATIVE_ROWS

    if not native.available():
        pytest.skip("no native library")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 64, generator=gen).half()
    b = torch.randn(70, generator=gen).half()
    x = torch.randn(F16_NATIVE_ROWS + 5, 64, generator=gen).half()
    with torch.no_grad():
        few = linear(x[: F16_NATIVE_ROWS - 1], w, b)
        assert few.dtype is torch.float16
        for i in (0, 7, F16_NATIVE_ROWS - 2):
            assert torch.equal(few[i], linear(x[i : i + 1], w, b)[0])
        ref = (F.linear(x.float(), w.float()).half() + b).float()
        torch.testing.assert_close(few.float(), ref[: F16_NATIVE_ROWS - 1], rtol=2e-3, atol=2e-3)
        many = linear(x, w, b)
        torch.testing.assert_close(many.float(), ref, rtol=2e-3, atol=2e-3)


def test_fp16_weights_with_fp32_activations() -> None:
    """A float32 model holding a weight in fp16 (a quantized draft copy's layers that cannot
    be quantized): fp32 products of the fp16 weight, each row with the bits of its one-row
    product, the weight's values exactly (as F.linear on the weight in fp32, up to order)."""
    from exitlm.kernels import native

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 48, generator=gen).half()
    b = torch.randn(40, generator=gen)
    x = torch.randn(9, 48, generator=gen)
    with torch.no_grad():
        got = linear(x, w, b)
        assert got.dtype is torch.float32
        torch.testing.assert_close(got, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-5)
        if native.available():  # (torch's fallback is not row-invariant)
            for i in (0, 4, 8):
                assert torch.equal(got[i], linear(x[i : i + 1], w, b)[0])
