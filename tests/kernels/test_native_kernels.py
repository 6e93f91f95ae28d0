"""Native batch-small kernels (exitlm.kernels.native): values against a float64 reference,
bit-exact row invariance (rows and threads), argument checking. (Finding, checking and
choosing the library, its builds' equal bits and the fallbacks: test_native_loader.py.)

Tolerance: every kernel output is within ``2e-5 * sum_k |x_k W_nk|`` of the float64 product of
the same (dequantized) weight - fp32 accumulation over at most K/8 + 4 terms per lane.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from _native import needs_native
from exitlm.kernels import native

TOL = 2e-5

pytestmark = needs_native


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """(kernel args after x, the float64 (N, K) weight they stand for)."""
    if kind == "f32":
        w = torch.randn(n, k, generator=gen)
        return (w,), w.double()
    if kind == "f16":
        w = torch.randn(n, k, generator=gen).half()
        return (w,), w.double()
    g = k // 32
    scales = torch.rand(n, g, generator=gen) * 0.1
    if kind == "q8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w = q.double().view(n, g, 32) * scales.double().unsqueeze(-1)
        return (q, scales), w.view(n, k)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    mins = torch.randn(n, g, generator=gen) * 0.1
    b = q.view(n, g, 16)
    nib = torch.cat((b & 15, b >> 4), dim=-1).double()
    w = nib * scales.double().unsqueeze(-1) + mins.double().unsqueeze(-1)
    return (q, scales, mins), w.view(n, k)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "f32": native.gemm_f32, "f16": native.gemm_f16, "q8": native.gemm_q8, "q4": native.gemm_q4,
}


def _with_int8_activations(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def product(x: torch.Tensor, *args: torch.Tensor, threads: int = 1) -> torch.Tensor:
        return fn(x, *args, threads=threads, int8_activations=True)
    return product


A8: dict[str, Callable[..., torch.Tensor]] = {
    "q8a8": _with_int8_activations(native.gemm_q8),
    "q4a8": _with_int8_activations(native.gemm_q4),
}
"""The q8/q4 products with int8 activations (``kernels.c`` q8a8 / q4a8); weights as q8 / q4."""


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as kernels.c's quantize_x does (float32 arithmetic, ties to even):
    (xq as float64 (M, K), d as float64 (M, K/32))."""
    m, k = x.shape
    g = x.view(m, k // 32, 32)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)),
                      torch.zeros_like(d))
    xq = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127)
    return xq.double().view(m, k), d.double()


@pytest.mark.parametrize("kind", list(KERNELS))
@pytest.mark.parametrize("k", [32, 64, 576, 1536, 2080])  # 2080: q4's scales past a block of 64
@pytest.mark.parametrize("n", [1, 7, 33, 1000])
def test_kernel_values_and_row_invariance(kind: str, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 7919 + n)
    args, w64 = _weights(kind, n, k, gen)
    fn = KERNELS[kind]
    x = torch.randn(7, k, generator=gen)
    y = fn(x, *args)
    assert y.shape == (7, n) and y.dtype == torch.float32
    ref = x.double() @ w64.T
    bound = TOL * (x.double().abs() @ w64.abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    # bit-exact: one row alone, any subset of rows, any thread count
    for i in range(7):
        assert torch.equal(fn(x[i:i + 1], *args)[0], y[i])
    assert torch.equal(fn(x[2:5].contiguous(), *args), y[2:5])
    assert torch.equal(fn(x, *args, threads=2), y)
    assert torch.equal(fn(x[3:4], *args, threads=3)[0], y[3])


@pytest.mark.parametrize("kind", list(A8))
@pytest.mark.parametrize("k", [32, 576, 1536, 2080])  # 2080: 65 groups, past a block of 64
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_int8_activation_kernels(kind: str, k: int, n: int) -> None:
    """Their definition (integer dot products of the rounded rows, scaled by scale * d), the
    bound activation rounding allows against the float32-activation product, and the same
    bit-exact row and thread invariance."""
    gen = torch.Generator().manual_seed(k * 31 + n)
    args, w64 = _weights(kind[:2], n, k, gen)
    fn = A8[kind]
    x = torch.randn(7, k, generator=gen) * torch.rand(7, 1, generator=gen) * 4
    y = fn(x, *args)
    assert y.shape == (7, n) and y.dtype == torch.float32
    xq, d = _int8_rows(x)
    G = k // 32
    if kind == "q8a8":
        ints = (xq.view(7, 1, G, 32) * args[0].double().view(1, n, G, 32)).sum(-1)  # exact
        terms = ints * (args[1].view(1, n, G) * d.float().view(7, 1, G)).double()
        mins_term = torch.zeros(7, n, dtype=torch.float64)
    else:
        b = args[0].view(n, G, 16)
        nib = torch.cat((b & 15, b >> 4), dim=-1).double()
        ints = (xq.view(7, 1, G, 32) * nib.view(1, n, G, 32)).sum(-1)
        terms = ints * (args[1].view(1, n, G) * d.float().view(7, 1, G)).double()
        mins_term = (x.double().view(7, 1, G, 32).sum(-1) * args[2].double().view(1, n, G))
        mins_term = mins_term.sum(-1)
    ref = terms.sum(-1) + mins_term
    mag = (terms.abs().sum(-1) + (x.double().abs() @ w64.abs().T))
    assert ((y.double() - ref).abs() <= TOL * mag + 1e-30).all()
    # against float32 activations: each activation moved by at most half a step d
    exact = x.double() @ w64.T
    step = (d.view(7, 1, G) * w64.abs().view(1, n, G, 32).sum(-1)).sum(-1) * 0.5
    assert ((y.double() - exact).abs() <= step * (1 + 1e-4) + TOL * mag).all()
    assert not torch.equal(y, KERNELS[kind[:2]](x, *args))  # it does round
    for i in range(7):
        assert torch.equal(fn(x[i:i + 1], *args)[0], y[i])
    assert torch.equal(fn(x[2:5].contiguous(), *args), y[2:5])
    assert torch.equal(fn(x, *args, threads=2), y)


def test_int8_activation_edges() -> None:
    """Weights of -128 and activations at +-absmax stay exact (no saturation of the pairwise
    int16 sums); an all-zero group contributes 0; a NaN poisons its own row only."""
    n, k = 3, 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1] = 127
    scales = torch.ones(n, k // 32)
    x = torch.full((2, k), -1.0)
    x[1, :32] = 0.0
    y = native.gemm_q8(x, q, scales, int8_activations=True)
    want = x.double() @ q.double().T  # the rows round exactly: d = 1/127, xq = -127 or 0
    assert torch.allclose(y.double(), want, rtol=1e-6, atol=0)
    x[0, 5] = float("nan")
    y = native.gemm_q8(x, q, scales, int8_activations=True)
    assert y[0].isnan().all() and y[1].isfinite().all()
    nib = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    y4 = native.gemm_q4(x[1:], nib, scales, torch.zeros(n, k // 32), int8_activations=True)
    assert torch.allclose(y4.double(), 15.0 * x[1:].double().sum(-1, keepdim=True).expand(1, n),
                          rtol=1e-6)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("k", [1, 5, 37, 581])
def test_dense_tail_is_order_fixed(kind: str, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    args, w64 = _weights(kind, 65, k, gen)
    fn = KERNELS[kind]
    x = torch.randn(16, k, generator=gen)
    y = fn(x, *args)
    ref = x.double() @ w64.T
    assert ((y.double() - ref).abs() <= TOL * (x.double().abs() @ w64.abs().T) + 1e-30).all()
    for i in (0, 9, 15):
        assert torch.equal(fn(x[i:i + 1], *args)[0], y[i])
    assert torch.equal(fn(x, *args, threads=2), y)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("k", [37, 576, 1536])
def test_dense_rows_off_a_cache_line(kind: str, k: int) -> None:
    """x rows that do not start on a 64-byte line (a view 4-60 bytes into a buffer; K = 37:
    rows that cannot all start on one) are copied to rows that do before the multi-row tiles
    run (kernels.c run_dense): the same bits as the line-aligned rows, row by row, for the
    row counts whose tiles differ (2-4, 5-8, and 8 rows of K = 1536, 48 KB, on four weight
    rows per tile in the 512-bit build)."""
    gen = torch.Generator().manual_seed(k + 11)
    args, _ = _weights(kind, 40, k, gen)
    fn = KERNELS[kind]
    for m in (2, 5, 6, 8):
        x = torch.randn(m, k, generator=gen)
        want = fn(x, *args)
        for off in (1, 4, 15):
            buf = torch.zeros(m * k + 16)
            view = buf[off:off + m * k].view(m, k)
            view.copy_(x)
            assert view.data_ptr() % 64 != 0
            assert torch.equal(fn(view, *args), want)
            assert torch.equal(fn(view, *args, threads=2), want)
        for i in (0, m - 1):
            assert torch.equal(fn(x[i:i + 1], *args)[0], want[i])


def test_many_rows_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    for kind, fn in (KERNELS | A8).items():
        args, _ = _weights(kind[:2] if kind in A8 else kind, 70, 96, gen)
        x = torch.randn(2, 9, 96, generator=gen)
        y = fn(x, *args)
        assert y.shape == (2, 9, 70)
        assert torch.equal(y.view(18, 70), fn(x.view(18, 96), *args))
        assert torch.equal(y[1, 4], fn(x[1, 4:5], *args)[0])
        assert fn(torch.randn(96), *args).shape == (70,)


def test_q4_zero_style_mins() -> None:
    """Q4_0 weights: W = (nibble - 8) * scale, i.e. mins = -8 * scale."""
    gen = torch.Generator().manual_seed(4)
    n, k = 40, 128
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=gen)
    b = q.view(n, k // 32, 16)
    nib = torch.cat((b & 15, b >> 4), dim=-1).double() - 8.0
    w64 = (nib * scales.double().unsqueeze(-1)).view(n, k)
    x = torch.randn(3, k, generator=gen)
    y = native.gemm_q4(x, q, scales, -8.0 * scales)
    assert ((y.double() - x.double() @ w64.T).abs()
            <= TOL * (x.double().abs() @ w64.abs().T)).all()


@pytest.mark.parametrize("int8_activations", [False, True])
def test_q4_0_without_a_mins_array_has_the_same_bits(int8_activations: bool) -> None:
    """``mins=None`` (Q4_0: the kernels compute -8 * scale instead of reading mins) gives the
    bits of the explicit ``mins = -8 * scales`` in every tile, row count, thread count, K (past
    a block of 64 groups) and N (tails of the 16-row lanes), bound or checked, and in the
    dequantization."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((37, 64), (70, 576), (17, 2080)):
        q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // 32, generator=gen) * 0.1
        scales[0, 0] = 0.0  # an all-zero group
        mins = -8.0 * scales
        bound = native.bind("q4", q, scales, None)
        for m in (1, 2, 3, 5, 8, 17):
            x = torch.randn(m, k, generator=gen)
            for threads in (1, 2):
                want = native.gemm_q4(x, q, scales, mins, threads,
                                      int8_activations=int8_activations)
                got = native.gemm_q4(x, q, scales, None, threads,
                                     int8_activations=int8_activations)
                assert torch.equal(got, want), (n, k, m, threads)
            if not int8_activations:
                assert torch.equal(bound(x), native.gemm_q4(x, q, scales, mins))
        assert torch.equal(native.unpack_q4(q, scales, None), native.unpack_q4(q, scales, mins))


def test_kernel_mins_finds_q4_0_weights() -> None:
    """QuantizedWeight.kernel_mins: None where the mins are exactly -8 * scales (what GGUF Q4_0
    loads as), the mins otherwise (one value off is enough), None for int8."""
    from exitlm.kernels.quant import QuantizedWeight, quantize

    gen = torch.Generator().manual_seed(6)
    q = torch.randint(0, 256, (8, 32), generator=gen, dtype=torch.uint8)
    scales = torch.rand(8, 2, generator=gen)
    assert QuantizedWeight("int4", q, scales, scales * -8.0).kernel_mins() is None
    off = scales * -8.0
    off[3, 1] = torch.nextafter(off[3, 1], torch.tensor(0.0))
    w = QuantizedWeight("int4", q, scales, off)
    assert w.kernel_mins() is w.mins
    assert quantize(torch.randn(8, 64, generator=gen), "int8").kernel_mins() is None


def test_argument_errors() -> None:
    x = torch.randn(2, 64)
    w = torch.randn(5, 64)
    q8 = torch.zeros(5, 64, dtype=torch.int8)
    s = torch.ones(5, 2)
    with pytest.raises(ValueError, match=r"x must be torch\.float32"):
        native.gemm_f32(x.double(), w)
    with pytest.raises(ValueError, match=r"w must be torch\.float32"):
        native.gemm_f32(x, w.half())
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 64\)"):
        native.gemm_f32(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="contiguous"):
        native.gemm_f32(torch.randn(64, 2).T, w)
    with pytest.raises(ValueError, match="contiguous"):
        native.gemm_f32(x, torch.randn(64, 5).T)
    with pytest.raises(ValueError, match=r"must be a torch\.Tensor"):
        native.gemm_f16(x, [[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 32"):
        native.gemm_q8(torch.randn(1, 48), torch.zeros(5, 48, dtype=torch.int8), s)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.gemm_q4(torch.randn(1, 48), torch.zeros(5, 24, dtype=torch.uint8), s, s)
    with pytest.raises(ValueError, match="scales"):
        native.gemm_q8(x, q8, torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"q must be torch\.int8"):
        native.gemm_q8(x, q8.to(torch.uint8), s)
    with pytest.raises(ValueError, match="mins"):
        native.gemm_q4(x, torch.zeros(5, 32, dtype=torch.uint8), s, torch.ones(5, 2).double())
    with pytest.raises(ValueError, match="threads"):
        native.gemm_f32(x, w, threads=0)


def test_pool_is_safe_across_python_threads_and_fork() -> None:
    """Concurrent callers (one runs on the pool, others inline) and a forked child (which has no
    workers) all get the single-thread bits."""
    import threading

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(512, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    want = native.gemm_f32(x, w)
    assert torch.equal(native.gemm_f32(x, w, threads=2), want)  # pool started in the parent
    bad: list[int] = []

    def worker() -> None:
        for _ in range(50):
            if not torch.equal(native.gemm_f32(x, w, threads=2), want):
                bad.append(1)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    pid = os.fork()
    if pid == 0:  # child: exit status says whether the pooled call worked
        ok = torch.equal(native.gemm_f32(x, w, threads=2), want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_bound_kernels_match_the_checked_calls() -> None:
    gen = torch.Generator().manual_seed(8)
    for kind, fn in KERNELS.items():
        args, _ = _weights(kind, 45, 96, gen)
        bound = native.bind(kind, *args)
        x = torch.randn(5, 96, generator=gen)
        assert torch.equal(bound(x), fn(x, *args))
        assert torch.equal(bound(x[1:2], threads=2)[0], fn(x, *args)[1])
        assert bound(x.view(5, 1, 96)).shape == (5, 1, 45)
        with pytest.raises(ValueError, match="x must"):
            bound(torch.randn(5, 95))
    with pytest.raises(ValueError, match="kind"):
        native.bind("q2", torch.zeros(1, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.bind("q8", torch.zeros(2, 40, dtype=torch.int8), torch.ones(2, 1))


def test_int8_activation_setting_from_the_environment(tmp_path: Path) -> None:
    """``EXITLM_INT8_ACTIVATIONS``: on by default, 0 turns it off, a typo warns and keeps it
    on; set_int8_activations exports the setting to processes started later."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from exitlm.kernels import native\n"
            "print(native.int8_activations())\n"
            "native.set_int8_activations(False)\n"
            "import os; print(os.environ['EXITLM_INT8_ACTIVATIONS'])\n")
    for value, first in ((None, "True"), ("0", "False"), ("off", "False"), ("maybe", "True")):
        env = {k: v for k, v in os.environ.items() if k != "EXITLM_INT8_ACTIVATIONS"}
        if value is not None:
            env["EXITLM_INT8_ACTIVATIONS"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, cwd=tmp_path)
        assert out.stdout.split() == [first, "0"], (value, out.stdout)
        assert ("EXITLM_INT8_ACTIVATIONS='maybe'" in out.stderr) == (value == "maybe")


_TILES_SCRIPT = """
import torch
from exitlm.kernels import native
lib = native.library()
if not lib.exitlm_has_avx2():  # the scalar build (EXITLM_NATIVE=baseline) has no tiles to set
    print("no-tiles")
    raise SystemExit
gen = torch.Generator().manual_seed(5)
kinds = {"f32": 0, "f16": 1, "q8": 2, "q4": 3, "q8a8": 4, "q4a8": 5}
checked = 0
for name, tk in kinds.items():
    # 1000, 1536, 1541: x rows past L1, so that one-W-row tiles run K in parts (dense_kparts:
    # fp32 from 4 rows of 1536, fp16 from 7; 1541 with a tail past the last 8 columns)
    for k in ((61, 120, 1000, 1536, 1541) if tk < 2 else (96,)):
        # dense: tiles of 4 W rows, then 2, then 1; grouped: 16 (AVX-512) or 8 W rows a tile
        n = 11 if tk < 2 else 37
        if tk == 0:
            args, fn = (torch.randn(n, k, generator=gen),), native.gemm_f32
        elif tk == 1:
            args, fn = (torch.randn(n, k, generator=gen).half(),), native.gemm_f16
        elif name.startswith("q8"):
            q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
            q[0, :32] = -128  # the int8 minimum too
            args, fn = (q, torch.rand(n, k // 32, generator=gen)), native.gemm_q8
        else:
            args = (torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
                    torch.rand(n, k // 32, generator=gen), torch.randn(n, k // 32, generator=gen))
            fn = native.gemm_q4
        kw = {"int8_activations": True} if name.endswith("a8") else {}
        x = torch.randn(9, k, generator=gen) * 3
        rows = torch.cat([fn(x[i:i + 1], *args, **kw) for i in range(9)])
        for nb in (1, 2, 4):
            for mb in range(1, 9):
                if any(lib.exitlm_set_tile(tk, r, nb, mb) != 0 for r in (1, 2)):
                    continue
                for m in (2, 3, 4, 5, 8, 9):
                    y = fn(x[:m], *args, **kw)
                    assert torch.equal(y, rows[:m]), (name, k, nb, mb, m)
                    checked += 1
        # one x row: dense kinds take nb W rows at a time (the 512-bit tiles on AVX-512)
        for nb in (1, 2, 4) if tk < 2 else ():
            if lib.exitlm_set_tile(tk, 0, nb, 1) != 0:
                continue
            for i in range(9):
                assert torch.equal(fn(x[i:i + 1], *args, **kw), rows[i:i + 1]), (name, k, nb)
            checked += 1
        if tk < 2:
            lib.exitlm_set_tile(tk, 0, 1, 1)
print(checked)
"""


def test_every_tile_gives_each_row_its_own_bits() -> None:
    """Every tile the build offers (``exitlm_set_tile``: the 256-bit tiles, and the 512-bit
    multi-row tiles of AVX-512 builds), for every kind, with K tails and the int8 minimum:
    each row of a multi-row product has the bits of that row alone, and every one-row tile of
    the dense kinds the bits of the default one. (A subprocess: the tile
    settings are process-wide.)"""
    out = subprocess.run([sys.executable, "-c", _TILES_SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.split()[-1] == "no-tiles":
        pytest.skip("this build (no AVX2) has no tiles")
    assert int(out.stdout.split()[-1]) >= 6 * 2 * 3 * 6  # at least nb x 3 rows per kind
