"""q4 weights in 16-row blocks (exitlm.kernels.native.pack_q4, ``exitlm_gemm_q4p``): the
layout itself, the same bits as the plain layout's products in every build that reads it (and
on the 256- and 512-bit tiles of AVX-512 builds), float16 scales exactly when they are exact,
and QuantizedWeight's packed copy (made once, shared by its row slices, never pickled, used by
the fused blocks)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from _native import needs_native
from exitlm.kernels import loader, native
from exitlm.kernels.native_block import weight_struct
from exitlm.kernels.quant import QuantizedWeight, qlinear, quantize

pytestmark = needs_native


def _q4(n: int, k: int, gen: torch.Generator, *, half: bool, q4_0: bool
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = k // 32
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, g, generator=gen) * 0.1
    mins = None if q4_0 else torch.randn(n, g, generator=gen) * 0.1
    if half:  # values a float16 holds exactly, as GGUF's
        scales = scales.half().float()
        mins = None if mins is None else mins.half().float()
    return q, scales, mins


def test_the_layout_is_what_the_header_says() -> None:
    """Byte 64c + 4r + i of block b, group g is byte 4c + i of row 16b + r's group g; rows past
    N repeat row N - 1; scales (mins) lane r of (b, g) is row 16b + r's group g."""
    gen = torch.Generator().manual_seed(0)
    n, k = 21, 96
    q, scales, mins = _q4(n, k, gen, half=False, q4_0=False)
    qp, sp, mp = native.pack_q4(q, scales, mins)
    assert qp.shape == (2, 3, 4, 16, 4) and sp.shape == mp.shape == (2, 3, 16)
    assert sp.dtype == mp.dtype == torch.float32
    flat = qp.reshape(2, 3, 256)
    for b in range(2):
        for r in range(16):
            row = min(16 * b + r, n - 1)
            for g in range(3):
                assert sp[b, g, r] == scales[row, g] and mp[b, g, r] == mins[row, g]
                for c in range(4):
                    for i in range(4):
                        assert flat[b, g, 64 * c + 4 * r + i] == q[row, 16 * g + 4 * c + i]


def test_float16_scales_exactly_when_every_value_is_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    q, scales, mins = _q4(32, 64, gen, half=True, q4_0=False)
    assert native.pack_q4(q, scales, mins)[1].dtype == torch.float16
    assert native.pack_q4(q, scales, None)[1].dtype == torch.float16
    off = mins.clone()
    off[3, 1] = 0.1  # not a float16: both stay float32 (one dtype for both)
    _, sp, mp = native.pack_q4(q, scales, off)
    assert sp.dtype == mp.dtype == torch.float32
    big = scales.clone()
    big[0, 0] = 1e6  # overflows float16
    assert native.pack_q4(q, big, None)[1].dtype == torch.float32


def _call(lib, x: torch.Tensor, packed: tuple, n: int, a8: bool, threads: int) -> torch.Tensor:
    qp, sp, mp = packed
    m, k = x.shape
    y = torch.full((m, n), float("nan"))
    fn = lib.exitlm_gemm_q4pa8 if a8 else lib.exitlm_gemm_q4p
    rc = fn(x.data_ptr(), qp.data_ptr(), sp.data_ptr(), None if mp is None else mp.data_ptr(),
            int(sp.dtype is torch.float16), y.data_ptr(), m, n, k, threads)
    assert rc == 0
    return y


def _builds(tmp_path: Path) -> dict[str, object]:
    """The builds this CPU runs that read the packed layout; an avx512 build also as copies
    that run every row count on the 256-bit tiles and none."""
    builds = {isa: lib for isa in ("avx2", "avx512")
              if (lib := loader.load_variant(isa)) is not None}
    if "avx512" in builds:
        for name, rows in (("narrow", 64), ("wide", 0)):
            path = shutil.copy(builds["avx512"]._name, tmp_path / f"{name}.so")
            other = loader._open(Path(path))
            other.exitlm_set_narrow_rows(rows)
            builds[f"avx512 {name}"] = other
    if not builds and native.packs_q4():
        builds["loaded"] = native.library()
    return builds


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("q4_0", [False, True])
def test_packed_products_have_the_plain_products_bits(tmp_path: Path, half: bool,
                                                      q4_0: bool) -> None:
    """Every build that reads the layout, one and two threads, 1-13 rows, fp32 and int8
    activations, N a multiple of 16 or not, K past the plain tiles' block of 64 groups."""
    builds = _builds(tmp_path)
    if not builds:
        pytest.skip("no build here reads the packed layout (no AVX2)")
    gen = torch.Generator().manual_seed(2)
    for n, k in ((16, 32), (37, 160), (70, 2080), (200, 576)):
        q, scales, mins = _q4(n, k, gen, half=half, q4_0=q4_0)
        packed = native.pack_q4(q, scales, mins)
        assert (packed[1].dtype is torch.float16) == half
        for m in (1, 2, 3, 5, 8, 13):
            x = torch.randn(m, k, generator=gen)
            for a8 in (False, True):
                ref = native.gemm_q4(x, q, scales, mins, int8_activations=a8)
                for isa, lib in builds.items():
                    for threads in (1, 2):
                        got = _call(lib, x, packed, n, a8, threads)
                        assert torch.equal(got, ref), (isa, n, k, m, a8, threads)


def test_the_scalar_build_refuses_the_packed_layout() -> None:
    lib = loader.load_variant("baseline")
    assert lib is not None
    q, scales, mins = _q4(16, 32, torch.Generator().manual_seed(3), half=False, q4_0=False)
    qp, sp, mp = native.pack_q4(q, scales, mins)
    y = torch.empty(1, 16)
    x = torch.randn(1, 32)
    rc = lib.exitlm_gemm_q4p(x.data_ptr(), qp.data_ptr(), sp.data_ptr(), mp.data_ptr(), 0,
                             y.data_ptr(), 1, 16, 32, 1)
    assert rc == -3


def test_bad_packed_arguments_name_what_is_wrong() -> None:
    q, scales, mins = _q4(40, 64, torch.Generator().manual_seed(4), half=False, q4_0=False)
    packed = native.pack_q4(q, scales, mins)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="n=49 rows do not fit the 3 blocks"):
        native.gemm_q4_packed(x, packed, 49)
    with pytest.raises(ValueError, match="n=32 rows do not fit"):
        native.gemm_q4_packed(x, packed, 32)
    with pytest.raises(ValueError, match="q must be pack_q4's uint8"):
        native.gemm_q4_packed(x, (q, scales, mins), 40)
    with pytest.raises(ValueError, match="mins must be pack_q4's"):
        native.gemm_q4_packed(x, (packed[0], packed[1], packed[2].half()), 40)
    with pytest.raises(ValueError, match=r"x must have shape \(..., 64\)"):
        native.gemm_q4_packed(torch.randn(1, 32), packed, 40)


needs_packing = pytest.mark.skipif(not native.packs_q4(),
                                   reason="the loaded build reads the plain layout only")


@needs_packing
def test_a_weight_packs_once_and_its_slices_share_the_copy() -> None:
    w = quantize(torch.randn(70, 64, generator=torch.Generator().manual_seed(5)), "int4")
    packed = w.kernel_packed()
    assert packed is not None and w.kernel_packed() is packed
    part = w[16:50]
    got = part._packed
    assert got and got[0].data_ptr() == packed[0][1:].data_ptr()  # blocks 1..3, a view
    x = torch.randn(3, 64)
    assert torch.equal(qlinear(x, part), qlinear(x, w)[:, 16:50])
    assert not w[8:40]._packed  # not on a block boundary: packs its own when asked
    clone = pickle.loads(pickle.dumps(w))
    assert clone._packed is None and clone._bound is None
    assert torch.equal(qlinear(x, clone), qlinear(x, w))


@needs_packing
def test_fused_blocks_take_the_packed_copy_and_lookups_the_plain_rows() -> None:
    w = quantize(torch.randn(48, 64, generator=torch.Generator().manual_seed(6)), "int4")
    desc, keep = weight_struct(w)
    packed = w.kernel_packed()
    assert desc.fmt == (5 if packed[1].dtype is torch.float16 else 4)
    assert desc.w == packed[0].data_ptr() and desc.scales == packed[1].data_ptr()
    plain, _ = weight_struct(w, lookup=True)
    assert plain.fmt == 3 and plain.w == w.q.data_ptr()
    assert all(any(t is p for p in keep) for t in packed if t is not None)


@needs_packing
def test_a_bound_product_of_a_packed_weight_has_the_plain_bits() -> None:
    gen = torch.Generator().manual_seed(7)
    for half in (False, True):
        q, scales, mins = _q4(45, 96, gen, half=half, q4_0=False)
        bound = native.bind_q4_packed(native.pack_q4(q, scales, mins), 45)
        plain = native.bind("q4", q, scales, mins)
        for m in (1, 4, 9):
            x = torch.randn(m, 96, generator=gen)
            assert torch.equal(bound(x), plain(x)) and torch.equal(bound(x, 2), plain(x))


def test_int8_weights_have_no_packed_copy() -> None:
    w = QuantizedWeight("int8", torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1), None)
    assert w.kernel_packed() is None


@needs_packing
def test_a_weight_made_in_inference_mode_packs_and_repacks_after_a_change() -> None:
    """Inference tensors keep no version counter (a tensor-parallel rank pads its vocabulary
    rows under ``torch.inference_mode``); a weight whose ``q`` is overwritten in place (same
    storage, new contents) is packed again."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 64, generator=gen)
    with torch.inference_mode():
        w = quantize(torch.randn(40, 64, generator=gen), "int4").padded(48)
        assert w.q.is_inference()
        torch.testing.assert_close(qlinear(x, w), x @ w.dequantize().T, rtol=1e-4,
                                   atol=1e-4)
        assert w.kernel_packed()
    v = quantize(torch.randn(16, 64, generator=gen), "int4")
    first = v.kernel_packed()
    v.q.copy_(torch.randint(0, 256, v.q.shape, generator=gen, dtype=torch.uint8))
    again = QuantizedWeight(v.kind, v.q, v.scales, v.mins)
    assert again.kernel_packed() is not first
    torch.testing.assert_close(qlinear(x, again), x @ again.dequantize().T,
                               rtol=1e-4, atol=1e-4)


@needs_packing
def test_the_packed_copy_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXITLM_Q4_PACKED", "0")
    assert not native.packs_q4()
    w = quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(9)), "int4")
    assert w.kernel_packed() is None
    desc, _ = weight_struct(w)
    assert desc.fmt == 3 and desc.w == w.q.data_ptr()  # the fused blocks read the plain rows
    monkeypatch.setenv("EXITLM_Q4_PACKED", "1")
    assert native.packs_q4()
