"""Plain-text tables for command output (``exitlm bench``, ``exitlm plan``): aligned columns,
numbers right-aligned, text left-aligned, no dependencies.

    print(render(["strategy", "tok/s"], [["ar", "12.3"], ["self-spec", "20.1"]]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def number(value: float | None, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits and no float noise (``0.1234``, ``12.3``,
    ``1,235``); ``-`` for ``None`` or a non-finite value."""
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def _numeric(cell: str) -> bool:
    if cell == "-":
        return True
    text = cell.rstrip("x%").replace(",", "").lstrip("+-")
    return text.replace(".", "", 1).isdigit()


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> str:
    """An aligned table: a header line, a rule, one line per row. Columns whose cells are all
    numbers (or ``-``) are right-aligned."""
    cols = len(headers)
    cells = [[str(c) for c in row] + [""] * (cols - len(row)) for row in rows]
    widths = [max([len(headers[i])] + [len(r[i]) for r in cells]) for i in range(cols)]
    right = [bool(cells) and all(_numeric(r[i]) for r in cells) for i in range(cols)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w)
                 for v, w, r in zip(values, widths, right, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(list(headers)), indent + "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)
