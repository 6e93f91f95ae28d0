"""Where exitlm keeps what it computes once, and how it writes a file so that no reader ever
sees half of one: one answer for every package that caches or saves.

A file is written under a temporary name beside its target (``.NAME.tmp-PID-XXXX``) and renamed
over the target in one ``os.replace`` (:func:`atomic_file`, :func:`write_text_atomic`); a
temporary that a killed writer left is removed by the next writer of the same target
(:func:`remove_stale_temps`). Folders are replaced the same way by :func:`exitlm.io.st.atomic_dir`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """``$EXITLM_CACHE`` (``~`` expanded) or ``~/.cache/exitlm``: converted models, token
    orders, tokenized corpora, benchmark files, the kernels' developer builds and runners'
    primitive timings (:mod:`exitlm.runtime.cost_store`)."""
    env = os.environ.get("EXITLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exitlm"


def file_ancestor(path: Path | str) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a directory (a regular file
    where a folder should be), else ``None``."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (``True`` when unsure)."""
    if pid == os.getpid() or os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def temp_prefix(name: str, kind: str) -> str:
    """The start of a temporary's name beside target ``name``: ``.NAME.KIND-PID-`` (``kind`` is
    ``tmp`` for a replacement being written, ``old`` for a previous version moved aside)."""
    return f".{name}.{kind}-{os.getpid()}-"


def remove_path(path: Path) -> None:
    """Delete a file or a directory tree (not following a symlink); gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


_TEMP = re.compile(r"\.(?P<target>.+?)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[A-Za-z0-9_]+"
                   r"(?:\.[A-Za-z0-9]+)?")


def temp_target(name: str) -> tuple[str, str, int] | None:
    """``(target name, kind, writer's pid)`` when ``name`` is a temporary of an atomic write
    (``.NAME.tmp-PID-XXXX[.SUFFIX]``, ``.NAME.old-PID-XXXX``), else None."""
    m = _TEMP.fullmatch(name)
    return None if m is None else (m.group("target"), m.group("kind"), int(m.group("pid")))


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove what a killed writer left beside ``target``: ``.NAME.tmp-PID-*`` (a half-written
    replacement) and ``.NAME.old-PID-*`` (a moved-aside previous version, put back when
    ``target`` itself is missing) of processes that no longer run. Returns what was removed."""
    removed: list[Path] = []
    parent = target.parent
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.iterdir()):
        temp = temp_target(entry.name)
        if temp is None or temp[0] != target.name or pid_alive(temp[2]):
            continue
        if temp[1] == "old" and (entry / "d").is_dir() and not target.exists():
            os.replace(entry / "d", target)  # the previous version was never replaced
        remove_path(entry)
        removed.append(entry)
    return removed


@contextlib.contextmanager
def atomic_file(target: Path | str, *, mode: int = 0o644) -> Iterator[Path]:
    """Yield a new empty file beside ``target`` to write; when the block ends without error it
    replaces ``target`` in one ``os.replace`` (a reader sees the old file or the whole new one),
    and on error it is deleted and ``target`` is untouched.

    The temporary's name ends with ``target``'s suffix, for writers that choose a format by it
    (matplotlib, a compiler's ``-o``); its permissions are ``mode``. Temporaries that killed
    writers of the same target left are removed first. ``target``'s folder must exist.
    """
    target = Path(target)
    remove_stale_temps(target)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(target.name, "tmp"), suffix=target.suffix,
                                dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, mode)
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # gone after a successful replace


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


__all__ = ["atomic_file", "cache_root", "file_ancestor", "pid_alive", "remove_path",
           "remove_stale_temps", "temp_prefix", "temp_target", "write_text_atomic"]
