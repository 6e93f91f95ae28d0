"""Meeting the other ranks: a bounded, quiet rendezvous and its one-line errors.

Two things torch's rendezvous does not do for a command line:

* **Bound every wait.** A rank that connects to ``MASTER_ADDR:MASTER_PORT`` while another
  program listens there (the port was taken before rank 0 could bind it) gets a connection
  that never answers c10d's handshake, and waits for that answer forever, whatever the
  group's timeout. :func:`bounded` runs the rendezvous on a helper thread and gives up after
  a deadline derived from the timeout (the thread, stuck in C++, is left behind: the process
  is about to end with the error).
* **Keep c10d's logs off the terminal.** While it retries, c10d logs every failed connection
  with ~40 lines of C++ stack frames before the error exitlm turns into one line.
  :func:`quiet_c10d` sends file descriptor 2 to a temporary file during the call and writes
  back what was not c10d's retry noise (everything with ``EXITLM_DEBUG`` /
  ``exitlm --debug``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from exitlm.comm.health import ParallelError
from exitlm.env import debug

T = TypeVar("T")

GRACE_S = 10.0
"""Added to twice the timeout for :func:`bounded`'s deadline: torch bounds connecting to the
store and then joining the group each by the timeout; this only catches what it does not."""

_NOISE = re.compile(r"^(\[[WE]\d{4} [^\]]*\] \[c10d\]|Exception raised from |frame #\d+: |"
                    r"<omitting python frames>\s*$|\s*$)")
"""Lines of c10d's connection logs: its ``[W...]``/``[E...]`` lines, their C++ frames."""


def deadline_s(timeout_s: float) -> float:
    """How long :func:`bounded` lets a rendezvous with ``timeout_s`` take."""
    return 2 * timeout_s + GRACE_S


@contextlib.contextmanager
def quiet_c10d() -> Iterator[None]:
    """Capture what is written to file descriptor 2 inside the block (C++ logs included);
    afterwards write back every line that is not c10d's connection noise (:data:`_NOISE`),
    or all of it under :func:`debug`."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            keep = text if debug() else "".join(
                ln for ln in text.splitlines(keepends=True) if not _NOISE.match(ln))
            if keep:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(keep)
                    sys.stderr.flush()


def bounded(call: Callable[[], T], seconds: float, on_timeout: Callable[[], BaseException],
            name: str = "exitlm-rendezvous") -> T:
    """``call()``, or ``on_timeout()`` raised when it has not returned within ``seconds``
    (``call`` runs on a daemon thread, which is abandoned then)."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as err:  # handed to the caller below
            errors.append(err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise on_timeout()
    if errors:
        raise errors[0]
    return box[0]


def rendezvous_failed(err: Exception, rank: int, world: int, where: str,
                      waited_s: float) -> ParallelError:
    """The error of a rank that could not join its group at the store ``where``."""
    detail = " ".join(str(err).split())[:200]
    return ParallelError(
        f"rank {rank} of {world} could not meet the other ranks at the rendezvous store "
        f"{where} within {waited_s:g} s: another rank stopped or failed during start-up "
        f"({type(err).__name__}: {detail})",
        hint="look for the first error of the other ranks; rerun the whole job")


def store_unanswered(rank: int, world: int, where: str, waited_s: float,
                     setting: str) -> ParallelError:
    """The error of a rank whose store connection never answered (see :func:`bounded`)."""
    return ParallelError(
        f"rank {rank} of {world} got no answer from the rendezvous store at "
        f"MASTER_ADDR:MASTER_PORT={where} within {waited_s:g} s (2 x {setting} + "
        f"{GRACE_S:g} s): expected rank 0's torch.distributed store there, but the program "
        "listening on that port does not answer like one (another program uses the port, or "
        "rank 0 is stopped)",
        hint="choose a MASTER_PORT no other program uses (torchrun --master-port) and rerun "
             "every rank")
