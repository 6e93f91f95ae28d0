"""The greedy screens (exitlm.kernels.screen) give the full head's argmax exactly: on random
activations, on rows built to differ in the last bits or to tie, for float32 and float16
heads and (QuantizedScreen) int8 heads and int4 heads with and without a mins array; they give
up on non-finite activations; the native runner's greedy steps through them give plain
decoding's tokens (float32, float16 and int4 models), and they follow a weight changed in
place; the native per-step arithmetic (rounding, bounds, candidates) is the NumPy reference's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _byte_models import sharp_byte_model
from _native import needs_native
from exitlm.infer import generate
from exitlm.kernels import native, screen
from exitlm.kernels.quant import QuantizedWeight, qlinear, quantize
from exitlm.kernels.quantized import quantize_model
from exitlm.kernels.screen import GreedyScreen, QuantizedScreen
from exitlm.runtime import native as native_runner
from exitlm.runtime import prepare

pytestmark = needs_native

N, K = 3000, 128
GROUP_STRIDE = 32  # the int8 activations' groups


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


def test_the_screen_keeps_rows_the_int8_activations_reorder() -> None:
    """x: 1.0 at element 0 (the group's step 1 / 127), 0.49 steps at the 31 others (rounded to
    0). Row 62 holds 127/128 at those 31, row 63 only 1/64 at element 0 (both exact in int8):
    the int8 activations see 0 against 1/64, the exact logits 0.119 against 0.016 - row 62,
    which only the activations' term of the bound keeps among the candidates."""
    w = torch.zeros(64, 32)
    w[62, 1:] = 127 / 128
    w[63, 0] = 1 / 64
    x = torch.full((1, 32), 0.49 / 127)
    x[0, 0] = 1.0
    assert _full(x, w) == [62]
    sc = GreedyScreen(w)
    approx = native.gemm_q8(x, sc.q, sc.scales, int8_activations=True)[0]
    assert approx[63] > approx[62]  # what the screen has to see through
    assert sc.argmax(x, w) == [62]


def _numpy_round_and_terms(x: torch.Tensor) -> tuple | None:
    xh = screen._round_like_kernels(x)
    return None if xh is None else (xh, *screen._terms(x, xh))


def test_the_native_rounding_and_bounds_are_numpys() -> None:
    """``exitlm_screen_round`` (one call per step) rounds x's rows as the NumPy reference
    does, bit for bit, with its bounds' float64 terms equal up to summation order; it gives up
    on the same rows (NaN, infinities, a group scale below 1e-30), and on K not a multiple
    of 32."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(3, 576, generator=gen) * s for s in (1e-3, 1.0, 40.0)]
    edge = torch.randn(1, 96, generator=gen)
    edge[0, 32:64] = 0.0  # a zero group: scale 0, rounds to zeros
    edge[0, 5] = 127.5 * edge[0, :32].abs().max() / 127  # a value on a tie of the rounding
    rows.append(edge)
    for x in rows:
        got, ref = screen._round_and_terms(x), _numpy_round_and_terms(x)
        assert got is not None and ref is not None
        assert np.array_equal(got[0], ref[0])
        for a, b in zip(got[1:], ref[1:], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
    for bad in (float("nan"), float("inf"), 1e-33):
        x = torch.randn(2, 64, generator=gen)
        x[1, 32:64] = 0.0
        x[1, 33] = bad  # one group's scale NaN, infinite or tiny
        assert screen._round_and_terms(x) is None and _numpy_round_and_terms(x) is None
    lib = native.library()
    x = torch.randn(1, 40).numpy()
    out = np.empty((1, 40), np.float32)
    terms = np.empty((1, 3), np.float64)
    assert lib.exitlm_screen_round(x.ctypes.data, 1, 40, out.ctypes.data, terms.ctypes.data) == -1


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("with_rounding", [False, True])
def test_the_native_candidates_are_numpys(half: bool, with_rounding: bool) -> None:
    """``exitlm_screen_candidates`` (one pass over the head's rows) picks exactly the NumPy
    reference's candidates - the same float32 operations - for slacks of every size, stops at
    ``cap + 1`` of them, and gives up on a non-finite logit (and a float16 floor past 60000)."""
    rng = np.random.default_rng(3)
    n = 5000
    a = rng.standard_normal(n).astype(np.float32) * 4
    a[rng.integers(0, n, 40)] = a.max()  # ties at the top
    norms = rng.random(n).astype(np.float32) + 0.5
    rounding = (rng.random(n).astype(np.float32) * 0.01) if with_rounding else None
    seen = set()
    for e1, l1, extra in ((1e-4, 3.0, 1e-5), (0.05, 30.0, 1e-3), (0.5, 100.0, 0.01),
                          (3.0, 300.0, 0.1), (10.0, 1000.0, 0.1), (0.0, 0.0, 0.0)):
        ref = screen.candidates_numpy(a, norms, rounding, e1, l1, extra, half)
        assert ref is not None
        got = screen.candidates(a, norms, rounding, e1, l1, extra, half, n)
        assert got is not None and np.array_equal(got, ref)
        seen.add(len(ref))
        cap = max(1, len(ref) // 2)
        capped = screen.candidates(a, norms, rounding, e1, l1, extra, half, cap)
        assert capped is not None
        if len(ref) > cap:
            assert np.array_equal(capped, ref[: cap + 1])
    assert min(seen) <= 41 and max(seen) > 100  # slacks from the ties at the top to many
    for bad, at in ((np.nan, 17), (np.inf, 18), (-np.inf, 19), (np.nan, n - 1)):
        b = a.copy()
        b[at] = bad  # in the eight-row passes and in the tail
        assert screen.candidates(b, norms, rounding, 1e-3, 1.0, 0.0, half, n) is None
        assert screen.candidates_numpy(b, norms, rounding, 1e-3, 1.0, 0.0, half) is None
    if half:
        big = a + np.float32(70000.0)
        assert screen.candidates(big, norms, rounding, 1e-3, 1.0, 0.0, True, n) is None
        assert screen.candidates_numpy(big, norms, rounding, 1e-3, 1.0, 0.0, True) is None


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
    """Screens for heads of any size; every screened argmax call (either screen) recorded
    (whether it found the argmax), in order."""
    monkeypatch.setattr(native_runner, "MIN_SCREEN_ROWS", 1)
    calls: list[bool] = []
    for cls in (GreedyScreen, QuantizedScreen):
        real = cls.argmax

        def counting(self, *a, _real=real, **kw):  # type: ignore[no-untyped-def]
            out = _real(self, *a, **kw)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(cls, "argmax", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_decoding_through_the_screen_is_plain_decoding(
        screened: list[bool], dtype: torch.dtype) -> None:
    """float32 and float16 models' greedy steps take the screen (screens_head), with plain
    decoding's tokens; a weight changed in place gets a new screen."""
    calls = screened
    model = sharp_byte_model(num_layers=3, max_seq_len=96).to(dtype)
    assert screen.screens_head(model.output_embedding())
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


def _int4_head(seed: int, q4_0: bool) -> QuantizedWeight:
    """A random int4 head (Q4_0: random nibbles, mins -8 x scales, signed scales; else the
    int4 quantization of a float head) with rows that tie exactly (the lowest index wins) and
    one that differs from row 7 in one nibble."""
    gen = torch.Generator().manual_seed(seed)
    if q4_0:
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
        scales = torch.randn(N, K // 32, generator=gen) * 0.05
        w = QuantizedWeight("int4", q, scales, scales * -8.0)
    else:
        w = quantize(torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen), "int4")
    assert w.mins is not None
    _ties(w)
    assert (w.kernel_mins() is None) == q4_0
    return w


def _ties(w: QuantizedWeight) -> None:
    """Rows 2500 = 7, 40 = 2900 = 1234 (ties: the lowest index wins); 100 = 7 but one bit."""
    for t in (w.q, w.scales, w.mins):
        if t is not None:
            t[2500] = t[7]
            t[40] = t[2900] = t[1234]
            t[100] = t[7]
    w.q[100, 3] ^= 1


def _quantized_head(kind: str, seed: int) -> QuantizedWeight:
    if kind == "int8":
        gen = torch.Generator().manual_seed(seed)
        w = quantize(torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen), "int8")
        _ties(w)
        return w
    return _int4_head(seed, kind == "q4_0")


def _quantized_full(x: torch.Tensor, w: QuantizedWeight) -> list[int]:
    """The argmax of the head's own product (float32 activations; first index on ties)."""
    return np.argmax(qlinear(x, w).numpy(), axis=1).tolist()


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "int8"])
def test_the_quantized_screen_gives_the_full_heads_argmax(kind: str) -> None:
    w = _quantized_head(kind, 4)
    sc = QuantizedScreen(w)
    rows = w.dequantize()
    gen = torch.Generator().manual_seed(5)
    decided = 0
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(16, K, generator=gen) * scale
        x[0] = rows[7] * scale  # against 100 (one nibble off) and 2500 (a tie)
        x[1] = rows[1234] * scale  # ties with 40 and 2900
        x[2, ::GROUP_STRIDE] *= 40.0  # outliers: coarse int8 steps in their groups
        x[3, :GROUP_STRIDE] = 0.0  # a group of zeros
        got = sc.argmax(x, w, 2)
        assert got is not None
        assert got == _quantized_full(x, w)
        decided += len(got)
    assert decided == 48
    assert _quantized_full(rows[1234:1235], w)[0] == 40  # (the tie really is one)



def test_the_int4_screen_keeps_rows_the_int8_rounding_reorders() -> None:
    """Rows 301 and 300 differ in two nibbles (elements 0 and 32, +1 and -1); x puts 0.045 at
    element 0, in a group of step 0.1 (rounded to 0), and 0.044 at element 32, in a group of
    step 0.001 (kept): the exact logits put 301 first, the int8 activations 300 - the screen
    must still answer 301."""
    w = _int4_head(7, True)
    w.scales.mul_(0.02)  # other rows far below (and the float32 slack small next to the gap)
    w.scales[300:302] = 0.05
    w.q[301] = w.q[300]
    w.q[300, 0] = (w.q[300, 0] & 0xF0) | 5  # element 0 (byte 0, low nibble): 5 in 300, 6 in 301
    w.q[301, 0] = (w.q[301, 0] & 0xF0) | 6
    w.q[300, 16] = (w.q[300, 16] & 0xF0) | 5  # element 32 (byte 16, low): 5 in 300, 4 in 301
    w.q[301, 16] = (w.q[301, 16] & 0xF0) | 4
    w.mins.copy_(w.scales * -8.0)
    rows = native.unpack_q4(w.q, w.scales, w.mins)
    x = rows[300:301] * 3.0
    x[0, GROUP_STRIDE:2 * GROUP_STRIDE] = rows[300, GROUP_STRIDE:2 * GROUP_STRIDE] * 0.3
    x[0, 0], x[0, 1] = 0.045, 12.7  # group 0: step 0.1
    x[0, GROUP_STRIDE], x[0, GROUP_STRIDE + 1] = 0.044, 0.127  # group 1: step 0.001
    exact = qlinear(x, w)[0]
    approx = native.gemm_q4(x, w.q, w.scales, None, int8_activations=True)[0]
    assert int(exact.argmax()) == 301 and exact[301] > exact[300]
    assert approx[300] > approx[301]  # what the screen has to see through
    assert QuantizedScreen(w).argmax(x, w) == [301]


def test_the_quantized_screen_gives_up_where_it_cannot_bound() -> None:
    w = _int4_head(6, True)
    sc = QuantizedScreen(w)
    x = torch.randn(2, K)
    x[1, 5] = float("nan")
    assert sc.argmax(x, w) is None
    tiny = torch.randn(1, K)
    tiny[0, :GROUP_STRIDE] *= 1e-36  # a group scale below what float32 rounds relatively
    assert sc.argmax(tiny, w) is None
    zero = QuantizedWeight("int4", torch.zeros(N, K // 2, dtype=torch.uint8),
                           torch.zeros(N, K // 32), torch.zeros(N, K // 32))
    assert QuantizedScreen(zero).argmax(torch.randn(1, K), zero) is None  # every row a candidate


@pytest.mark.parametrize("int8_activations", [False, True], indirect=True)
def test_greedy_decoding_through_the_quantized_screen_is_plain_decoding(
        screened: list[bool], int8_activations: bool) -> None:
    """With float32 activations, an int4 model's greedy steps (its tied head int4) take the
    quantized screen, with plain decoding's tokens, in plain decoding and in
    self-speculation; a changed weight gets a new screen. int8 models' do not (screens_head).
    With int8 activations the head's own product is the screen's integer product: no screen,
    the same tokens as with screens off."""
    calls = screened
    int8 = quantize_model(sharp_byte_model(num_layers=3, max_seq_len=96), "int8")
    kw = {"max_new_tokens": screen.BUILD_TOKENS + 8, "ignore_eos": True}
    generate(prepare(int8), None, [3, 7, 11, 5], **kw)
    assert not calls and not screen.screens_head(int8.output_embedding())
    model = quantize_model(sharp_byte_model(num_layers=3, max_seq_len=96), "int4")
    assert model.output_embedding().kind == "int4"
    runner = prepare(model)
    prompts = [[3, 7, 11, 5], [9, 1], [200, 100, 50, 25, 12]]
    old = screen.set_screens(False)
    try:
        plain = generate(runner, None, prompts, **kw).token_ids
        spec_plain = generate(runner, None, prompts[0], strategy="self-spec", **kw).token_ids
    finally:
        screen.set_screens(old)
    assert not calls
    assert generate(runner, None, prompts, **kw).token_ids == plain
    assert not calls if int8_activations else calls and all(calls)
    calls.clear()
    assert generate(runner, None, prompts[0], strategy="self-spec", **kw).token_ids == \
        spec_plain == [plain[0]]
    assert not calls if int8_activations else calls and all(calls)
    with torch.no_grad():
        model.embed_tokens.q[5:60] ^= 0x11  # +-1 in both nibbles
    screen.set_screens(False)
    try:
        changed = generate(runner, None, prompts, **kw).token_ids
    finally:
        screen.set_screens(True)
    assert changed != plain
    assert generate(runner, None, prompts, **kw).token_ids == changed
