"""Non-finite losses and gradients: stop the run, or skip the step, and never save NaN weights.

A step whose loss or gradient norm is NaN/inf (a learning rate that is far too high, fp16
overflow, a corrupt batch) would write non-finite values into every weight it touches. The
check runs before the optimizer applies the update, on values every process agrees on (the
loss averaged over processes, the global gradient norm), so all processes take the same
decision. ``train.on_nonfinite=error`` (the default) stops the run with a one-line error;
``skip`` drops the update and goes on, but stops too after
:data:`MAX_SKIPPED_IN_A_ROW` skipped steps in a row. Saving refuses non-finite tensors as a
last line of defence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from exitlm.errors import ExitlmError, warn
from exitlm.io.st import all_finite

MAX_SKIPPED_IN_A_ROW = 100
_HINT = ("lower optim.lr, check the data or train.amp, or set train.on_nonfinite=skip to "
         "skip such steps")


class NonFiniteGuard:
    """Decides, step by step, whether an update may be applied (``train.on_nonfinite``)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.in_a_row = 0
        self.skipped = 0

    def allows(self, step: int, loss: float, grad_norm: float) -> bool:
        """``True``: apply the update of ``step`` (1-based). ``False``: skip it (``skip``).
        Raises :class:`ExitlmError` under ``error``, or after too many skips in a row."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        what = f"step {step}: the loss is {loss} and the gradient norm {grad_norm}"
        if self.policy != "skip":
            raise ExitlmError(f"{what}; the run stopped before applying the update (no "
                              "non-finite weights were saved)", hint=_HINT)
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise ExitlmError(f"{what}; {self.in_a_row} steps in a row had non-finite values, "
                              "so the run stopped", hint=_HINT)
        warn(f"{what}; update skipped (train.on_nonfinite=skip)")
        return False


def refuse_non_finite(tensors: Mapping[str, Any], what: str) -> None:
    """Raise :class:`ExitlmError` if any tensor of ``tensors`` holds NaN or inf."""
    bad = [name for name, t in tensors.items()
           if isinstance(t, torch.Tensor) and not all_finite(t.detach())]
    if bad:
        raise ExitlmError(f"refusing to save {what}: tensor(s) {bad[:4]} hold NaN or infinite "
                          "values", hint=_HINT)
