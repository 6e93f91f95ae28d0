"""The README's quickstart commands, as the tests read them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_commands() -> list[str]:
    """The bash blocks of the README's Quickstart section, in order, stripped."""
    quick = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```(?:bash|sh)\n(.*?)```", quick, re.S)]
