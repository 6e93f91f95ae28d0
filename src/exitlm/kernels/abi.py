"""The ctypes mirror of ``exitlm_native.h``: the native library's structs and signatures.

One home for every declaration the Python side makes about the C library (before, five
structs and 25 argument lists were spread over four modules with no check that they matched
the C code, so a one-sided change was a segfault). ``tests/kernels/test_native_abi.py`` parses
the header and checks this module against it; :func:`declare` checks a loaded library's ABI
version and struct sizes against these definitions and refuses a library that disagrees.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = [
    "ABI_VERSION",
    "CPU_AVX2",
    "CPU_AVX512",
    "FUNCTIONS",
    "HEADER",
    "STRUCTS",
    "BlockDims",
    "Chan",
    "Layer",
    "NativeABIError",
    "Reduce",
    "Weight",
    "declare",
]

HEADER = Path(__file__).with_name("exitlm_native.h")
"""The C header this module mirrors (shipped with the package)."""

ABI_VERSION = 7
"""``EXITLM_ABI_VERSION`` of the header: a library reporting another value is refused."""

CPU_AVX2 = 1
"""``EXITLM_CPU_AVX2``: the CPU runs the avx2 build (AVX2, FMA and F16C)."""
CPU_AVX512 = 2
"""``EXITLM_CPU_AVX512``: the CPU runs the avx512 build (AVX-512 F/BW/VL/DQ/VNNI)."""

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _F64 = ctypes.c_float, ctypes.c_double


class Weight(ctypes.Structure):
    """``exitlm_weight``: a weight of any format (0 f32, 1 f16, 2 q8, 3 q4)."""

    _fields_ = [("fmt", _I64), ("n", _I64), ("k", _I64),
                ("w", _P), ("scales", _P), ("mins", _P)]


class BlockDims(ctypes.Structure):
    """``exitlm_block_dims``: the shapes and scalars of a Llama-family block."""

    _fields_ = [("dim", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("hidden", _I64), ("eps", _F32), ("attn_scale", _F32)]


class Layer(ctypes.Structure):
    """``exitlm_layer``: one layer of a chain of blocks."""

    _fields_ = [("d", _P), ("norm1", _P), ("norm2", _P),
                ("wqkv", _P), ("wo", _P), ("w_in", _P), ("w_out", _P),
                ("kc", _P), ("vc", _P), ("head_stride", _I64), ("red", _P)]


class Reduce(ctypes.Structure):
    """``exitlm_reduce``: one tensor-parallel rank's view of the shared region."""

    _fields_ = [("flags", _P), ("data", _P), ("cap", _I64), ("rank", _I64),
                ("world", _I64), ("seq", _I64), ("timeout_s", _F64), ("watch", _I64)]


class Chan(ctypes.Structure):
    """``exitlm_chan``: one end of a one-way byte channel between two processes."""

    _fields_ = [("header", _P), ("ring", _P), ("cap", _I64), ("sender", _I64),
                ("watch", _I64)]


STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("exitlm_weight", Weight), ("exitlm_block_dims", BlockDims), ("exitlm_layer", Layer),
    ("exitlm_reduce", Reduce), ("exitlm_chan", Chan))
"""The header's structs in ``EXITLM_STRUCT_*`` order (the index ``exitlm_struct_size`` takes)."""

_GEMM = (_P, _P, _P, _I64, _I64, _I64, _INT)
_GEMM_Q8 = (_P, _P, _P, _P, _I64, _I64, _I64, _INT)
_GEMM_Q4 = (_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT)
_GEMM_Q4P = (_P, _P, _P, _P, _INT, _P, _I64, _I64, _I64, _INT)

FUNCTIONS: dict[str, tuple[type | None, tuple[type, ...]]] = {
    # identity (kernels.c)
    "exitlm_abi_version": (_INT, ()),
    "exitlm_struct_size": (_I64, (_INT,)),
    "exitlm_isa": (ctypes.c_char_p, ()),
    "exitlm_cpu_features": (_INT, ()),
    "exitlm_has_avx2": (_INT, ()),
    # products (kernels.c)
    "exitlm_gemm_f32": (_INT, _GEMM),
    "exitlm_gemm_f16": (_INT, _GEMM),
    "exitlm_gemm_q8": (_INT, _GEMM_Q8),
    "exitlm_gemm_q4": (_INT, _GEMM_Q4),
    "exitlm_gemm_q8a8": (_INT, _GEMM_Q8),
    "exitlm_gemm_q4a8": (_INT, _GEMM_Q4),
    "exitlm_gemm_q4p": (_INT, _GEMM_Q4P),
    "exitlm_gemm_q4pa8": (_INT, _GEMM_Q4P),
    "exitlm_round_to_half": (None, (_P, _I64)),
    "exitlm_pool_workers": (_INT, ()),
    "exitlm_set_tile": (_INT, (_INT, _INT, _INT, _INT)),
    "exitlm_set_spin": (None, (_INT,)),
    "exitlm_set_narrow_rows": (_INT, (_INT,)),
    # greedy screens (kernels.c)
    "exitlm_screen_round": (_INT, (_P, _I64, _I64, _P, _P)),
    "exitlm_screen_candidates": (_I64, (_P, _P, _P, _I64, _F64, _F64, _F64, _INT, _I64, _P)),
    # blocks (block.c)
    "exitlm_set_int8_activations": (_INT, (_INT,)),
    "exitlm_int8_activations": (_INT, ()),
    "exitlm_block_scratch": (_I64, (_P, _I64, _I64)),
    "exitlm_llama_block": (_INT, (_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                  _I64, _I64, _P, _INT, _P)),
    "exitlm_llama_blocks": (_INT, (_P, _I64, _I64, _P, _P, _P, _I64, _P, _INT, _INT)),
    "exitlm_llama_blocks_rows": (_INT, (_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _INT, _INT)),
    "exitlm_chain": (_INT, (_I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _F32, _P, _P, _F32,
                            _P, _P, _P, _P, _P, _INT)),
    "exitlm_segments": (_INT, (_P, _I64, _P, _P, _I64, _INT, _F32, _P, _P, _P, _P, _F32, _P,
                               _P, _P, _INT, _P)),
    # collectives (reduce.c)
    "exitlm_process_alive": (_INT, (_I64,)),
    "exitlm_now_s": (_F64, ()),
    "exitlm_reduce_sum": (_INT, (_P, _P, _I64)),
    "exitlm_reduce_gather": (_INT, (_P, _P, _I64, _P)),
    "exitlm_reduce_abort": (None, (_P,)),
    # channels (channel.c)
    "exitlm_chan_send": (_INT, (_P, _P, _I64, _F64)),
    "exitlm_chan_recv": (_INT, (_P, _P, _I64, _F64)),
    "exitlm_chan_drain": (_INT, (_P, _F64)),
    "exitlm_chan_abort": (None, (_P,)),
    "exitlm_chan_header_bytes": (_I64, ()),
}
"""Every exported function: ``name -> (restype, argtypes)``."""


class NativeABIError(RuntimeError):
    """A native library whose ABI differs from this package's (a stale or foreign build)."""


def declare(lib: ctypes.CDLL, path: Path | str) -> None:
    """Check ``lib`` (loaded from ``path``) against this module and declare every signature.

    Raises :class:`NativeABIError` naming the file when its ABI version or a struct size
    differs, or when it lacks an export: calling into such a library would read memory with
    the wrong layout."""
    try:
        version = lib.exitlm_abi_version
    except AttributeError:
        raise NativeABIError(f"{path}: not an exitlm native library of ABI {ABI_VERSION} (no "
                             "exitlm_abi_version export; a build older than this exitlm)") from None
    version.restype, version.argtypes = _INT, []
    got = int(version())
    if got != ABI_VERSION:
        raise NativeABIError(f"{path}: native library ABI version {got}, this exitlm needs "
                             f"{ABI_VERSION} (a stale build: reinstall exitlm)")
    missing = [name for name in FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise NativeABIError(f"{path}: native library lacks {', '.join(missing)}")
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)
    for index, (name, struct) in enumerate(STRUCTS):
        size = int(lib.exitlm_struct_size(index))
        if size != ctypes.sizeof(struct):
            raise NativeABIError(f"{path}: {name} is {size} bytes in the native library, "
                                 f"{ctypes.sizeof(struct)} in exitlm.kernels.abi")
