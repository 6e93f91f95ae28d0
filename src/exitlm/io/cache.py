"""What exitlm's cache holds (``$EXITLM_CACHE``, default ``~/.cache/exitlm``), and pruning it.

Only entries exitlm wrote are ever listed or removed: an entry is a file or directory in one of
exitlm's own sub-folders whose name matches the name exitlm gives it there (:data:`KINDS`).
Anything else - a file a user put there, a symlink, another tool's folder - is left alone.
Imports no torch (``exitlm cache`` answers at once).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from exitlm.paths import cache_root

KINDS: dict[str, tuple[str, re.Pattern[str], bool]] = {
    # kind: (sub-folder, the names exitlm writes there, whether an entry is a directory)
    "models": ("gguf", re.compile(r".+-\d+-\d+-v\d+(-[a-z0-9]+)?"), True),
    "data": ("data", re.compile(r"[0-9a-f]{20}"), True),
    "token-orders": ("token_order", re.compile(r"[0-9a-f]{32}\.safetensors"), False),
    "kernels": ("kernels", re.compile(r"[0-9a-f]{64}\.so"), False),
    "bench-models": ("bench-gguf", re.compile(r".+-\d+-\d+"), True),
    "costs": ("costs", re.compile(r"[0-9a-f]{32}\.json"), False),
}
"""Converted GGUF models, tokenized corpora, token frequency orders, compiled C kernels,
the benchmark's converted GGUF files, and runners' primitive timings
(:mod:`exitlm.runtime.cost_store`)."""


@dataclass(frozen=True)
class Entry:
    """One thing exitlm cached."""

    kind: str
    path: Path
    size: int
    """Bytes (a directory: the files under it)."""
    mtime: float
    """The newest modification time of the entry (a directory: of anything under it)."""


def _measure(path: Path) -> tuple[int, float]:
    st = path.lstat()
    size, newest = st.st_size, st.st_mtime
    if path.is_dir() and not path.is_symlink():
        size = 0
        for folder, _dirs, files in os.walk(path):  # os.walk does not follow symlinks
            for name in files:
                try:
                    fst = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                size += fst.st_size
                newest = max(newest, fst.st_mtime)
    return size, newest


def entries(root: Path | None = None, kinds: Iterable[str] | None = None) -> list[Entry]:
    """exitlm's entries under ``root`` (default :func:`cache_root`), oldest first."""
    root = cache_root() if root is None else root
    out = []
    for kind in (kinds or KINDS):
        folder, pattern, is_dir = KINDS[kind]
        where = root / folder
        if where.is_symlink() or not where.is_dir():
            continue
        for p in where.iterdir():
            if p.is_symlink() or not pattern.fullmatch(p.name):
                continue
            if (p.is_dir() if is_dir else p.is_file()):
                size, mtime = _measure(p)
                out.append(Entry(kind, p, size, mtime))
    return sorted(out, key=lambda e: (e.mtime, str(e.path)))


def select(found: list[Entry], *, older_than_days: float | None = None,
           max_size: int | None = None, now: float | None = None) -> list[Entry]:
    """The entries a prune removes: those older than ``older_than_days``, then the oldest
    of the rest until what stays fits in ``max_size`` bytes; everything when neither is
    given."""
    if older_than_days is None and max_size is None:
        return list(found)
    now = time.time() if now is None else now
    chosen = [e for e in found if older_than_days is not None
              and now - e.mtime > older_than_days * 86400]
    if max_size is not None:
        kept = [e for e in found if e not in chosen]  # oldest first
        total = sum(e.size for e in kept)
        for e in kept:
            if total <= max_size:
                break
            chosen.append(e)
            total -= e.size
    return sorted(chosen, key=lambda e: (e.mtime, str(e.path)))


def remove(entry: Entry) -> None:
    """Delete one entry (a directory's tree; symlinks inside are removed, never followed)."""
    if entry.path.is_dir() and not entry.path.is_symlink():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink(missing_ok=True)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
          "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``1000`` -> bytes (binary units); ``ValueError`` else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 500M or 2G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(size: int) -> str:
    """Bytes as ``12.3 MiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover
