"""Plain-text tables (``exitlm.table``): numbers without float noise, aligned columns."""

from __future__ import annotations

import math

from exitlm.table import number, render


def test_number_has_no_float_noise() -> None:
    assert number(0.1 + 0.2) == "0.300"
    assert number(1234.5678) == "1,235" and number(12.3456) == "12.3"
    assert number(0.000123456) == "0.000123" and number(0) == "0"
    assert number(-2.5) == "-2.50"
    assert number(math.inf) == number(math.nan) == number(None) == "-"


def test_render_aligns_numbers_right_and_text_left() -> None:
    lines = render(["name", "ms"], [["a", "1.5"], ["long name", "-"], ["b", "12,345"]]
                   ).splitlines()
    assert lines[0] == "name           ms"
    assert lines[1] == "---------  ------"
    assert lines[2] == "a             1.5"
    assert lines[3] == "long name       -"
    assert len({len(ln) for ln in lines}) == 1
