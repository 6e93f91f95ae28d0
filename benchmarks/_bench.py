"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, which puts
this folder on ``sys.path``): progress notes on stderr, nearest-rank percentiles, and bad
input reported in one line."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def note(msg: str) -> None:
    """A progress line on stderr (stdout carries only the JSON result)."""
    print(msg, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (0.0 for no samples)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@contextlib.contextmanager
def one_line_errors(script: str) -> Iterator[None]:
    """Bad input (an :class:`~exitlm.errors.ExitlmError`: an unknown model, a setting out of
    range) ends the script with one line on stderr and status 2, as the ``exitlm`` command
    does, instead of a traceback."""
    from exitlm.errors import ExitlmError

    try:
        yield
    except ExitlmError as err:
        print(f"{script}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
