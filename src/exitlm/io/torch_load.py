"""Reading a PyTorch ``.pt`` file without running the code it may carry.

Megatron-LM / EE-LLM checkpoints are ``torch.save`` pickles: tensors in nested dicts plus the
training run's ``argparse.Namespace``, random-number-generator states (numpy arrays) and,
depending on the version, Python enums of Megatron's own modules. :func:`load_pt` reads them
with ``torch.load(weights_only=True)``: only tensors, plain containers and the globals
allow-listed here are ever built. ``argparse.Namespace`` is built for real (its attributes are
plain values); numpy arrays, numpy dtypes and Megatron enums, which exitlm never needs, are
built as :class:`Opaque` placeholders, so no numpy or Megatron code runs either. Any other
global refuses the file with one line naming it, before anything is called.
"""

from __future__ import annotations

import argparse
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from exitlm.io.hf_map import CheckpointError


class Opaque:
    """Stands for a pickled object exitlm does not need (a numpy array in a saved random
    state, a Megatron enum in the saved arguments): accepts any construction arguments and
    state and keeps none of them."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<opaque>"


_NUMPY_DTYPES = (
    "Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
    "Float16", "Float32", "Float64", "LongDouble", "Complex64", "Complex128", "CLongDouble",
    "Byte", "UByte", "Short", "UShort", "Int", "UInt", "Long", "ULong", "LongLong",
    "ULongLong", "Half", "Float", "Double", "CFloat", "CDouble", "Str", "Bytes", "Void",
    "Object", "DateTime64", "TimeDelta64",
)
_OPAQUE_NAMES = (
    [f"{m}.multiarray.{f}" for m in ("numpy.core", "numpy._core")
     for f in ("_reconstruct", "scalar")]
    + ["numpy.ndarray", "numpy.dtype"]
    + [f"numpy.dtypes.{d}DType" for d in _NUMPY_DTYPES]
    + [f"megatron.{m}.{e}" for m in ("core.enums", "model.enums", "core.transformer.enums")
       for e in ("ModelType", "AttnMaskType", "LayerType", "AttnType", "PositionEmbeddingType",
                 "AttnBackend")]
)
MEGATRON_GLOBALS: dict[str, Any] = {
    "argparse.Namespace": argparse.Namespace,
    **dict.fromkeys(_OPAQUE_NAMES, Opaque),
}
"""The globals a Megatron-LM / EE-LLM checkpoint may pickle besides tensors and containers,
and what each is built as."""


def unsafe_globals(path: Path) -> list[str]:
    """The globals ``path`` (a zip-format ``torch.save`` file) names beyond torch's own safe
    set, read from the pickle's opcodes without executing any of them."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as err:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: {err}") from None


def load_pt(path: Path, allowed: dict[str, Any] | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` with only ``allowed`` (default
    :data:`MEGATRON_GLOBALS`) added to torch's safe globals; tensors are memory-mapped
    (zip-format files), so reading a shard holds none of its data until it is used.

    Raises :class:`CheckpointError` naming the file and the first global it is not allowed
    to build, without having called it.
    """
    allowed = MEGATRON_GLOBALS if allowed is None else allowed
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file is missing")
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        for name in unsafe_globals(path):
            if name not in allowed:
                raise _refusal(path, name)
    safe = [(obj, name) for name, obj in allowed.items()]
    try:
        with torch.serialization.safe_globals(safe), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as err:
        text = str(err)
        found = re.search(r"GLOBAL (\S+)", text)
        if found:
            raise _refusal(path, found.group(1)) from None
        why = text.partition("WeightsUnpickler error:")[2].strip().split("\n")[0] or "?"
        raise CheckpointError(f"{path}: refused by the safe unpickler ({why}); not a "
                              "torch.save file of tensors and plain values") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError,
            AttributeError) as err:  # whatever a malformed byte stream makes the reader raise
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: {first}") from None


def _refusal(path: Path, name: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: refusing to unpickle the global {name} (only tensors, containers and "
        "argparse.Namespace are loaded; unpickling anything else can run arbitrary code)",
        hint="this is not a plain Megatron-LM checkpoint; re-save it from a trusted source",
    )
