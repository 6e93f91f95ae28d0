"""Schedules over training steps and layers: loss weights, loss scales, curricula, dropout rates.

Everything here is a pure function of integers and floats, so each equation can be unit-tested
against hand-computed values.

Layer numbering. exitlm counts exits from 1 (an exit at layer ``k`` reads the state after the
``k``-th layer, ``k = L`` is the final output). LayerSkip (Sec. 4.1) counts layers from 0: its
layer ``l`` produces ``x_{l+1}`` and its loss uses ``g(x_{l+1})``. So LayerSkip's ``l`` is our
exit layer ``k = l + 1``. The functions below taking ``l`` use the paper's 0-based index; the
loss code converts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from exitlm.config import ConfigError

ScheduleKind = Literal["constant", "warmup", "cooldown"]
ScheduleStyle = Literal["linear", "cosine"]
Curriculum = Literal["none", "rotational", "gradual"]


# ----- EE-LLM App. C.1: non-constant early-exit loss weights ----------------------------------

@dataclass(frozen=True)
class WeightSchedule:
    """One early-exit loss weight ``w_i(t)`` of EE-LLM Eq. 1 over training steps (App. C.1).

    ``constant`` keeps ``target``. ``warmup`` rises from ``initial`` to ``target`` over
    ``steps`` steps (``initial <= target``); ``cooldown`` falls from ``initial`` to ``target``
    (``initial >= target``). ``style`` shapes the transition: ``linear`` or ``cosine``
    (half-cosine ease, ``(1 - cos(pi * s)) / 2`` of the way at fraction ``s``). After ``steps``
    steps the weight stays at ``target``.
    """

    kind: ScheduleKind = "constant"
    target: float = 1.0
    initial: float = 0.0
    steps: int = 0
    style: ScheduleStyle = "linear"

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "warmup", "cooldown"):
            raise ConfigError(
                f"loss.weight_schedule must be constant, warmup or cooldown, got {self.kind!r}"
            )
        if self.style not in ("linear", "cosine"):
            raise ConfigError(f"loss.weight_style must be linear or cosine, got {self.style!r}")
        if self.target < 0 or self.initial < 0:
            raise ConfigError("exit loss weights must be >= 0 (loss.exit_weights, "
                              "loss.exit_weights_initial)")
        if self.kind != "constant":
            if self.steps <= 0:
                raise ConfigError(
                    f"a {self.kind} weight schedule needs loss.weight_steps > 0, got {self.steps}"
                )
            if self.kind == "warmup" and self.initial > self.target:
                raise ConfigError(
                    f"warm-up goes up: initial weight {self.initial} > target {self.target} "
                    "(use weight_schedule=cooldown or swap the values)"
                )
            if self.kind == "cooldown" and self.initial < self.target:
                raise ConfigError(
                    f"cool-down goes down: initial weight {self.initial} < target {self.target} "
                    "(use weight_schedule=warmup or swap the values)"
                )

    def __call__(self, step: int) -> float:
        if self.kind == "constant":
            return float(self.target)
        s = min(max(step, 0) / self.steps, 1.0)
        if self.style == "cosine":
            s = 0.5 * (1.0 - math.cos(math.pi * s))
        return float(self.initial + (self.target - self.initial) * s)


# ----- LayerSkip Sec. 4.1.2: early-exit loss scales and curricula -----------------------------

def layerskip_scale(l: int, num_layers: int, e_scale: float) -> float:
    """LayerSkip's per-layer loss scale ``e(l)`` (0-based ``l``, ``L`` layers), Sec. 4.1.2.

    ``e(l) = e_scale * sum_{i=0}^{l} i`` for ``l < L-1`` and
    ``e(L-1) = L - 1 + e_scale * sum_{i=0}^{L-2} i``. Note ``e(0) = 0``: the paper's scale
    gives no weight to the exit right after the first layer.
    """
    if not 0 <= l < num_layers:
        raise ValueError(f"layer index {l} outside [0, {num_layers - 1}]")
    if not 0.0 <= e_scale <= 1.0:
        raise ConfigError(f"loss.e_scale must lie in [0, 1] (LayerSkip Sec. 4.1.2), got {e_scale}")
    if l < num_layers - 1:
        return e_scale * l * (l + 1) / 2
    return (num_layers - 1) + e_scale * (num_layers - 2) * (num_layers - 1) / 2


def rotational_curriculum(t: int, position: int, count: int, rotation: int) -> bool:
    """``C_rot,R(t, l)`` (LayerSkip Sec. 4.1.2): every ``R``-th exit is enabled, rotating by one
    each iteration, so each exit is enabled once every ``R`` iterations.

    ``position`` indexes the candidate exits ``0..count-1`` (the layers themselves when every
    layer can exit); the last one (the final output) is always enabled.
    """
    if rotation < 1:
        raise ConfigError(f"loss.rotation (R) must be >= 1, got {rotation}")
    if position == count - 1:
        return True
    return (position - t) % rotation == 0


def gradual_curriculum(t: int, position: int, count: int, total_steps: int) -> bool:
    """``C_grad(t, l)`` (LayerSkip Sec. 4.1.2): exits are enabled from the last one down, one more
    every ``T / (2L)`` iterations, so all are enabled after ``T / 2`` iterations.

    Exit ``position`` (``0..count-1``, ``count - 1`` = final) is enabled once
    ``floor(t / (T / 2L)) = floor(2 L t / T) >= count - 1 - position``.
    """
    if total_steps < 1:
        raise ConfigError(f"the gradual curriculum needs total steps >= 1, got {total_steps}")
    opened = (2 * count * max(t, 0)) // total_steps
    return position >= count - 1 - opened


def curriculum_mask(
    kind: Curriculum, t: int, count: int, *, rotation: int = 1, total_steps: int = 1
) -> list[bool]:
    """``C(t, ·)`` over ``count`` candidate exits (the last is the final output)."""
    if kind == "none":
        return [True] * count
    if kind == "rotational":
        return [rotational_curriculum(t, j, count, rotation) for j in range(count)]
    if kind == "gradual":
        return [gradual_curriculum(t, j, count, total_steps) for j in range(count)]
    raise ConfigError(f"loss.curriculum must be none, rotational or gradual, got {kind!r}")


def normalized_scales(
    layers: Sequence[int], num_layers: int, e_scale: float, enabled: Sequence[bool]
) -> dict[int, float]:
    """``ẽ(t, l) = C(t, l) e(l) / sum_i C(t, i) e(i)`` (LayerSkip Eq. 6) over the given exit
    layers (1-based, the last must be ``num_layers``), with ``C(t, ·)`` given as ``enabled``.

    Only enabled exits appear in the result; they sum to 1.
    """
    if len(layers) != len(enabled):
        raise ValueError("one curriculum flag per exit layer is needed")
    if not layers or layers[-1] != num_layers:
        raise ValueError("the candidate exits must end with the final layer")
    raw = {
        k: layerskip_scale(k - 1, num_layers, e_scale)
        for k, on in zip(layers, enabled, strict=True)
        if on
    }
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items()}


# ----- LayerSkip Sec. 4.1.1: layer dropout rates -----------------------------------------------

def layer_scale(l: int, num_layers: int) -> float:
    """``D(l) = exp(l ln 2 / (L - 1)) - 1`` (LayerSkip Eq. 3): 0 at layer 0, 1 at layer L-1."""
    if not 0 <= l < num_layers:
        raise ValueError(f"layer index {l} outside [0, {num_layers - 1}]")
    if num_layers == 1:
        return 0.0
    return math.exp(l * math.log(2) / (num_layers - 1)) - 1.0


def time_scale(t: int, total_steps: int, curriculum: Literal["none", "exp"]) -> float:
    """``S(t)``: 1 without a curriculum, else ``S_exp(t) = exp(t ln 2 / (T - 1)) - 1``
    (LayerSkip Eq. 4), which rises from 0 at ``t = 0`` to 1 at ``t = T - 1``."""
    if curriculum == "none":
        return 1.0
    if curriculum != "exp":
        raise ConfigError(f"dropout.curriculum must be none or exp, got {curriculum!r}")
    if total_steps <= 1:
        return 1.0
    t = min(max(t, 0), total_steps - 1)
    return math.exp(t * math.log(2) / (total_steps - 1)) - 1.0


def dropout_rates(
    num_layers: int,
    p_max: float,
    t: int,
    total_steps: int,
    curriculum: Literal["none", "exp"] = "none",
) -> list[float]:
    """``p_{l,t} = S(t) D(l) p_max`` for every layer ``l = 0..L-1`` (LayerSkip Eq. 2)."""
    if not 0.0 <= p_max <= 1.0:
        raise ConfigError(f"dropout.p_max must lie in [0, 1], got {p_max}")
    s = time_scale(t, total_steps, curriculum)
    return [s * layer_scale(l, num_layers) * p_max for l in range(num_layers)]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``min_ratio * base_lr``."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    s = min(max(step - warmup, 0) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * s)))
