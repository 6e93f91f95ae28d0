"""Switches read from the environment: one spelling of "off" for every ``EXITLM_*`` flag."""

from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")
"""What turns a switch off (any case, surrounding spaces ignored)."""


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` says off (:data:`OFF`); unset means on."""
    return os.environ.get(name, "1").strip().lower() in OFF


__all__ = ["OFF", "switched_off"]
