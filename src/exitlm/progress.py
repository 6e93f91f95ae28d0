"""Progress of a slow step: a tqdm bar on a terminal, one line at its start and one at its end
on a pipe or file (so logs show what ran and how long it took).

    with progress("generating", total=len(items), unit="problem") as bar:
        for item in items:
            ...
            bar.update(1)

    with phase("indexing lm-eval tasks"):   # a step with no count: elapsed time on a terminal
        ...

Everything goes to stderr, prefixed ``exitlm:`` on a pipe; stdout stays the command's result.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class _Lines:
    """The pipe form of a bar: counts silently; the caller prints the two lines."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        """Accepted for tqdm compatibility; shown only on a terminal."""


def _count(n: int, unit: str) -> str:
    """``"1 batch"``, ``"3 batches"``, ``"2 programs"``."""
    if n == 1:
        return f"{n} {unit}"
    return f"{n} {unit}{'es' if unit.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


@contextmanager
def progress(desc: str, total: int | None = None, unit: str = "it",
             stream: TextIO | None = None) -> Iterator[Any]:
    """A bar with ``update(n)``: tqdm on a terminal, a start and an end line otherwise."""
    stream = stream or sys.stderr
    t0 = time.monotonic()
    if _is_terminal(stream):
        from tqdm import tqdm  # lazy: only a terminal draws a bar

        with tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False,
                  dynamic_ncols=True) as bar:
            yield bar
        n = bar.n
    else:
        size = f" ({_count(total, unit)})" if total is not None else ""
        print(f"exitlm: {desc}{size}...", file=stream, flush=True)
        bar = _Lines()
        yield bar
        n = bar.n
    done = f"{_count(n, unit)} in " if total is not None else ""
    print(f"exitlm: {desc}: done, {done}{time.monotonic() - t0:.1f} s", file=stream, flush=True)


@contextmanager
def phase(desc: str, stream: TextIO | None = None) -> Iterator[None]:
    """A step with no count: elapsed seconds ticking on a terminal, two lines on a pipe."""
    stream = stream or sys.stderr
    t0 = time.monotonic()
    stop = threading.Event()
    ticker = None
    if _is_terminal(stream):
        def tick() -> None:
            while not stop.wait(0.5):
                print(f"\rexitlm: {desc}... {time.monotonic() - t0:.0f} s", end="",
                      file=stream, flush=True)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
    print(f"exitlm: {desc}...", file=stream, end="" if ticker else "\n", flush=True)
    try:
        yield
    finally:
        stop.set()
        if ticker:
            ticker.join()
            print("\r", end="", file=stream)
        print(f"exitlm: {desc}: done in {time.monotonic() - t0:.1f} s", file=stream, flush=True)
