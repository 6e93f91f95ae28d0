"""Finding, checking and choosing the native library (exitlm.kernels.loader): the installed
builds give the same bits, ``EXITLM_NATIVE`` picks one, a stale or missing library takes the
developer build or the torch fallback with a reason, and decoding on the fallback stays
lossless (the conformance tests re-run with ``EXITLM_NATIVE=0``)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _byte_models import sharp_model
from exitlm.config import ExitConfig, ModelConfig
from exitlm.errors import ExitlmWarning
from exitlm.kernels import loader, native
from exitlm.kernels.native_block import Scratch, build_native_block

TESTS = Path(__file__).resolve().parents[1]
INSTALLED = loader._installed()
ON_PATH = loader.kernel_path()


@pytest.fixture
def fresh() -> Iterator[None]:
    """Let a test re-run the one-time load under its own environment, then load the
    session's library again."""
    native.forget()
    try:
        yield
    finally:
        native.forget()
        native.available()


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    if kind == "f32":
        return (torch.randn(n, k, generator=gen),)
    if kind == "f16":
        return (torch.randn(n, k, generator=gen).half(),)
    g = k // 32
    scales = torch.rand(n, g, generator=gen) * 0.1
    if kind in ("q8", "q8a8"):
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scales
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    return q, scales, torch.randn(n, g, generator=gen) * 0.1


def _product(lib, kind: str, x: torch.Tensor, args: tuple[torch.Tensor, ...],
             threads: int) -> torch.Tensor:
    m, k = x.shape
    n = args[0].shape[0]
    y = torch.empty(m, n)
    ptrs = [a.data_ptr() for a in args]
    if kind.startswith("q4_0"):  # Q4_0: no mins array (the kernels use -8 * scale)
        kind, ptrs = kind.replace("_0", ""), [*ptrs[:2], None]
    getattr(lib, f"exitlm_gemm_{kind}")(x.data_ptr(), *ptrs, y.data_ptr(), m, n, k, threads)
    return y


def _supported_builds() -> list[str]:
    return [isa for isa in loader.ISAS if loader.load_variant(isa) is not None]


@pytest.mark.skipif(INSTALLED is None, reason="a source tree that was never installed: no "
                    "installed builds to compare (pip install -e . builds them)")
def test_every_installed_build_the_cpu_runs_gives_the_same_bits(tmp_path: Path) -> None:
    """Products of every format and row count, and a whole Llama block over 11 and 40 positions,
    are bit-identical across the baseline, avx2 and avx512 builds (whichever this CPU runs),
    the avx512 build's products on its 512-bit tiles and on its 256-bit ones alike
    (``exitlm_set_narrow_rows``: the setting this CPU got, and copies of the library that run
    every row count on the 256-bit tiles and none)."""
    builds = {isa: loader.load_variant(isa) for isa in _supported_builds()}
    assert "baseline" in builds, "the baseline build always runs"
    if "avx512" in builds:
        own = builds["avx512"].exitlm_set_narrow_rows(-1)
        assert own >= 0
        for name, rows in (("narrow", 64), ("wide", 0)):
            # a copy: dlopen of the same file would share the setting
            path = shutil.copy(builds["avx512"]._name, tmp_path / f"{name}.so")
            other = loader._open(Path(path))
            assert other.exitlm_set_narrow_rows(rows) == own
            builds[f"avx512 {name}"] = other
    gen = torch.Generator().manual_seed(11)
    for (n, k), kind in itertools.product(((37, 160), (70, 2080)), (
            "f32", "f16", "q8", "q4", "q8a8", "q4a8", "q4_0", "q4_0a8")):
        args = _weights(kind, n, k, gen)  # 2080: 65 groups, past the int8 tiles' block of 64
        for m in (1, 2, 3, 5, 8, 13):  # 5, 13: uneven passes of the dense tiles (run_range)
            x = torch.randn(m, k, generator=gen)
            ref = _product(builds["baseline"], kind, x, args, 1)
            for isa, lib in builds.items():
                for threads in (1, 2):
                    assert torch.equal(_product(lib, kind, x, args, threads), ref), (isa, kind)
    # head_dim 16 over 11 positions; head_dim 64 over 40 (the 16-lane softmax and value sums)
    for heads, head_dim, t in ((4, 16, 11), (2, 64, 40)):
        dim = heads * head_dim
        model = sharp_model(ModelConfig(
            vocab_size=48, dim=dim, num_layers=1, num_heads=heads, num_kv_heads=heads // 2,
            head_dim=head_dim, hidden_dim=96, max_seq_len=48,
            exits=ExitConfig(every_layer=True, norm="final")), 3)
        h = torch.randn(1, t, dim, generator=gen)
        rope = model.context(torch.arange(t)[None]).rope
        outs = {}
        for isa, lib in builds.items():
            cache = model.new_cache(1, 48)
            nb = build_native_block(lib, model.layers[0], Scratch())
            outs[isa] = nb(h, rope, cache.keys[0][0], cache.values[0][0], 0, 1)
        for isa, out in outs.items():
            assert torch.equal(out, outs["baseline"]), (isa, head_dim)


def _edge_rows(k: int, gen: torch.Generator) -> torch.Tensor:
    """x rows whose groups of 32 test each case of the int8 rounding (kernels.c quantize_x):
    zeros, values whose x / d lands on .5 (ties to even), subnormals (1 / d overflows),
    FLT_MAX and its neighbours, an infinity, a NaN, one large value among small ones."""
    tiny = torch.finfo(torch.float32).tiny
    big = torch.finfo(torch.float32).max
    groups = [
        torch.zeros(32),
        torch.arange(32, dtype=torch.float32) - 15.5,  # halves: x * (1 / d) near k + 0.5
        torch.linspace(-254, 254, 32),  # d = 2: odd x / d ties to even
        torch.randn(32, generator=gen) * tiny / 64,  # subnormal: 1 / d overflows
        torch.randn(32, generator=gen) * tiny * 4,
        torch.full((32,), big) * torch.sign(torch.randn(32, generator=gen)),
        torch.cat([torch.tensor([float("inf")]), torch.randn(31, generator=gen)]),
        torch.cat([torch.randn(31, generator=gen), torch.tensor([float("nan")])]),
        torch.cat([torch.tensor([-1e30]), torch.randn(31, generator=gen) * 1e-3]),
        torch.randn(32, generator=gen),
    ]
    mixed = [torch.cat([groups[(i + j) % len(groups)] for j in range(k // 32)])
             for i in range(len(groups))]
    alone = [g.repeat(k // 32) for g in groups]  # one case alone decides the row's bits
    return torch.stack(mixed + alone)


@pytest.mark.skipif(INSTALLED is None, reason="a source tree that was never installed: no "
                    "installed builds to compare")
def test_int8_activations_round_alike_in_every_build_on_edge_values() -> None:
    """The AVX2 builds round x rows to int8 with vector code (kernels.c quantize_group_vec)
    and hand the groups it does not take (NaN, infinities, 1 / d overflowing) to the scalar
    code the baseline build runs for all: every build gives the same bits, NaNs included."""
    builds = {isa: loader.load_variant(isa) for isa in _supported_builds()}
    gen = torch.Generator().manual_seed(5)
    for kind in ("q8a8", "q4a8"):
        args = _weights(kind, 40, 320, gen)
        x = _edge_rows(320, gen)
        ref = _product(builds["baseline"], kind, x, args, 1).view(torch.int32)
        for isa, lib in builds.items():
            for m in (1, 3, len(x)):
                got = torch.cat([_product(lib, kind, x[i:i + m], args, 1)
                                 for i in range(0, len(x), m)])
                assert torch.equal(got.view(torch.int32), ref), (isa, kind, m)


@pytest.mark.skipif(INSTALLED is None, reason="a source tree that was never installed: no "
                    "installed builds to compare")
def test_rounding_to_half_is_the_same_in_every_build() -> None:
    """A float16 stream's rounding (kernels.c exitlm_round_to_half: F16C in the AVX2 builds,
    software in the baseline one) gives the same bits in every build, NaN payloads included."""
    builds = {isa: loader.load_variant(isa) for isa in _supported_builds()}
    gen = torch.Generator().manual_seed(9)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_003,), generator=gen, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32),  # every exponent, NaN payloads
                   torch.tensor([65519.99, 65520.0, -65520.0, 2.0**-25, 3 * 2.0**-26, -0.0,
                                 float("inf"), float("nan"), -float("nan")])])
    outs = {}
    for isa, lib in builds.items():
        got = x.clone()
        lib.exitlm_round_to_half(got.data_ptr(), got.numel())
        outs[isa] = got.view(torch.int32)
    for isa, out in outs.items():
        assert torch.equal(out, outs["baseline"]), isa


def test_the_session_names_its_kernel_path() -> None:
    path = native.kernel_path()
    assert path.backend in ("native", "torch")
    line = path.describe()
    if path.backend == "native":
        assert path.isa in (*loader.ISAS, "native") and path.isa in line
        assert Path(path.library).is_file()
        assert native.library_path() == Path(path.library)
    else:
        assert path.reason and path.reason in line and "torch fallback" in line


@pytest.mark.skipif(INSTALLED is None, reason="no installed builds (a source tree)")
def test_exitlm_native_names_a_build(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    monkeypatch.setenv("EXITLM_NATIVE", "baseline")
    assert native.available()
    path = native.kernel_path()
    assert (path.isa, path.source) == ("baseline", "installed")
    assert Path(path.library).name.startswith("libexitlm_baseline")
    native.forget()
    monkeypatch.setenv("EXITLM_NATIVE", "fastest")
    with pytest.warns(ExitlmWarning, match="EXITLM_NATIVE='fastest'"):
        assert native.available()
    assert native.kernel_path().isa == _supported_builds()[0]


@pytest.mark.skipif(INSTALLED is None, reason="no installed builds (a source tree)")
def test_the_avx512_build_narrows_few_row_products_on_zen4_only(
        monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    """The avx512 build runs its products of one and two rows on its 256-bit tiles on an AMD
    family-25 core (Zen 4, as /proc/cpuinfo names it) and every product on its 512-bit ones
    elsewhere, says so in the kernel path, and can be switched (the bits are the same either
    way: test_every_installed_build_the_cpu_runs_gives_the_same_bits)."""
    if "avx512" not in _supported_builds():
        pytest.skip("needs the avx512 build and a CPU that runs it")
    monkeypatch.setenv("EXITLM_NATIVE", "avx512")
    zen4 = (loader.cpuinfo("vendor_id"), loader.cpuinfo("cpu family")) == ("AuthenticAMD", "25")
    own = 2 if zen4 else 0
    assert native.narrow_rows() == own
    path = native.kernel_path()
    assert path.isa == "avx512"
    assert path.reason == (loader.narrow_note(2) if zen4 else "")
    assert ("Zen 4" in path.describe()) is zen4
    assert "products of 1-2 rows" in loader.narrow_note(2)
    assert "one-row products" in loader.narrow_note(1)
    assert native.set_narrow_rows(5) == own
    assert native.narrow_rows() == 5
    assert native.set_narrow_rows(own) == 5
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="narrow rows"):
            native.set_narrow_rows(bad)  # type: ignore[arg-type]
    native.forget()
    monkeypatch.setenv("EXITLM_NATIVE", "avx2")  # no 512-bit tiles: nothing to switch
    assert native.narrow_rows() is None and native.set_narrow_rows(1) is None


def test_disabled_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    monkeypatch.setenv("EXITLM_NATIVE", "0")
    assert not native.available()
    assert "EXITLM_NATIVE=0" in native.unavailable_reason()
    assert native.kernel_path().describe().startswith("torch fallback")
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(9, 64, generator=gen)
    torch.testing.assert_close(native.gemm_f32(x, w), x @ w.T)
    with pytest.raises(ValueError, match="multiple of 32"):  # checks still apply
        native.gemm_q8(torch.randn(1, 48), torch.zeros(5, 48, dtype=torch.int8),
                       torch.ones(5, 1))


def test_no_library_and_no_compiler_warns_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path, fresh: None) -> None:
    monkeypatch.setattr(loader, "_installed", lambda: None)
    monkeypatch.setenv("EXITLM_CC", "no-such-compiler-exitlm")
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path))
    with pytest.warns(ExitlmWarning, match="no C compiler"):
        assert not native.available()
    assert "never installed" in native.kernel_path().reason
    assert not (tmp_path / "kernels").exists()  # nothing written
    x, w = torch.randn(2, 32), torch.randn(3, 32)
    torch.testing.assert_close(native.gemm_f32(x, w), x @ w.T)


def test_a_failing_compiler_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        fresh: None) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fake cc 1.0'; [ \"$1\" = --version ] && exit 0\n"
                    "echo 'boom: unsupported' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(loader, "_installed", lambda: None)
    monkeypatch.setenv("EXITLM_CC", str(fake))
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path))
    with pytest.warns(ExitlmWarning, match="developer build failed"):
        assert not native.available()
    assert "boom: unsupported" in native.kernel_path().reason
    assert not [p for p in (tmp_path / "kernels").iterdir()]  # no partial file left


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_edited_sources_take_a_cached_developer_build(fresh: None,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """Sources that differ from the installed build's record (or a source tree never
    installed) are built with -march=native into the cache, once, keyed by the CPU. (Built
    at -O0 here: 3 s instead of 22; ``fresh`` comes first so that the session's library is
    loaded again after the patches are undone, not this build.)"""
    monkeypatch.setattr(loader, "DEV_CFLAGS", ("-O0", *loader.DEV_CFLAGS[1:]))
    if INSTALLED is not None:
        monkeypatch.setattr(loader, "source_digest", lambda: "edited")
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path))
    if INSTALLED is not None:
        with pytest.warns(ExitlmWarning, match="differ"):
            assert native.available()
    else:
        assert native.available()
    path = native.kernel_path()
    assert (path.source, path.isa) == ("developer build", "native")
    built = Path(path.library)
    assert built.parent == tmp_path / "kernels" and built.is_file()
    compiles: list[list[str]] = []
    real_run = subprocess.run

    def spy(cmd: list[str], *a: object, **kw: object) -> subprocess.CompletedProcess:
        if "-shared" in cmd:
            compiles.append(cmd)
        return real_run(cmd, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(loader.subprocess, "run", spy)
    assert loader.build_dev() == built
    assert compiles == []
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".build-")]


def test_the_developer_cache_key_includes_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Two CPUs sharing one cache (an NFS home, a warm Docker layer) never share a build."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path))
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], *a: object, **kw: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if "--version" in cmd:
            return subprocess.CompletedProcess(cmd, 0, "cc 1\n", "")
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"lib")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(loader.subprocess, "run", fake_run)
    monkeypatch.setattr(loader, "_cpu_flags", lambda: "fpu sse2 avx2")
    a = loader.build_dev("cc")
    monkeypatch.setattr(loader, "_cpu_flags", lambda: "fpu sse2")
    b = loader.build_dev("cc")
    assert a != b and a.is_file() and b.is_file()
    assert "-march=native" in calls[1]


def test_decoding_on_the_torch_fallback_is_still_lossless() -> None:
    """The lossless strategies' conformance tests (eager runner) re-run in a process with the
    native library disabled: without the native kernels every product is torch's."""
    env = {**os.environ, "EXITLM_NATIVE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
         str(TESTS / "infer" / "test_conformance.py"), "-k", "lossless and eager"],
        capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "exitlm kernels: torch fallback" in out
    assert " passed" in out and "failed" not in out


def test_developer_builds_share_the_cache_root(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """The developer builds live under the same ``$EXITLM_CACHE`` as everything exitlm
    caches, ``~`` expanded (the kernels once kept a literal ``~`` directory)."""
    from exitlm.io.cache import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EXITLM_CACHE", "~/exitlm-cache")
    assert cache_root() == tmp_path / "exitlm-cache"
    assert loader._cache_dir() == tmp_path / "exitlm-cache" / "kernels"
