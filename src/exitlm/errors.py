"""One base class for every error a user can cause, and one style of warning.

:class:`ExitlmError` is what exitlm raises for bad input: a config value, a checkpoint file, a
command-line argument, an output directory, a chat template. Its message names the file, key
or value and says what was expected; ``hint`` optionally says what to do next. The ``exitlm``
command prints such an error as one line (plus the hint) and exits with status 2; anything
else is a bug and keeps its traceback. The older names (``ConfigError``, ``CheckpointError``,
``PlanError``, ``PipelineError``, ``GGUFTokenizerError``) are subclasses, so existing
``except`` clauses keep working.

Warnings go through :mod:`warnings` with the category :class:`ExitlmWarning` (libraries can
filter them); the command line prints them as ``exitlm: warning: ...``.
"""

from __future__ import annotations

import warnings


class ExitlmError(Exception):
    """A problem with the user's input; the message says which input and what is expected.

    Args:
        message: one line naming the file / key / value and the expectation.
        hint: an optional second line: what to change or run instead.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ConfigError(ExitlmError, ValueError):
    """A configuration value is invalid; the message names the setting to change.

    (Also importable as ``exitlm.config.ConfigError``; a ``ValueError`` for older callers.)
    """


class ExitlmWarning(UserWarning):
    """Something exitlm tolerated but the user should know about (e.g. non-finite weights)."""


def warn(message: str) -> None:
    """Issue an :class:`ExitlmWarning` (shown once per message and call site)."""
    warnings.warn(message, ExitlmWarning, stacklevel=2)


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about untrusted values."""
    try:
        text = repr(value)
    except Exception:  # a repr that fails (e.g. an int too long to print)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
