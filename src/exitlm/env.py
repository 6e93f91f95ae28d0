"""Switches read from the environment: one spelling of "off" for every ``EXITLM_*`` flag."""

from __future__ import annotations

import os

from exitlm.errors import warn

OFF = ("0", "false", "no", "off")
"""What turns a switch off (any case, surrounding spaces ignored)."""
ON = ("1", "true", "yes", "on", "")
"""What leaves a switch on, like leaving it unset (any case, surrounding spaces ignored)."""

_warned: set[tuple[str, str]] = set()
"""The (variable, value) pairs already warned about: each is reported once per process."""


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` says off (:data:`OFF`); unset means on. Any
    other spelling than :data:`OFF` or :data:`ON` leaves the switch on, with a warning (once
    per variable and value) naming the variable, the value and the accepted spellings."""
    raw = os.environ.get(name, "1")
    value = raw.strip().lower()
    if value in OFF:
        return True
    if value not in ON and (name, raw) not in _warned:
        _warned.add((name, raw))
        warn(f"{name}={raw!r}: expected one of {', '.join(x for x in ON if x)} (on) or "
             f"{', '.join(OFF)} (off); leaving it on")
    return False


DEBUG = "EXITLM_DEBUG"
"""Set (to any value) by ``exitlm --debug`` for the command and the processes it starts, or by
the user: tracebacks and the details of lower layers stay."""


def debug() -> bool:
    """Whether :data:`DEBUG` is set (any value: the command line reads it so)."""
    return bool(os.environ.get(DEBUG))


__all__ = ["DEBUG", "OFF", "ON", "debug", "switched_off"]
