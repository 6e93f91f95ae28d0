"""Argument types shared by every command's parser: one-line errors naming what is expected
(the commands of :mod:`exitlm.cli` and the benchmark scripts use them)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TypeVar

from exitlm.errors import ConfigError

T = TypeVar("T")


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (and <= ``high`` when given; a one-line
    error otherwise)."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    return parse


def max_threads() -> int:
    """The most CPU threads any ``--threads`` accepts: ``max(64, 8 x the CPU count)``. More
    never decodes faster, and each thread costs a stack: torch's and OpenMP's pools fail to
    start (an abort or a segfault) at tens of thousands."""
    return max(64, 8 * (os.cpu_count() or 1))


def check_threads(n: int, setting: str = "--threads") -> int:
    """``n`` if it is a usable thread count (1 to :func:`max_threads`), else a one-line
    :class:`~exitlm.errors.ConfigError` naming ``setting``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_threads():
        raise ConfigError(f"{setting}: expected an integer in [1, {max_threads()}] (at most "
                          f"8 threads per CPU), got {n!r}")
    return n


def thread_count(text: str) -> int:
    """An argparse ``type`` for every ``--threads`` flag: an integer in [1, :func:`max_threads`]."""
    return int_at_least(1, max_threads())(text)


def finite_float(text: str) -> float:
    """An argparse ``type``: a finite number (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (seconds of a deadline)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``low`` (a timeout with a useful minimum)."""
    def parse(text: str) -> float:
        value = finite_float(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a number >= {low:g}, got {text!r}")
        return value

    return parse


non_negative_float = float_at_least(0.0)
"""An argparse ``type``: a finite number >= 0 (seconds, a timeout)."""


def unit_float(text: str) -> float:
    """An argparse ``type``: a number in [0, 1] (a probability, a threshold)."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers (``"2,4,6"``)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def list_of(item: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """An argparse ``type``: comma-separated values, each parsed by ``item`` (an argparse
    type such as :func:`int_at_least` or :func:`unit_float`), at least one, repeats dropped
    (first occurrence kept); ``what`` names the values in the message of an empty list."""

    def parse(text: str) -> list[T]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        out: list[T] = []
        for part in parts:
            value = item(part)
            if value not in out:
                out.append(value)
        return out

    return parse


DRAFT_WEIGHTS = ("model", "int8", "int4")
"""What a recorded round's drafts may run on (:class:`~exitlm.config.DraftHint`)."""


def draft_round(text: str) -> tuple[int, int, str]:
    """An argparse ``type``: ``E,D[,W]``, a self-speculative round (draft exit ``E >= 1``,
    ``D`` drafts in [1, 64], drafts run on ``W``: ``model`` (default), ``int8`` or ``int4``, a
    quantized copy); whether ``E`` is one of a model's exits is checked against it."""
    parts = [p.strip() for p in text.split(",")]
    weights = parts.pop() if len(parts) == 3 else "model"
    try:
        e, d = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected E,D or E,D,W (a draft exit, drafts per round and optionally the "
            f"drafts' weights, e.g. 10,4 or 9,5,int8), got {text!r}"
        ) from None
    if e < 1 or not 1 <= d <= 64:
        raise argparse.ArgumentTypeError(
            f"expected E,D with E >= 1 and D in [1, 64], got {text!r}")
    if weights not in DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(
            f"expected the drafts' weights W of E,D,W to be one of {', '.join(DRAFT_WEIGHTS)}, "
            f"got {weights!r} in {text!r}")
    return e, d, weights
