"""Multi-exit training losses: EE-LLM's weighted sum (Eq. 1) and LayerSkip's early-exit loss
(Eq. 5-6).

Both objectives have the same form, ``L = sum_i w_i(t) CE(exit_i(x), y)``; they differ in
where the weights come from. :class:`LossConfig` turns a step into a ``{layer: weight}`` map
and :func:`multi_exit_loss` runs the model once, computing logits only for exits whose weight
is non-zero (disabled exits pay no LM-head cost) and stopping the forward after the deepest
such exit (exit tuning never runs the layers after its last exit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from exitlm.config import ConfigError, ModelConfig
from exitlm.model.transformer import EarlyExitLM, default_positions
from exitlm.schema import NonNegativeFloat, NonNegativeInt, PositiveInt, UnitFloat, check
from exitlm.train.schedules import (
    Curriculum,
    ScheduleKind,
    ScheduleStyle,
    WeightSchedule,
    curriculum_mask,
    normalized_scales,
)

IGNORE_INDEX = -100


def lm_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over labels that are not ``ignore_index`` (fp32 math).

    ``logits`` ``(B, T, V)`` and ``labels`` ``(B, T)`` are already aligned (labels are the
    inputs shifted by one). Returns 0 (with a gradient path) when every label is ignored.
    ``count`` replaces the number of labels as the divisor: a token slice of a sequence
    (TeraPipe) divides by the whole microbatch's count, so slice losses add up to its mean.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
    lab = labels.reshape(-1)
    total = F.cross_entropy(flat, lab, ignore_index=ignore_index, reduction="sum")
    if count is None:
        count = (lab != ignore_index).sum().clamp_min(1)
    return total / count


@dataclass
class ExitLosses:
    """The objective of one batch and its parts."""

    total: torch.Tensor
    """``sum_i w_i L_i`` - call ``backward`` on this."""
    per_exit: dict[int, torch.Tensor] = field(default_factory=dict)
    """Detached mean cross-entropy of every computed exit, keyed by 1-based layer (the
    cross-entropy even when ``distill`` mixes a KL term into ``total``)."""
    weights: dict[int, float] = field(default_factory=dict)


def multi_exit_loss(
    model: EarlyExitLM,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    weights: Mapping[int, float],
    *,
    active: Sequence[torch.Tensor | None] | None = None,
    positions: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    distill: float = 0.0,
) -> ExitLosses:
    """``L = sum_i w_i L_i^exit`` (EE-LLM Eq. 1; LayerSkip Eq. 5 with ``w = ẽ(t, ·)``).

    Args:
        weights: 1-based exit layer -> weight; ``num_layers`` is the final output. Exits with
            weight 0 are not computed; the forward stops after the deepest weighted exit.
        active: per-layer kept rows for LayerSkip layer dropout (one entry per layer).
        distill: self-distillation share ``a`` (:attr:`LossConfig.distill`): every exit
            before the final layer is trained on ``(1 - a) CE(exit, y) + a KL(final || exit)``
            with the final output, detached, as the teacher; the final output keeps its
            cross-entropy. The forward then always runs to the final layer, and every
            weighted exit's logits stay alive until the final output is computed.
    """
    num_layers = model.num_layers
    want = sorted(k for k, w in weights.items() if w != 0.0)
    if not want:
        raise ConfigError("every exit loss weight is 0 at this step; nothing to train")
    for k in want:
        if not 1 <= k <= num_layers:
            raise ConfigError(f"loss weight given for layer {k}, outside [1, {num_layers}]")
    if positions is None:
        positions = default_positions(tokens)
    ctx = model.context(positions)
    h0 = model.embed(tokens, positions)
    total = torch.zeros((), device=h0.device, dtype=torch.float32)
    per_exit: dict[int, torch.Tensor] = {}
    students: dict[int, torch.Tensor] = {}  # exit -> logits, kept for the KL term
    stop = num_layers if distill > 0 else want[-1]
    visit = sorted({*want, stop})
    for k, h in model.walk(h0, 0, stop, visit, ctx=ctx, active=active):
        logits = model.exit_logits(h, k, ctx=ctx)
        w = float(weights.get(k, 0.0))
        if w != 0.0:
            loss = lm_cross_entropy(logits, labels, ignore_index)
            per_exit[k] = loss.detach()
            if distill > 0 and k < num_layers:
                students[k] = logits
                loss = (1.0 - distill) * loss
            total = total + w * loss
        if k == num_layers and students:  # the final output teaches every weighted exit
            teacher = F.log_softmax(logits.detach().float(), dim=-1)
            for j, s_logits in students.items():
                total = total + float(weights[j]) * distill * exit_kl(
                    teacher, s_logits, labels, ignore_index)
    return ExitLosses(total, per_exit, {k: float(weights[k]) for k in want})


def exit_kl(
    teacher_logp: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean ``KL(p_teacher || p_student)`` over the positions whose label is not ignored.

    Self-distillation of an exit towards the final layer: lossless self-speculation accepts a
    draft exactly when the exit's greedy token is the final layer's (LayerSkip Sec. 4), so an
    exit trained on the final layer's distribution agrees with it more often than one trained
    on the data alone. ``teacher_logp`` is the final output's log-softmax, without gradient.
    """
    student = F.log_softmax(student_logits.float(), dim=-1)
    per_pos = (teacher_logp.exp() * (teacher_logp - student)).sum(-1)  # (B, T)
    keep = labels != ignore_index
    return (per_pos * keep).sum() / keep.sum().clamp_min(1)


class LossModule(nn.Module):
    """``multi_exit_loss`` as a module's ``forward``, so DDP/FSDP wrappers see the call.

    Returns ``(total, per_exit)`` (a tuple, which every wrapper knows how to traverse).
    """

    def __init__(self, model: EarlyExitLM, distill: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.distill = distill

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        weights: Mapping[int, float],
        active: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        res = multi_exit_loss(self.model, tokens, labels, weights, active=active,
                              distill=self.distill)
        return res.total, res.per_exit


# ----- where the weights come from -----------------------------------------------------------

@dataclass(frozen=True)
class LossConfig:
    """The training objective.

    ``kind="ee-llm"`` (EE-LLM Eq. 1, App. C.1): one weight per configured exit layer
    (``exit_weights``, same order as ``exits.layers``; a single number is broadcast) plus
    ``final_weight`` for the final output. ``weight_schedule`` moves every exit weight from
    ``exit_weights_initial`` to ``exit_weights`` over ``weight_steps`` steps (``warmup`` /
    ``cooldown``, ``weight_style`` linear or cosine).

    ``kind="layerskip"`` (LayerSkip Eq. 5-6): weights ``ẽ(t, l)`` from the scale ``e(l)``
    (``e_scale``) and the curriculum ``C(t, l)`` (``none``, ``rotational`` every ``rotation``
    layers, or ``gradual``) over every exit the model has plus the final layer.

    ``kind="final"``: plain language-model training (the final output only).

    ``distill`` (0 to 1, default 0) moves that share of every early exit's loss from the
    data to the final layer: ``(1 - distill) CE(exit, y) + distill KL(final || exit)``, the
    final output detached as the teacher (self-distillation; not in either paper). Exits then
    agree with the final layer more often, which is what lossless self-speculation and early
    exit at a threshold are paid for (:func:`exit_kl`).
    """

    kind: Literal["final", "ee-llm", "layerskip"] = "final"
    exit_weights: tuple[NonNegativeFloat, ...] = (1.0,)
    final_weight: NonNegativeFloat = 1.0
    weight_schedule: ScheduleKind = "constant"
    exit_weights_initial: tuple[NonNegativeFloat, ...] | None = None
    weight_steps: NonNegativeInt = 0
    weight_style: ScheduleStyle = "linear"
    e_scale: UnitFloat = 1.0
    curriculum: Curriculum = "none"
    rotation: PositiveInt = 2
    distill: UnitFloat = 0.0
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self) -> None:
        check(self, "loss")
        if not self.exit_weights:
            raise ConfigError("loss.exit_weights: expected a number or a list of numbers >= 0, "
                              "got []")
        if self.kind == "layerskip":
            curriculum_mask(self.curriculum, 0, 1, rotation=self.rotation)
        if self.distill > 0 and self.kind == "final":
            raise ConfigError(f"loss.distill={self.distill} trains early exits towards the "
                              "final layer; loss.kind=final has none (use layerskip or ee-llm)")

    def schedules(self, cfg: ModelConfig) -> dict[int, WeightSchedule]:
        """One :class:`WeightSchedule` per configured exit layer (EE-LLM App. C.1)."""
        layers = cfg.exits.layers
        targets = _per_exit(self.exit_weights, layers, "loss.exit_weights")
        if self.exit_weights_initial is None:
            if self.weight_schedule == "cooldown":
                raise ConfigError("a cooldown schedule needs loss.exit_weights_initial "
                                  "(the weights it starts from)")
            initial = [0.0] * len(layers)
        else:
            initial = _per_exit(self.exit_weights_initial, layers, "loss.exit_weights_initial")
        return {
            k: WeightSchedule(self.weight_schedule, t, i, self.weight_steps, self.weight_style)
            for k, t, i in zip(layers, targets, initial, strict=True)
        }

    def validate(self, cfg: ModelConfig, total_steps: int) -> None:
        """Raise :class:`ConfigError` if this objective does not fit the model."""
        if self.kind == "ee-llm":
            if not cfg.exits.layers:
                raise ConfigError("loss.kind=ee-llm needs exits: set model.exits.layers")
            self.schedules(cfg)
        elif self.kind == "layerskip" and not cfg.exit_layers:
            raise ConfigError("loss.kind=layerskip needs exits: set model.exits.every_layer=true "
                              "(LayerSkip) or model.exits.layers")
        if total_steps < 1:
            raise ConfigError(f"train.steps must be >= 1, got {total_steps}")
        if self.kind == "ee-llm":
            # the weights move monotonically from exit_weights_initial to exit_weights, so a
            # step with nothing to train is the first or the last
            for step in (0, total_steps - 1):
                if not any(w != 0.0 for w in self.weights_at(step, cfg, total_steps).values()):
                    raise ConfigError(
                        f"loss: every weight is 0 at step {step} (loss.final_weight="
                        f"{self.final_weight:g}, loss.exit_weights"
                        f"{'_initial' if step == 0 and self.weight_schedule == 'warmup' else ''}"
                        " all 0): that step has nothing to train",
                        hint="give loss.final_weight or an exit weight a value > 0 (a warm-up "
                             "from 0 needs loss.final_weight > 0)")

    def weights_at(self, step: int, cfg: ModelConfig, total_steps: int) -> dict[int, float]:
        """``{layer: w}`` at training step ``step`` (the final output is ``cfg.num_layers``)."""
        L = cfg.num_layers
        if self.kind == "final":
            return {L: 1.0}
        if self.kind == "ee-llm":
            out = {k: s(step) for k, s in self.schedules(cfg).items()}
            out[L] = float(self.final_weight)
            return out
        layers = [*cfg.exit_layers, L]
        mask = curriculum_mask(self.curriculum, step, len(layers), rotation=self.rotation,
                               total_steps=total_steps)
        return normalized_scales(layers, L, self.e_scale, mask)


def _per_exit(values: tuple[float, ...], layers: tuple[int, ...], key: str) -> list[float]:
    if len(values) == 1:
        return [values[0]] * len(layers)
    if len(values) != len(layers):
        raise ConfigError(
            f"{key} has {len(values)} values but the model has {len(layers)} exits "
            f"(exits.layers={list(layers)}); give one weight per exit or a single number"
        )
    return list(values)
