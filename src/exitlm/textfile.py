"""Reading a text file the user named (a prompts file, a chat template, a checkpoint's
tokenizer files) within a byte limit.

``Path.read_text`` trusts the file: ``/dev/zero`` or a FIFO never ends (their size reads as 0,
so a check of ``stat().st_size`` passes), and a 2 GB "template" costs gigabytes. Here only
regular files are read, at most ``limit + 1`` bytes of them, and every refusal is one
:class:`~exitlm.errors.ExitlmError` line naming the file and what was expected.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from exitlm.errors import ExitlmError

MIB = 2**20

MAX_PROMPTS_BYTES = 64 * MIB
"""The largest prompts file (``--prompts-file``, ``exitlm bench --prompts``) read."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def describe_size(nbytes: int) -> str:
    """``64 MiB`` / ``1,000 bytes``: a limit as messages print it."""
    return f"{nbytes // MIB} MiB" if nbytes >= MIB and nbytes % MIB == 0 else f"{nbytes:,} bytes"


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_text_file(path: str | Path, limit: int, *, label: str | None = None,
                   expected: str = "a text file", errors: str = "strict") -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes of it.

    Args:
        path: the file.
        limit: the most bytes accepted; a larger file is refused without reading past
            ``limit + 1`` bytes.
        label: how messages name the file (e.g. ``"--prompts-file p.txt"``); the path when
            ``None``.
        expected: what the file should be, for messages ("a Jinja template").
        errors: how undecodable bytes are handled (``bytes.decode``'s argument).

    Raises:
        ExitlmError: the file is missing or unreadable, not a regular file (a device, a
            FIFO, a directory), larger than ``limit`` or not UTF-8 text.
    """
    name = label or str(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ExitlmError(f"{name}: cannot read it ({err.strerror or err}); expected "
                          f"{expected}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ExitlmError(f"{name}: {_kind(mode)}, not a regular file; expected {expected}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise ExitlmError(f"{name}: cannot read it ({err.strerror or err})") from None
    if len(data) > limit:
        raise ExitlmError(f"{name}: larger than {describe_size(limit)}, the limit for "
                          f"{expected}")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ExitlmError(f"{name}: not UTF-8 text (byte {err.start}); expected "
                          f"{expected}") from None
