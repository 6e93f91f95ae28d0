"""A spawned worker's tie to the process that started it: it ends when that process dies.

exitlm's worker processes (tensor-parallel ranks and pipeline stages from
:func:`~exitlm.comm.launch.start_workers`, PPD's branch worker) are spawned by the process that
runs the command, which stops them when the job ends or fails. When that process is killed
(``SIGKILL``: nothing of it runs again) a worker must end by itself, and promptly: one waiting
at the rendezvous would otherwise wait out its deadline (minutes), a follower for its next
command without any. :func:`watch_parent` starts a daemon thread that waits on
multiprocessing's parent sentinel (a pipe whose other end only the parent holds: it reads as
end-of-file the moment the parent is gone, however it ended) and then ends this process with
:func:`leave_orphaned`.

Before it goes, a worker removes what its dead parent created for it and can no longer remove:
the parent's multiprocessing temporary directory (``pymp-*``: handing file descriptors to a
running worker - shared-memory tensors - goes through a socket there). The parent names it
(:func:`parent_tempdir`) and the worker keeps the name (:func:`adopt_tempdir`); nothing else
is ever removed, and nothing while the parent lives.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.util
import os
import shutil
import threading
import time
from multiprocessing.connection import wait

ORPHAN_EXIT = 1
"""The exit status of a worker that ended because its parent died (nobody reads it)."""
_POLL_S = 0.5
"""How long the watch looks at the parent's process id between its checks (after the
sentinel fired, or where it cannot be used)."""
EOF_GRACE_S = 2.0
"""How long a worker that read end-of-file from its parent looks for it to be gone (see
:func:`leave_orphaned`): the pipe closes only when the parent is dead or stopping it."""

_adopted: list[str] = []
"""The dead-parent-only temporary directories of this process (see :func:`adopt_tempdir`)."""


def parent_tempdir() -> str:
    """This process's multiprocessing temporary directory (created now if it has none), for a
    worker to remove should this process die before it (:func:`adopt_tempdir`)."""
    return str(multiprocessing.util.get_temp_dir())


def adopt_tempdir(path: str) -> None:
    """Remember ``path``, the parent's :func:`parent_tempdir`, to remove it if the parent
    dies first (only then: while it lives, it is the parent's)."""
    if path not in _adopted:
        _adopted.append(path)


def parent_alive() -> bool:
    """Whether the process that spawned this one still runs (``True`` when this process was
    not started by :mod:`multiprocessing`: there is nothing to watch)."""
    parent = multiprocessing.parent_process()
    return parent is None or os.getppid() == parent.pid


def leave_orphaned(grace_s: float = 0.0) -> None:
    """If the parent is dead: remove the temporary directories adopted from it and end this
    process at once (no clean-up of its own that could block or print); else return.

    A dying process's pipes and sockets close before its children are handed to another
    parent, so a worker that just read end-of-file from its parent may still see the old
    parent id: ``grace_s`` is how long to look again before deciding the parent lives."""
    deadline = time.monotonic() + grace_s
    while parent_alive():
        if time.monotonic() >= deadline:
            return
        time.sleep(0.02)
    for path in _adopted:
        if os.path.basename(path).startswith("pymp-"):
            shutil.rmtree(path, ignore_errors=True)
    os._exit(ORPHAN_EXIT)


def _watch() -> None:
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is not None:
        with contextlib.suppress(OSError, ValueError):
            wait([sentinel])
    while True:  # the sentinel fired (or cannot be used): make sure the parent is gone
        leave_orphaned(_POLL_S)


def watch_parent() -> None:
    """End this spawned worker as soon as its parent process is gone (see the module
    docstring); does nothing in a process :mod:`multiprocessing` did not start."""
    if multiprocessing.parent_process() is None:
        return
    threading.Thread(target=_watch, name="exitlm-lifeline", daemon=True).start()
