"""Find, check and load exitlm's native library; say which kernel path runs and why.

Installing exitlm (``pip install .``, ``pip install -e .``, ``pip wheel .``) compiles the C
sources of this folder once, with CMake (``src/exitlm/kernels/CMakeLists.txt``), into one
library per instruction set: ``baseline`` (any x86-64, or any CPU of another architecture),
``avx2`` (AVX2 + FMA + F16C) and ``avx512`` (AVX-512 F/BW/VL/DQ/VNNI). Nothing is compiled
when exitlm runs. At first use the loader opens the baseline build, asks it what the CPU can
run (``exitlm_cpu_features``: cpuid through the compiler's ``__builtin_cpu_supports``), and
loads the best build the CPU supports (the avx512 build on an AMD Zen 4 core runs its products
of one and two rows on 256-bit tiles: :func:`narrow_note`). Every build computes the same
bits: the products follow one fixed summation order whatever the instruction set
(``kernels.c``), and the C code is compiled without ``-ffast-math`` and with ``-ffp-contract=off``.

``EXITLM_NATIVE`` chooses:

- unset, ``1``, ``auto``: the installed build for this CPU (see above);
- ``baseline``, ``avx2``, ``avx512``: that installed build (one the CPU cannot run is refused
  with a warning and the best supported one is used);
- ``build``: developer mode: compile the sources with ``cc -O3 -march=native`` into
  ``$EXITLM_CACHE/kernels/`` (default ``~/.cache/exitlm/kernels``), keyed by the SHA-256 of the
  sources, the flags, the compiler's version, the platform and the CPU's feature flags (so a
  cache shared between machines never hands one CPU another's instructions), written
  atomically; ``EXITLM_CC`` names the compiler;
- ``0``, ``off``: no native library: the torch fallback.

A source tree that was never installed (``PYTHONPATH=src``), or whose C sources differ from
the ones the installed library was built from, takes the developer build when a compiler is
there. Without any library, every product falls back to torch: the same values up to
rounding, but *not* row-invariant (BLAS may change its blocking with the number of rows), so
lossless decoders are then exact only up to that rounding. :func:`kernel_path` says which
path runs and why (``exitlm info``, the ``--json`` results).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from exitlm.env import OFF
from exitlm.errors import warn
from exitlm.kernels import abi
from exitlm.paths import atomic_file, cache_root

__all__ = [
    "DEV_CFLAGS",
    "ISAS",
    "SOURCES",
    "KernelPath",
    "build_dev",
    "cpuinfo",
    "kernel_path",
    "library",
    "library_file",
    "load_variant",
    "narrow_note",
    "reset",
    "source_digest",
]

HERE = Path(__file__).resolve().parent
SOURCES: tuple[Path, ...] = tuple(HERE / f for f in (
    "kernels.c", "dense.c", "lanes.c", "dense256.c", "lanes256.c", "scalar.c", "pool.c",
    "prefetch.c", "block.c", "reduce.c", "channel.c"))
"""The C sources of the library."""
HEADERS: tuple[Path, ...] = (abi.HEADER, HERE / "half.h", HERE / "gemm.h", HERE / "narrow.h")
"""The headers they include: the exports (``exitlm_native.h``) and internal helpers."""

ISAS: tuple[str, ...] = ("avx512", "avx2", "baseline")
"""The installed builds, best first."""
_NEEDS = {"avx512": abi.CPU_AVX2 | abi.CPU_AVX512, "avx2": abi.CPU_AVX2, "baseline": 0}

DEV_CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared",
                               "-Werror=implicit-function-declaration",
                               "-std=c11", "-pthread", '-DEXITLM_ISA="native"')
"""Flags of the developer build (``EXITLM_NATIVE=build``); never ``-ffast-math``, which would
let the compiler reorder the sums."""

_AUTO = ("", "1", "true", "yes", "on", "auto")


@dataclass(frozen=True)
class KernelPath:
    """Which kernels run. ``backend``: ``"native"`` or ``"torch"``; ``isa``: the native
    build's instruction set (``baseline``, ``avx2``, ``avx512`` or ``native`` for a developer
    build); ``source``: ``"installed"`` or ``"developer build"``; ``library``: its file;
    ``cpu``: what the CPU supports (``avx512``, ``avx2`` or ``baseline``); ``reason``: why the
    torch fallback runs (or why a lesser build was chosen, or how the build runs on this CPU:
    :func:`narrow_note`), else ''."""

    backend: str
    isa: str | None
    source: str | None
    library: str | None
    cpu: str | None
    reason: str

    def describe(self) -> str:
        """One line: ``native avx2 (installed, CPU supports avx512)`` or ``torch fallback
        (<reason>)``."""
        if self.backend == "native":
            cpu = f", CPU supports {self.cpu}" if self.cpu else ""
            note = f"; {self.reason}" if self.reason else ""
            return f"native {self.isa} ({self.source}{cpu}){note}"
        return f"torch fallback, not row-invariant ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "lib", "path": set once by library()


def reset() -> None:
    """Forget the loaded library, so that the next :func:`library` call looks again (tests)."""
    with _lock:
        _loaded.clear()


def _suffix() -> str:
    return {"darwin": ".dylib", "win32": ".dll"}.get(sys.platform, ".so")


def library_file(isa: str, folder: Path) -> Path:
    """The file of the installed ``isa`` build in ``folder`` (``libexitlm_<isa>.so``)."""
    return folder / f"libexitlm_{isa}{_suffix()}"


def _installed() -> tuple[Path, dict[str, Any]] | None:
    """(folder, build record) of the installed libraries, or None in a never-installed tree.

    The build writes ``_build_info.py`` next to the libraries. An editable install keeps the
    Python sources in the source tree and the built files in site-packages; importing the
    record through the import system finds it in either case."""
    try:
        record = importlib.import_module("exitlm.kernels._build_info")
    except ImportError:
        return None
    folder = Path(record.__file__).resolve().parent
    return folder, {k: getattr(record, k) for k in ("VARIANTS", "SOURCE_DIGEST", "COMPILER",
                                                    "NOTE") if hasattr(record, k)}


def source_digest() -> str | None:
    """SHA-256 of the C sources and the header as they are now (None if one is missing): the
    digest of the files' SHA-256 hex digests joined by newlines, as CMakeLists.txt computes it
    for the installed build's record."""
    digests = []
    for path in (*SOURCES, *HEADERS):
        try:
            digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
        except OSError:
            return None
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _open(path: Path) -> ctypes.CDLL:
    """Load and check one library file (abi.declare: version, exports, struct sizes)."""
    lib = ctypes.CDLL(str(path))
    abi.declare(lib, path)
    return lib


def narrow_note(rows: int) -> str:
    """``KernelPath.reason`` of an avx512 build that runs its products of up to ``rows`` x rows
    (decoding's steps, short verifications and batches) on its 256-bit tiles, as the library
    chooses at load on AMD family 25 (``narrow_rows`` in ``prefetch.c``;
    :func:`exitlm.kernels.native.narrow_rows`)."""
    which = "one-row products" if rows == 1 else f"products of 1-{rows} rows"
    return f"{which} on its 256-bit tiles: this AMD Zen 4 core runs AVX-512 on 256-bit halves"


def _cpu_level(features: int) -> str:
    for isa in ISAS:
        if features & _NEEDS[isa] == _NEEDS[isa]:
            return isa
    return "baseline"


def load_variant(isa: str) -> ctypes.CDLL | None:
    """The installed ``isa`` build, loaded and checked, or None when it is not installed or
    this CPU cannot run it (for tests comparing the builds bit for bit)."""
    found = _installed()
    if found is None or isa not in found[1].get("VARIANTS", ()):
        return None
    folder = found[0]
    base = _open(library_file("baseline", folder))
    if int(base.exitlm_cpu_features()) & _NEEDS[isa] != _NEEDS[isa]:
        return None
    return base if isa == "baseline" else _open(library_file(isa, folder))


def cpuinfo(*fields: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line that starts with one of ``fields``
    (Linux: ``flags``, ``model name``, ...); None where there is no such line or file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(fields):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags as the OS lists them (part of the developer cache key)."""
    flags = cpuinfo("flags", "Features")
    return f"{platform.processor()} {platform.machine()}" if flags is None else flags


def _cache_dir() -> Path:
    """``$EXITLM_CACHE/kernels`` (default ``~/.cache/exitlm/kernels``, exitlm's cache)."""
    return cache_root() / "kernels"


def build_dev(cc: str | None = None) -> Path:
    """Compile the developer build (``-march=native``) unless one for these sources, flags,
    compiler, platform and CPU exists; returns its path. Raises RuntimeError or OSError when
    the compiler is missing or fails."""
    cc = cc or os.environ.get("EXITLM_CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in (*SOURCES, *HEADERS)), " ".join(DEV_CFLAGS).encode(),
                 version.encode(), platform.platform().encode(), platform.machine().encode(),
                 _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"{key.hexdigest()}{_suffix()}"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # atomic: a concurrent loader sees no file or a whole one
    with atomic_file(target) as tmp:
        proc = subprocess.run([cc, *DEV_CFLAGS, "-o", str(tmp), *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(f"{cc} failed: {msg[0] if msg else proc.returncode}")
        os.chmod(tmp, 0o755)  # the linker may have written a new file over the empty one
    return target


def _choose() -> tuple[ctypes.CDLL | None, KernelPath]:
    """Find and load the library the environment asks for (see the module docstring)."""
    mode = os.environ.get("EXITLM_NATIVE", "1").strip().lower()
    if mode in OFF:
        return None, KernelPath("torch", None, None, None, None,
                                "disabled by EXITLM_NATIVE=0")
    if mode != "build" and mode not in _AUTO and mode not in ISAS:
        warn(f"EXITLM_NATIVE={mode!r}: expected 1/auto, 0/off, build, or one of "
             f"{', '.join(ISAS)}; using the installed build for this CPU")
        mode = "auto"
    found = None if mode == "build" else _installed()
    stale = ""
    if found is not None:
        folder, record = found
        digest = source_digest()
        if digest is not None and record.get("SOURCE_DIGEST") not in (None, digest):
            stale = ("the C sources differ from the ones the installed library was built from "
                     "(edited since 'pip install'?)")
            found = None
    if found is not None:
        return _load_installed(folder, record, mode)
    why = stale or ("EXITLM_NATIVE=build" if mode == "build"
                    else "no installed native library (a source tree that was never installed)")
    cc = os.environ.get("EXITLM_CC", "cc")
    if mode != "build" and shutil.which(cc) is None and not os.path.isabs(cc):
        return None, KernelPath("torch", None, None, None, None,
                                f"{why}, and no C compiler ({cc}) to build one")
    try:
        path = build_dev(cc)
        lib = _open(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        reason = f"{why}; the developer build failed ({type(exc).__name__}: {exc})"
        return None, KernelPath("torch", None, None, None, None, reason)
    if stale:
        warn(f"{stale}: using a developer build of them ({path})")
    cpu = _cpu_level(int(lib.exitlm_cpu_features()))
    return lib, KernelPath("native", "native", "developer build", str(path), cpu,
                           stale or ("" if mode == "build" else why))


def _load_installed(folder: Path, record: dict[str, Any],
                    mode: str) -> tuple[ctypes.CDLL | None, KernelPath]:
    """Open the baseline build, ask the CPU, open the best build it supports (or the one
    ``EXITLM_NATIVE`` names)."""
    variants = tuple(record.get("VARIANTS", ()))
    if "baseline" not in variants:
        note = record.get("NOTE") or (f"the installed native library in {folder} has no "
                                      "baseline build (a broken install: reinstall exitlm)")
        return None, KernelPath("torch", None, None, None, None,
                                f"{note} (reinstall exitlm where a C compiler is available)")
    try:
        base = _open(library_file("baseline", folder))
        cpu = _cpu_level(int(base.exitlm_cpu_features()))
        note = ""
        wanted = [mode] if mode in ISAS else list(ISAS)
        if mode in ISAS and (mode not in variants
                             or ISAS.index(mode) < ISAS.index(cpu)):
            note = (f"EXITLM_NATIVE={mode}: not "
                    f"{'installed' if mode not in variants else 'supported by this CPU'}")
            warn(f"{note}; using the best installed build for this CPU")
            wanted = list(ISAS)
        for isa in wanted:
            if isa in variants and ISAS.index(isa) >= ISAS.index(cpu):
                lib = base if isa == "baseline" else _open(library_file(isa, folder))
                path = library_file(isa, folder)
                narrow = lib.exitlm_set_narrow_rows(-1)
                if not note and narrow > 0:
                    note = narrow_note(narrow)
                return lib, KernelPath("native", isa, "installed", str(path), cpu, note)
    except (OSError, abi.NativeABIError) as exc:
        reason = f"the installed native library cannot be used: {exc}"
        return None, KernelPath("torch", None, None, None, None, reason)
    raise AssertionError("unreachable: the baseline build is always eligible")


def library() -> ctypes.CDLL | None:
    """The loaded, checked library (None on the torch fallback); found once per process."""
    if "path" in _loaded:
        return _loaded["lib"]
    with _lock:
        if "path" not in _loaded:
            lib, path = _choose()
            _loaded["lib"], _loaded["path"] = lib, path
            if lib is None and not path.reason.startswith("disabled"):
                warn(f"native kernels unavailable: {path.reason}; using the torch reference "
                     "path (slower, not row-invariant)")
    return _loaded["lib"]


def kernel_path() -> KernelPath:
    """Which kernels run and why (loads the library on first call)."""
    library()
    return _loaded["path"]
