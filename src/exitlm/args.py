"""Argument types shared by every command's parser: one-line errors naming what is expected
(the commands of :mod:`exitlm.cli` and the benchmark scripts use them)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (a one-line error otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}"
                                             ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def finite_float(text: str) -> float:
    """An argparse ``type``: a finite number (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers (``"2,4,6"``)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
