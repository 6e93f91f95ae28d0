"""Quantized weight formats (exitlm.kernels.quant): round-trip error bounds, the GGUF nibble
order, row slices as views, embedding rows, and qlinear / dense_linear on both sides of the row
threshold (exact per-row kernels below it) and without the native library."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _native import needs_native
from exitlm.kernels import native, quant
from exitlm.kernels.quant import QuantizedWeight, qlinear, quantize


def test_int8_round_trip_bound() -> None:
    w = torch.randn(48, 160) * 0.1
    qw = quantize(w, "int8")
    assert qw.q.dtype == torch.int8 and qw.q.shape == (48, 160)
    assert qw.scales.shape == (48, 5) and qw.mins is None
    assert qw.shape == torch.Size([48, 160]) and qw.dtype == torch.float32
    err = (qw.dequantize() - w).abs().view(48, 5, 32)
    assert (err <= qw.scales.unsqueeze(-1) * 0.5 * (1 + 1e-5) + 1e-12).all()
    assert torch.allclose(qw.scales, w.view(48, 5, 32).abs().amax(-1) / 127)
    assert qw.nbytes() == 48 * 160 + 48 * 5 * 4


def test_int4_round_trip_bound_and_nibble_order() -> None:
    w = torch.randn(24, 96)
    qw = quantize(w, "int4")
    assert qw.q.dtype == torch.uint8 and qw.q.shape == (24, 48) and qw.mins is not None
    err = (qw.dequantize() - w).abs().view(24, 3, 32)
    assert (err <= qw.scales.unsqueeze(-1) * 0.5 * (1 + 1e-4) + 1e-6).all()
    assert qw.nbytes() == 24 * 48 + 2 * 24 * 3 * 4
    # element j of a group -> low nibble of byte j; element j + 16 -> high nibble of byte j
    ramp = torch.arange(32, dtype=torch.float32).repeat(1, 2) / 2  # values 0..15.5, d = 31/30
    qr = quantize(ramp.view(1, 64), "int4")
    levels = torch.round((ramp.view(64) - 0) / qr.scales[0, 0]).clamp(0, 15).to(torch.uint8)
    expect = levels.view(2, 32)[:, :16] | (levels.view(2, 32)[:, 16:] << 4)
    assert torch.equal(qr.q.view(2, 16), expect)


def test_int4_scales_and_mins_are_float16_values_where_they_fit() -> None:
    """As GGUF's Q4_1 (the native kernels then read them as float16): mins rounded down,
    scales up, so every group's range stays covered; a constant group's value that is no
    float16, or values beyond float16's range, keep the float32 scales and mins."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 128, generator=gen) * 0.03
    qw = quantize(w, "int4")
    assert qw.scales.dtype == torch.float32 and qw.mins is not None
    for t in (qw.scales, qw.mins):
        assert torch.equal(t.half().float(), t)
    g = w.view(40, 4, 32)
    assert (qw.mins <= g.amin(-1)).all() and (qw.scales >= (g.amax(-1) - g.amin(-1)) / 15).all()
    err = (qw.dequantize() - w).abs().view(40, 4, 32)
    assert (err <= qw.scales.unsqueeze(-1) * 0.5 * (1 + 1e-3) + 1e-7).all()
    packed = native.pack_q4(qw.q, qw.scales, qw.kernel_mins()) if native.packs_q4() else None
    assert packed is None or packed[1].dtype == torch.float16
    constant = torch.full((1, 32), 0.1)  # 0.1 is no float16
    kept = quantize(torch.cat([w[:1, :32], constant]), "int4")
    assert torch.equal(kept.dequantize()[1], constant[0]) and kept.mins[1, 0] == 0.1
    for big in (w * 1e7, w.clone().index_fill_(1, torch.tensor([3]), -7e4)):
        wide = quantize(big, "int4")
        assert not torch.equal(wide.scales.half().float(), wide.scales)  # float32 as computed
        torch.testing.assert_close(wide.scales, (big.view(40, 4, 32).amax(-1)
                                                 - big.view(40, 4, 32).amin(-1)) / 15)


def test_degenerate_groups_have_no_nan() -> None:
    w = torch.zeros(3, 64)
    w[1, 32:] = 0.25  # a constant group
    w[2, :32] = torch.linspace(-1, 1, 32)
    for kind in quant.QUANT_KINDS:
        qw = quantize(w, kind)
        d = qw.dequantize()
        assert torch.isfinite(d).all() and torch.isfinite(qw.scales).all()
        assert torch.equal(d[0], w[0])
        if kind == "int4":
            assert torch.equal(d[1], w[1])


def test_slices_are_views_and_embedding_rows() -> None:
    w = torch.randn(20, 64)
    for kind in quant.QUANT_KINDS:
        qw = quantize(w, kind)
        part = qw[5:9]
        assert part.shape == torch.Size([4, 64])
        assert part.q.data_ptr() == qw.q[5].data_ptr()
        assert torch.equal(part.dequantize(), qw.dequantize()[5:9])
        ids = torch.tensor([[3, 0], [19, 3]])
        rows = quant.embedding_rows(qw, ids)
        assert rows.shape == (2, 2, 64)
        assert torch.equal(rows, qw.dequantize()[ids])
        with pytest.raises(ValueError, match="step-1 slice"):
            qw[::2]
    assert quantize(w, "int8").dequantize(torch.float16).dtype == torch.float16


def test_quantize_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48), "int8")
    with pytest.raises(ValueError, match="kind"):
        quantize(torch.randn(4, 64), "int2")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(64), "int4")
    with pytest.raises(ValueError, match="mins"):
        QuantizedWeight("int4", torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1), None)


@needs_native
def test_qlinear_exact_below_threshold_and_close_above() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * 0.1
    t = quant.ROW_THRESHOLD
    x = torch.randn(t + 5, 128, generator=gen)
    for kind in quant.QUANT_KINDS:
        qw = quantize(w, kind)
        small = qlinear(x[: t - 1], qw)
        for i in (0, t // 2, t - 2):
            assert torch.equal(qlinear(x[i:i + 1], qw)[0], small[i])
            assert torch.equal(qlinear(x[i], qw, threads=2), small[i])
        big = qlinear(x, qw)  # dequantize + BLAS: close, not bit-identical
        assert torch.allclose(big, F.linear(x, qw.dequantize()), atol=1e-5)
        assert torch.allclose(big[: t - 1], small, atol=1e-5)
    for dt in (torch.float32, torch.float16):
        wd = w.to(dt)
        small = quant.dense_linear(x[:3], wd)
        assert torch.equal(quant.dense_linear(x[1:2], wd)[0], small[1])
        assert torch.allclose(quant.dense_linear(x, wd), F.linear(x, wd.float()), atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        qlinear(x.double(), quantize(w, "int8"))
    with pytest.raises(ValueError, match="float32 or float16"):
        quant.dense_linear(x, w.double())


@needs_native
def test_qlinear_with_int8_activations_is_the_integer_product() -> None:
    """``int8_activations=True``: the gemm_* product of the same name with int8 activations
    (q8a8, q4a8 for Q4_1 and Q4_0, packed or not), row-invariant, not the float32-x one."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(80, 128, generator=gen) * 0.1
    x = torch.randn(7, 128, generator=gen)
    q4_0 = quantize(w, "int4")
    q4_0 = QuantizedWeight("int4", q4_0.q, q4_0.scales, -8 * q4_0.scales)  # GGUF Q4_0 mins
    for qw in (quantize(w, "int8"), quantize(w, "int4"), q4_0):
        got = qlinear(x, qw, int8_activations=True)
        if qw.kind == "int8":
            want = native.gemm_q8(x, qw.q, qw.scales, int8_activations=True)
        else:
            want = native.gemm_q4(x, qw.q, qw.scales, qw.kernel_mins(), int8_activations=True)
        assert torch.equal(got, want)
        assert torch.equal(qlinear(x[3:4], qw, 2, int8_activations=True)[0], got[3])
        assert torch.equal(qw.linear(x, int8_activations=True), got)
        assert not torch.equal(got, qlinear(x, qw))  # the float32-x product differs
        assert torch.allclose(got, qlinear(x, qw), atol=0.05)


def test_qlinear_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    w = torch.randn(10, 64)
    x = torch.randn(2, 3, 64)
    for kind in quant.QUANT_KINDS:
        qw = quantize(w, kind)
        assert torch.allclose(qlinear(x, qw), F.linear(x, qw.dequantize()))
    assert torch.allclose(quant.dense_linear(x, w.half()), F.linear(x, w.half().float()))


def test_quantized_weight_pickles_without_its_bound_kernel() -> None:
    import copy
    import pickle

    qw = quantize(torch.randn(8, 64), "int4")
    x = torch.randn(2, 64)
    y = qlinear(x, qw)  # binds the native kernel when there is one
    again = pickle.loads(pickle.dumps(qw))
    assert again._bound is None
    assert torch.equal(again.q, qw.q) and torch.equal(again.scales, qw.scales)
    assert torch.equal(qlinear(x, again), y)
    assert torch.equal(qlinear(x, copy.deepcopy(qw)), y)
