"""Primitive timings kept on disk, so that a new process need not time them again.

Adaptive self-speculation prices rounds from its runner's primitives, timed once per shape
before the first request (:class:`~exitlm.runtime.costs.PrimitiveCosts`): on ``layerskip-code``
~0.25 s of a fresh ``exitlm generate --strategy self-spec``, whose 64 new bytes then decode in
~0.08 s. The timings depend on the machine, the kernels, the thread count and the model's
shapes and formats - not on its weights' values - so they are written to
``$EXITLM_CACHE/costs/<key>.json`` (:func:`~exitlm.paths.cache_root`) and read back by the next
process whose runner has the same :func:`store_key`. A file older than :data:`STORE_DAYS` is
measured again (a machine's load changes; the planner corrects the cost model with the times
it measures while decoding in any case). ``EXITLM_COST_CACHE=0`` keeps every process timing
afresh (the test suite does, so that tests never share timings).

Files are JSON (never pickles), written atomically; one that does not parse, or holds anything
but ``[key, seconds]`` pairs, is ignored and replaced. ``exitlm cache`` lists and prunes them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from exitlm.env import switched_off
from exitlm.kernels import loader, native
from exitlm.paths import cache_root, write_text_atomic

STORE_DAYS = 7.0
"""Timings older than this many days are measured again."""
FORMAT = 1
"""The layout of a file (part of the key)."""
FOLDER = "costs"
"""The sub-folder of the cache (``exitlm cache``'s kind ``costs``)."""

Key = tuple[Any, ...]


def enabled() -> bool:
    """Whether timings are kept on disk (``EXITLM_COST_CACHE=0``, ``off``, ... turns it off)."""
    return not switched_off("EXITLM_COST_CACHE")


def _cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what Python says."""
    name = loader.cpuinfo("model name")
    return (platform.processor() or platform.machine()) if name is None else name


def _version() -> str:
    """exitlm's installed version (``unknown`` for a source tree that was never installed)."""
    try:
        return importlib.metadata.version("exitlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _library(runner: Any) -> list[Any]:
    """The kernels a runner's products run: the native library file (path, size, time) or the
    torch fallback; on CUDA the device's name."""
    device = runner.device
    if device.type == "cuda":
        return ["cuda", torch.cuda.get_device_name(device), torch.version.cuda]
    path = native.kernel_path()
    if path.library is None:
        return ["torch", path.reason]
    st = os.stat(path.library)
    return [path.isa, path.library, st.st_size, st.st_mtime_ns]


def store_key(runner: Any, kind: tuple[Any, ...]) -> str:
    """The name of ``runner``'s timings: a hash of what they depend on - exitlm's and torch's
    versions, the runner's ``kind`` (its class, dtype, device, module classes:
    :func:`~exitlm.runtime.costs._kind`), the model's configuration, the kernels, the
    processor and the thread count."""
    parts = {
        "format": FORMAT,
        "versions": [_version(), torch.__version__],
        "kind": [str(k) if not isinstance(k, frozenset) else sorted(k) for k in kind],
        "config": runner.model.config.to_dict(),
        "kernels": _library(runner),
        "cpu": [_cpu_name(), os.cpu_count(), platform.machine()],
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def path_of(key: str) -> Path:
    """Where the timings named ``key`` live."""
    return cache_root() / FOLDER / f"{key}.json"


def _valid_key(item: Any) -> bool:
    return isinstance(item, list) and bool(item) and isinstance(item[0], str) and all(
        x is None or (isinstance(x, (str, int)) and not isinstance(x, bool)) for x in item)


def load(key: str, *, now: float | None = None) -> dict[Key, float]:
    """The timings stored under ``key``: empty when there are none, when they are older than
    :data:`STORE_DAYS`, or when the file is not what :func:`save` writes."""
    path = path_of(key)
    try:
        if path.is_symlink() or not path.is_file():
            return {}
        now = time.time() if now is None else now
        if now - path.stat().st_mtime > STORE_DAYS * 86400:
            return {}
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return {}
    out: dict[Key, float] = {}
    for pair in doc.get("timings", ()):
        if not (isinstance(pair, list) and len(pair) == 2 and _valid_key(pair[0])
                and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
                and math.isfinite(pair[1]) and pair[1] >= 0):
            return {}
        out[tuple(pair[0])] = float(pair[1])
    return out


def save(key: str, timings: dict[Key, float]) -> bool:
    """Write ``timings`` under ``key`` (:func:`exitlm.paths.write_text_atomic`); False when
    the cache cannot be written (a read-only home: the timings just stay in this process)."""
    path = path_of(key)
    doc = {"format": FORMAT, "written": time.time(),
           "timings": [[list(k), v] for k, v in sorted(timings.items(), key=repr)]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(doc))
    except OSError:
        return False
    return True


__all__ = ["FOLDER", "STORE_DAYS", "enabled", "load", "path_of", "save", "store_key"]
