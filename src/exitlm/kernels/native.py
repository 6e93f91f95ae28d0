"""The native kernels of ``kernels.c``: compiled on first use, loaded with ctypes.

Each ``gemm_*`` computes ``y[..., n] = sum_k x[..., k] * W[n, k]`` for a float32 ``x`` of shape
``(..., K)`` and returns float32 ``(..., N)``. With the native library the value of every output
element is a fixed function of its row of ``x`` and its row of ``W`` (a fixed summation order,
see ``kernels.c``): the same bits whatever the number of rows in the call and whatever
``threads`` is. Decoders rely on this to make 1-row decoding and k-row draft verification give
identical tokens.

The library is compiled with ``cc -O3 -march=native -fPIC -shared -std=c11 -pthread`` (never
``-ffast-math``, which would let the compiler reorder the sums) into
``$EXITLM_CACHE/kernels/`` (default ``~/.cache/exitlm/kernels/``), named by the SHA-256 of
the source, the flags, ``cc --version`` and the platform, and written atomically (compile to a
temporary name in the same directory, then ``os.replace``), so concurrent first uses are safe.
``EXITLM_NATIVE=0`` disables it; a missing compiler or a failed build warns once and every
function falls back to a torch reference path (same values up to rounding, but *not*
row-invariant: BLAS may change its blocking with the number of rows).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from exitlm.errors import warn

__all__ = [
    "CFLAGS",
    "BoundGemm",
    "available",
    "bind",
    "gemm_f16",
    "gemm_f32",
    "gemm_q4",
    "gemm_q8",
    "int8_activations",
    "library_path",
    "set_int8_activations",
    "unavailable_reason",
]

CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-pthread")
_SOURCES = tuple(Path(__file__).with_name(f)
                 for f in ("kernels.c", "block.c", "reduce.c", "channel.c"))
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib", "path", "reason": set once by _load()


def _cache_dir() -> Path:
    """``$EXITLM_CACHE/kernels`` (default ``~/.cache/exitlm/kernels``, exitlm's cache)."""
    root = os.environ.get("EXITLM_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "exitlm"
    return base / "kernels"


def _cc_version(cc: str) -> str:
    """``cc --version`` output (part of the cache key: a new compiler means a new build)."""
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def _build(cc: str) -> Path:
    """Compile the C sources (``kernels.c``, ``block.c``, ``reduce.c``, ``channel.c``)
    unless a library for these sources, flags, compiler and platform exists."""
    key = hashlib.sha256()
    parts = [src.read_bytes() for src in _SOURCES]
    for part in (*parts, " ".join(CFLAGS).encode(), _cc_version(cc).encode(),
                 platform.platform().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"{key.hexdigest()}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"{cc} failed: {msg[0] if msg else proc.returncode}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(lib: ctypes.CDLL) -> None:
    """Declare the C signatures once (ctypes then converts ints without guessing)."""
    lib.exitlm_gemm_f32.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT]
    lib.exitlm_gemm_f16.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT]
    lib.exitlm_gemm_q8.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _INT]
    lib.exitlm_gemm_q4.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT]
    lib.exitlm_gemm_q8a8.argtypes = lib.exitlm_gemm_q8.argtypes
    lib.exitlm_gemm_q4a8.argtypes = lib.exitlm_gemm_q4.argtypes
    for name in ("exitlm_gemm_f32", "exitlm_gemm_f16", "exitlm_gemm_q8", "exitlm_gemm_q4",
                 "exitlm_gemm_q8a8", "exitlm_gemm_q4a8"):
        getattr(lib, name).restype = _INT
    lib.exitlm_has_avx2.argtypes = []
    lib.exitlm_has_avx2.restype = _INT
    lib.exitlm_pool_workers.argtypes = []
    lib.exitlm_pool_workers.restype = _INT
    lib.exitlm_set_spin.argtypes = [_INT]
    lib.exitlm_set_spin.restype = None
    lib.exitlm_set_int8_activations.argtypes = [_INT]
    lib.exitlm_set_int8_activations.restype = _INT
    lib.exitlm_int8_activations.argtypes = []
    lib.exitlm_int8_activations.restype = _INT
    lib.exitlm_set_int8_activations(int(_env_int8_activations()))


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on", "")


def _env_int8_activations() -> bool:
    """``EXITLM_INT8_ACTIVATIONS`` (default on); a value that is neither on nor off warns and
    counts as on."""
    raw = os.environ.get("EXITLM_INT8_ACTIVATIONS", "1")
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        warn(f"EXITLM_INT8_ACTIVATIONS={raw!r}: expected 1 or 0 (on/off, true/false, yes/no); "
             "keeping int8 activations on")
    return True


def int8_activations() -> bool:
    """Whether the fused native blocks (``block.c``) multiply int8/int4 weights with their
    activations rounded to int8 in groups of 32 (:func:`gemm_q8` / :func:`gemm_q4` with
    ``int8_activations=True``), as llama.cpp does for Q8_0/Q4_x weights. On by default;
    ``EXITLM_INT8_ACTIVATIONS=0`` or :func:`set_int8_activations` turn it off (float32
    activations: slower, closer to the dequantized weights). The products called from Python
    (batches, exit heads and the LM head) keep float32 activations: their inputs are not
    computed row-invariantly everywhere, and rounding would magnify a last-bit difference into
    a quantization step. False without the library."""
    lib = _load()
    return bool(lib is not None and lib.exitlm_int8_activations())


def set_int8_activations(on: bool) -> bool:
    """Switch int8 activations of the native blocks (:func:`int8_activations`) for this
    process; returns the previous setting. Process-wide on purpose: plain steps and draft
    verification must round alike for the lossless decoders to stay token-identical, so
    switch it before decoding, not during. Also sets ``EXITLM_INT8_ACTIVATIONS`` in this
    process's environment, which the worker processes it spawns later read."""
    lib = _load()
    if lib is None:
        return False
    # processes started from now on (PPD and pipeline workers, spawned) round alike
    os.environ["EXITLM_INT8_ACTIVATIONS"] = "1" if on else "0"
    return bool(lib.exitlm_set_int8_activations(int(bool(on))))


def _load() -> ctypes.CDLL | None:
    """The loaded library, or None (the reason is in ``_state["reason"]``); tried once."""
    if "reason" in _state:
        return _state.get("lib")  # type: ignore[return-value]
    with _lock:
        if "reason" in _state:
            return _state.get("lib")  # type: ignore[return-value]
        lib = None
        reason = ""
        if os.environ.get("EXITLM_NATIVE", "1").strip().lower() in _OFF:
            reason = "disabled by EXITLM_NATIVE=0"
        else:
            try:
                path = _build(os.environ.get("EXITLM_CC", "cc"))
                lib = ctypes.CDLL(str(path))
                _bind(lib)
                _state["path"] = path
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                lib = None
                reason = f"native kernels unavailable ({type(exc).__name__}: {exc})"
                warn(f"{reason}; using the torch reference path (not row-invariant)")
        _state["lib"] = lib
        _state["reason"] = reason
        if lib is not None:
            _bind_fast(lib)
        return lib


def available() -> bool:
    """Whether the native library is compiled and loaded (compiles it on first call)."""
    return _load() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    _load()
    return str(_state["reason"])


def bound(bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The library with the signatures ``bind`` declares (once per ``bind``): the modules
    wrapping the other C files (``block.c``, ``reduce.c``, ``channel.c``) declare their own
    entry points when they first use them; declaring twice is harmless."""
    lib = library()
    if lib is not None and bind not in _declared:
        bind(lib)
        _declared.add(bind)
    return lib


_declared: set[Callable[[ctypes.CDLL], None]] = set()


def library() -> ctypes.CDLL | None:
    """The loaded library (None without one): for :mod:`exitlm.kernels.native_block`."""
    return _load()


def library_path() -> Path | None:
    """Path of the loaded shared library (None without one)."""
    _load()
    return _state.get("path")  # type: ignore[return-value]


# Bound C functions (set by _bind_fast) - module globals keep the per-call lookups minimal.
_f32 = _f16 = _q8 = _q4 = _q8a8 = _q4a8 = None


def _bind_fast(lib: ctypes.CDLL) -> None:
    """Publish the bound functions as module globals (one global lookup per call)."""
    global _f32, _f16, _q8, _q4, _q8a8, _q4a8
    _f32, _f16, _q8, _q4 = lib.exitlm_gemm_f32, lib.exitlm_gemm_f16, lib.exitlm_gemm_q8, \
        lib.exitlm_gemm_q4
    _q8a8, _q4a8 = lib.exitlm_gemm_q8a8, lib.exitlm_gemm_q4a8


_F32, _F16, _I8, _U8 = torch.float32, torch.float16, torch.int8, torch.uint8


def _bad(name: str, what: str, t: object, dtype: torch.dtype, shape: str) -> ValueError:
    """The error for a tensor argument that is not a contiguous CPU ``dtype`` of ``shape``."""
    if not isinstance(t, torch.Tensor):
        return ValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        return ValueError(f"{name}: {what} must be {dtype}, got {t.dtype}")
    if not t.is_cpu:
        return ValueError(f"{name}: {what} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        return ValueError(f"{name}: {what} must be contiguous (call .contiguous())")
    return ValueError(f"{name}: {what} must have shape {shape}, got {tuple(t.shape)}")


def _w2(t: torch.Tensor, dtype: torch.dtype, name: str, what: str) -> tuple[int, int]:
    """(N, C) of a 2-D contiguous CPU weight tensor of ``dtype`` (ValueError otherwise)."""
    if (type(t) is not torch.Tensor or t.dtype != dtype or t.dim() != 2 or not t.is_cpu
            or not t.is_contiguous()):
        raise _bad(name, what, t, dtype, "(N, K)")
    n, c = t.shape
    return n, c


def _aux(t: torch.Tensor, n: int, g: int, name: str, what: str) -> None:
    """Check a float32 (N, K/32) scales / mins tensor."""
    if (type(t) is not torch.Tensor or t.dtype != _F32 or not t.is_cpu
            or not t.is_contiguous() or t.shape != (n, g)):
        raise _bad(name, what, t, _F32, f"({n}, {g})")


def _rows(x: torch.Tensor, k: int, name: str) -> int:
    """Rows M of a contiguous CPU float32 x (..., K) (ValueError otherwise)."""
    if (type(x) is not torch.Tensor or x.dtype != _F32 or not x.is_cpu or not x.is_contiguous()
            or x.dim() < 1 or x.shape[-1] != k):
        raise _bad(name, "x", x, _F32, f"(..., {k})")
    return x.numel() // k if k else 0


def _groups(k: int, name: str) -> int:
    """Number of 32-element groups along K (ValueError unless K is a positive multiple of 32)."""
    if k % 32 != 0 or k == 0:
        raise ValueError(f"{name}: K must be a positive multiple of 32, got {k}")
    return k // 32


def _threads(threads: int, name: str) -> None:
    """ValueError unless ``threads`` is a positive int."""
    if type(threads) is not int or threads < 1:
        raise ValueError(f"{name}: threads must be a positive int, got {threads!r}")


def _out(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Uninitialised float32 output ``(..., N)`` for ``x (..., K)`` with ``m`` rows."""
    if x.dim() == 2:
        return torch.empty(m, n)
    return torch.empty((*x.shape[:-1], n))


def gemm_f32(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x (..., K) float32 @ w.T`` for a float32 row-major ``w (N, K)`` -> ``(..., N)``."""
    n, k = _w2(w, _F32, "gemm_f32", "w")
    m = _rows(x, k, "gemm_f32")
    _threads(threads, "gemm_f32")
    if _f32 is None and _load() is None:
        return torch.nn.functional.linear(x, w)
    y = _out(x, m, n)
    _f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y


def gemm_f16(x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """``x (..., K) float32 @ w.T`` for a float16 row-major ``w (N, K)`` (converted exactly to
    float32 in registers) -> float32 ``(..., N)``."""
    n, k = _w2(w, _F16, "gemm_f16", "w")
    m = _rows(x, k, "gemm_f16")
    _threads(threads, "gemm_f16")
    if _f16 is None and _load() is None:
        return torch.nn.functional.linear(x, w.float())
    y = _out(x, m, n)
    _f16(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y


def gemm_q8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, threads: int = 1, *,
            int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = q[n, k] * scales[n, k // 32]`` (int8 ``q (N, K)``, float32
    ``scales (N, K/32)``; Q8_0 groups) -> float32 ``(..., N)``.

    ``int8_activations``: round each row of ``x`` to int8 in groups of 32 first and take integer
    dot products (``kernels.c`` q8a8, llama.cpp's Q8_0 x Q8_0; still row-invariant). Without
    the native library the fallback keeps float32 activations."""
    n, k = _w2(q, _I8, "gemm_q8", "q")
    g = _groups(k, "gemm_q8")
    _aux(scales, n, g, "gemm_q8", "scales")
    m = _rows(x, k, "gemm_q8")
    _threads(threads, "gemm_q8")
    if _q8 is None and _load() is None:
        w = (q.float().view(n, g, 32) * scales.unsqueeze(-1)).view(n, k)
        return torch.nn.functional.linear(x, w)
    y = _out(x, m, n)
    (_q8a8 if int8_activations else _q8)(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                         y.data_ptr(), m, n, k, threads)
    return y


def gemm_q4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            threads: int = 1, *, int8_activations: bool = False) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = nibble[n, k] * scales[n, g] + mins[n, g]``, ``g = k // 32``
    (Q4_1 groups; Q4_0 is ``mins = -8 * scales``) -> float32 ``(..., N)``.

    ``q`` is uint8 ``(N, K/2)``: group g of a row is bytes ``[16g, 16g + 16)``; byte j holds
    element j of the group in its low nibble and element j + 16 in its high nibble (GGUF order).
    ``int8_activations`` as in :func:`gemm_q8` (the ``min`` term keeps float32 sums of ``x``).
    """
    n, kh = _w2(q, _U8, "gemm_q4", "q")
    k = 2 * kh
    g = _groups(k, "gemm_q4")
    _aux(scales, n, g, "gemm_q4", "scales")
    _aux(mins, n, g, "gemm_q4", "mins")
    m = _rows(x, k, "gemm_q4")
    _threads(threads, "gemm_q4")
    if _q4 is None and _load() is None:
        return torch.nn.functional.linear(x, unpack_q4(q, scales, mins))
    y = _out(x, m, n)
    (_q4a8 if int8_activations else _q4)(x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                         mins.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y


class BoundGemm:
    """One of the ``gemm_*`` products with its weight checked and its pointers taken once.

    ``bound(x, threads=1)`` returns the same bits as the ``gemm_*`` call it stands for, with only
    ``x`` checked per call (the per-call Python work of a decoding step's many small products).
    It keeps references to the weight tensors, so their storage stays valid; do not resize them.
    """

    __slots__ = ("_fn", "_keep", "_ptrs", "_ref", "k", "kind", "n")

    def __init__(self, kind: str, tensors: tuple[torch.Tensor, ...], n: int, k: int,
                 ref: Callable[..., torch.Tensor]) -> None:
        self.kind, self.n, self.k = kind, n, k
        self._keep = tensors
        self._ref = ref
        lib = _load()
        self._fn = None if lib is None else getattr(lib, f"exitlm_gemm_{kind}")
        self._ptrs = tuple(t.data_ptr() for t in tensors)

    def __call__(self, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """``x (..., K) float32 -> (..., N) float32`` (``threads`` a positive int)."""
        if self._fn is None:
            return self._ref(x, *self._keep, threads=threads)
        n, k = self.n, self.k
        m = _rows(x, k, self.kind)
        y = torch.empty(m, n) if x.dim() == 2 else _out(x, m, n)
        self._fn(x.data_ptr(), *self._ptrs, y.data_ptr(), m, n, k, threads)
        return y


def bind(kind: str, *weights: torch.Tensor) -> BoundGemm:
    """Check a weight once and return a fast callable: ``bind("f32", w)``, ``bind("f16", w)``,
    ``bind("q8", q, scales)``, ``bind("q4", q, scales, mins)`` (formats as in ``gemm_*``)."""
    if kind in ("f32", "f16"):
        if len(weights) != 1:
            raise ValueError(f"bind({kind!r}): pass the weight (N, K)")
        n, k = _w2(weights[0], _F32 if kind == "f32" else _F16, f"bind({kind!r})", "w")
        return BoundGemm(kind, weights, n, k, gemm_f32 if kind == "f32" else gemm_f16)
    if kind == "q8":
        if len(weights) != 2:
            raise ValueError("bind('q8'): pass q and scales")
        n, k = _w2(weights[0], _I8, "bind('q8')", "q")
        _aux(weights[1], n, _groups(k, "bind('q8')"), "bind('q8')", "scales")
        return BoundGemm(kind, weights, n, k, gemm_q8)
    if kind == "q4":
        if len(weights) != 3:
            raise ValueError("bind('q4'): pass q, scales and mins")
        n, kh = _w2(weights[0], _U8, "bind('q4')", "q")
        g = _groups(2 * kh, "bind('q4')")
        _aux(weights[1], n, g, "bind('q4')", "scales")
        _aux(weights[2], n, g, "bind('q4')", "mins")
        return BoundGemm(kind, weights, n, 2 * kh, gemm_q4)
    raise ValueError(f"bind: kind must be 'f32', 'f16', 'q8' or 'q4', got {kind!r}")


def unpack_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize packed Q4 (see :func:`gemm_q4`) to ``(N, K)``: ``nibble * scale + min``
    computed in float32 (a multiply then an add, each rounded)."""
    n, kh = q.shape
    g = kh // 16
    b = q.view(n, g, 16)
    nib = torch.cat((b & 15, b >> 4), dim=-1).float()  # (n, g, 32): low nibbles, then high
    w = nib * scales.unsqueeze(-1) + mins.unsqueeze(-1)
    return w.view(n, 2 * kh).to(dtype)
