"""The greedy screen (exitlm.kernels.screen) gives the full head's argmax exactly: on random
activations, on rows built to differ in the last bits or to tie, for float32 and float16
heads; it gives up on non-finite activations; the native runner's greedy steps through it give
plain decoding's tokens, and it follows a weight changed in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _byte_models import sharp_byte_model
from _native import needs_native
from exitlm.infer import generate
from exitlm.kernels import native, screen
from exitlm.kernels.screen import GreedyScreen
from exitlm.runtime import native as native_runner
from exitlm.runtime import prepare

pytestmark = needs_native

N, K = 3000, 128


def _full(x: torch.Tensor, w: torch.Tensor) -> list[int]:
    """The argmax the head's native product gives (float16 heads round logits to float16)."""
    if w.dtype is torch.float16:
        return np.argmax(native.gemm_f16(x, w).half().numpy(), axis=1).tolist()
    return np.argmax(native.gemm_f32(x, w).numpy(), axis=1).tolist()


def _head(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)
    # rows that differ from row 7 in the last bits, and exact copies (ties: lowest index wins)
    w[100] = w[7] * (1 + 2.0 ** -22)
    w[2500] = w[7]
    w[40] = w[2900] = w[1234]
    return w.to(dtype).contiguous()


def test_the_rows_of_a_product_are_the_same_bits_alone() -> None:
    w = _head(0)
    x = torch.randn(3, K)
    full = native.gemm_f32(x, w, 2)
    for rows in ([5], [0, 1, 2], list(range(17, 60, 3)), list(range(N - 70, N))):
        part = native.gemm_f32(x, w[rows].contiguous(), 1)
        assert torch.equal(part, full[:, rows])
        alone = native.gemm_f32(x[1:2].contiguous(), w[rows].contiguous(), 1)  # one x row
        assert torch.equal(alone, full[1:2, rows])
    half = w.half()
    full16 = native.gemm_f16(x, half, 2)
    assert torch.equal(native.gemm_f16(x, half[[3, 9, 2999]].contiguous(), 1),
                       full16[:, [3, 9, 2999]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_screen_gives_the_full_heads_argmax(dtype: torch.dtype) -> None:
    w = _head(1, dtype)
    sc = GreedyScreen(w)
    gen = torch.Generator().manual_seed(2)
    decided = 0
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(16, K, generator=gen) * scale
        # rows aimed at the near-ties: x along row 7 (vs 100, 2500) and row 1234 (vs 40, 2900)
        x[0] = w[7].float() * scale
        x[1] = w[1234].float() * scale
        got = sc.argmax(x, w, 2)
        assert got is not None
        assert got == _full(x, w)
        decided += len(got)
    assert decided == 48
    assert _full(w[1234:1235].float(), w)[0] == 40  # (the tie really is one)


def test_the_screen_gives_up_where_it_cannot_bound() -> None:
    w = _head(3)
    sc = GreedyScreen(w)
    x = torch.randn(2, K)
    x[1, 5] = float("nan")
    assert sc.argmax(x, w) is None
    flat = torch.zeros(1, K)  # every logit 0: every row a candidate
    zeros = torch.zeros(N, K)
    assert N > screen.MAX_CANDIDATES and GreedyScreen(zeros).argmax(flat, zeros) is None


@pytest.fixture
def screened(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Screens for heads of any size; every screened argmax call recorded (whether it found
    the argmax), in order."""
    monkeypatch.setattr(native_runner, "MIN_SCREEN_ROWS", 1)
    calls: list[bool] = []
    real = GreedyScreen.argmax

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        out = real(self, *a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(GreedyScreen, "argmax", counting)
    return calls


def test_greedy_decoding_through_the_screen_is_plain_decoding(screened: list[bool]) -> None:
    calls = screened
    model = sharp_byte_model(num_layers=3, max_seq_len=96)
    prompts = [[3, 7, 11, 5], [9, 1], [200, 100, 50, 25, 12]]
    kw = {"max_new_tokens": screen.BUILD_TOKENS + 8, "ignore_eos": True}
    runner = prepare(model)
    generate(runner, None, prompts, max_new_tokens=4)  # too short to make a screen for
    assert not calls
    old = screen.set_screens(False)
    try:
        plain = generate(runner, None, prompts, **kw).token_ids
    finally:
        screen.set_screens(old)
    assert not calls
    assert generate(runner, None, prompts, **kw).token_ids == plain
    assert calls and all(calls)
    # a weight changed in place gets a new screen (and new tokens, still the full head's)
    with torch.no_grad():
        model.embed_tokens.weight[5:60].mul_(-1.5)
    screen.set_screens(False)
    try:
        changed = generate(runner, None, prompts, **kw).token_ids
    finally:
        screen.set_screens(True)
    assert generate(runner, None, prompts, **kw).token_ids == changed


def test_self_speculation_plain_steps_go_through_the_screen(screened: list[bool]) -> None:
    """Adaptive self-speculation's first token and plain steps take the screened argmax, as
    plain decoding's do (its rounds verify with the logits): one screened call per step."""
    calls = screened
    model = sharp_byte_model(num_layers=3, max_seq_len=96)
    runner = prepare(model)
    prompt = [3, 7, 11, 5]
    kw = {"max_new_tokens": screen.BUILD_TOKENS + 8, "ignore_eos": True}
    plain = generate(runner, None, prompt, **kw).token_ids
    calls.clear()
    res = generate(runner, None, prompt, strategy="self-spec", **kw)
    assert res.token_ids == plain
    stats = res.sequences[0].stats
    assert stats.plain_steps > 0 and all(calls)
    assert len(calls) == 1 + stats.plain_steps  # the first token, then every plain step
