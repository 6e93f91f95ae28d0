"""The batch-1 fp32 decode fast paths compute what the general code computes: numpy's
OpenBLAS GEMV in ``linear``, the lean per-layer decode step in ``Block``, and the thread
hand-off of ``thread_split``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.model import layers
from exitlm.model.layers import linear, thread_split

needs_numpy_blas = pytest.mark.skipif(not layers._NUMPY_GEMV.enabled,
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
        wc = w.t().contiguous().t()  # column-major weights (exitlm.model.layout)
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
    real = layers._NumpyGemv.rows

    def spy(self: object, *args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape)
        return real(self, *args)

    layers._NumpyGemv.rows = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            got = linear(x, w, b)
    finally:
        layers._NumpyGemv.rows = real  # type: ignore[method-assign]
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert got.shape == (1, rows, 300)
    assert len(calls) == (1 if rows <= layers.SMALL_ROWS[1] else 0)


@needs_numpy_blas
def test_lean_decode_step_equals_the_general_block() -> None:
    """Run a 3-token prefill, three one-token steps, a 4-token and a 12-token chunk
    (verifications; products through OpenBLAS blocks, then F.linear) twice:
    with the lean step, and with it disabled by a forward hook on a sub-module (the lean step
    never runs when hooks would). Bit-identical."""
    cfg = preset("debug", exits=ExitConfig(layers=()))
    model = EarlyExitLM(cfg).eval()
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

    calls = []
    original = layers.Block._decode_step

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, *args, **kwargs)

    layers.Block._decode_step = counting  # type: ignore[method-assign]
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
        layers.Block._decode_step = original  # type: ignore[method-assign]
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_thread_split_restores_torch_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with thread_split(1, 2):
            assert torch.get_num_threads() == 1  # torch's threads lent to OpenBLAS meanwhile
            assert layers._NUMPY_GEMV.threads_override == 2
        assert torch.get_num_threads() == 2
        assert layers._NUMPY_GEMV.threads_override is None
        with thread_split(2, 1):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
