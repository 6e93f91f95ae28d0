"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, which puts
this folder on ``sys.path``): progress notes on stderr and nearest-rank percentiles."""

from __future__ import annotations

import sys


def note(msg: str) -> None:
    """A progress line on stderr (stdout carries only the JSON result)."""
    print(msg, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (0.0 for no samples)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]
