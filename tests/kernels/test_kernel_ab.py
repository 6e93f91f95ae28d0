"""benchmarks/kernel_ab.py at toy scale: shapes named NxK, x rows on 64-byte lines (as the
runtime's are), the same bits for the same library twice, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _native import needs_native
from exitlm.kernels import loader

pytestmark = needs_native

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_ab.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_kernel_ab_rows_pass_on_a_shape_given_as_n_x_k() -> None:
    lib = loader.kernel_path().library
    out = _run("--libs", f"a={lib},b={lib}", "--kinds", "f32,f16", "--no-decode",
               "--rows", "1,3", "--shapes", "40x100", "--passes", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    for kind in ("f32", "f16"):
        cell = res["rows"][kind]["40x100"]
        assert set(cell) == {"a", "b"}
        assert cell["b"]["same_bits"] is True
        assert cell["a"]["us_median"]["3"] > 0


def test_kernel_ab_x_rows_start_on_a_line() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import numpy as np

        import kernel_ab
        rng = np.random.default_rng(0)
        for m, k in ((1, 7), (3, 100), (8, 1536)):
            x = kernel_ab.x_rows(m, k, rng)
            assert x.shape == (m, k) and x.ctypes.data % 64 == 0
            assert x.flags.c_contiguous and np.isfinite(x).all() and x.std() > 0.5
        assert kernel_ab.shape_of("qkv") == (960, 576)
        assert kernel_ab.shape_of("256x688") == (256, 688)
        assert kernel_ab.shape_of("0x5") is None and kernel_ab.shape_of("5x") is None
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_kernel_ab_bad_shapes_are_one_line() -> None:
    lib = loader.kernel_path().library
    out = _run("--libs", f"a={lib}", "--shapes", "9x0")
    assert out.returncode == 2 and "--shapes: ['9x0']" in out.stderr
    out = _run("--libs", f"a={lib}", "--kinds", "q8", "--shapes", "64x100")
    assert out.returncode == 2 and "multiple of 32" in out.stderr
    assert "Traceback" not in out.stderr
