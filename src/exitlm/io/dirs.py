"""Folders exitlm creates - an output directory (``convert``'s DST, ``train.out_dir``,
``bench --out-dir``) or a folder of its cache - and the one error for a folder that cannot be
created: a read-only or special file system (``/sys``, ``/proc``), a regular file where a
folder should be. It is a :class:`PathError`, printed by the command line as one line naming
the path and the system's reason, instead of a traceback. Imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from exitlm.errors import ExitlmError
from exitlm.paths import cache_root, file_ancestor, temp_prefix


class PathError(ExitlmError, OSError):
    """A file or folder exitlm writes cannot be created; the message names the path and the
    operating system's reason. (An ``OSError`` too, for callers that catch those.)"""


def cannot_create(path: Path | str, err: OSError, what: str = "") -> PathError:
    """The :class:`PathError` for ``path`` that failed with ``err`` (``what``: the setting or
    flag that named it, e.g. ``train.out_dir``). The reason is a file in the way when there is
    one, else the system's (``Permission denied``); a path in exitlm's cache gets a hint
    about ``EXITLM_CACHE``."""
    path = Path(path)
    blocker = file_ancestor(path)
    reason = (f"{blocker} is a file, expected a directory" if blocker is not None
              else err.strerror or str(err))
    hint = None
    root = cache_root().absolute()
    if path.absolute() == root or root in path.absolute().parents:
        hint = (f"exitlm's cache is {root} (EXITLM_CACHE, default ~/.cache/exitlm); set "
                "EXITLM_CACHE to a directory exitlm can write")
    return PathError(f"{what + ' ' if what else ''}{path}: cannot create it ({reason})",
                     hint=hint)


@contextlib.contextmanager
def creating(path: Path | str, what: str = "") -> Iterator[None]:
    """Run the block that creates ``path`` (its folders, a temporary beside it); an
    ``OSError`` in it becomes :func:`cannot_create`'s one-line :class:`PathError`."""
    try:
        yield
    except PathError:
        raise
    except OSError as err:
        raise cannot_create(path, err, what) from None


def ensure_dir(path: Path | str, what: str = "") -> Path:
    """Create the folder ``path`` and its parents (there already is fine); returns it. A
    folder that cannot be created is a :class:`PathError` (:func:`creating`)."""
    path = Path(path)
    with creating(path, what):
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_creatable(path: Path | str, what: str = "", *, beside: bool = False) -> Path:
    """Check, before slow work, that the folder ``path`` can be created (or is one already)
    without creating it: the nearest folder that exists on the way to it must let a folder be
    made in it (a probe folder, removed at once; nothing is left behind when a later step
    fails). ``beside``: the writer creates ``path`` beside itself (a temporary in its parent
    that replaces it, :func:`exitlm.io.st.atomic_dir`), so the probe starts at the parent.
    Refused, as :func:`ensure_dir` would refuse it later: a file in the way, a read-only or
    special file system (``/proc``, ``/sys``). Returns ``path``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise PathError(f"{what + ' ' if what else ''}{path}: cannot create it ({path} is a "
                        "file, expected a directory)")
    way = [*([] if beside else [path.absolute()]), *path.absolute().parents]
    anchor = next((p for p in way if p.exists()), None)
    if anchor is None:
        return path
    with creating(path, what):
        if not anchor.is_dir():
            raise NotADirectoryError(f"{anchor} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=temp_prefix(path.name or "dir", "tmp"), dir=anchor))
    return path


def check_cache_root() -> Path:
    """:func:`~exitlm.paths.cache_root`, which must be a directory when it exists (a
    :class:`PathError` otherwise: a file where the cache should be)."""
    root = cache_root()
    if root.exists() and not root.is_dir():
        raise PathError(f"{root}: exitlm's cache root is not a directory",
                        hint="set EXITLM_CACHE to a directory (default ~/.cache/exitlm)")
    return root


__all__ = ["PathError", "cannot_create", "check_cache_root", "check_creatable", "creating",
           "ensure_dir"]
