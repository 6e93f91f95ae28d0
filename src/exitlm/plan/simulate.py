"""Simulated pipeline timelines from per-operation times (:mod:`exitlm.plan.events` runs them).

Schedules timed here:

* training: exactly the per-stage action lists ``exitlm train`` executes
  (:func:`exitlm.plan.schedule.build_schedule`: GPipe or 1F1B, EE-LLM's
  bubble filling of App. C.2.1, TeraPipe token slices), each action timed by EE-LLM's cost
  model with exits deferred (Fig. 3c, App. A.2) or not (Fig. 3b);
* TeraPipe token slices (TeraPipe Fig. 2, Sec. 3.2) optionally over batch splits (Sec. 3.4);
* EE-LLM's pipeline-based early-exit inference (EE-LLM Sec. 4, Fig. 5).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from exitlm.config import ConfigError
from exitlm.plan.cost_model import PipelineSpec, PlanError, stage_step_times
from exitlm.plan.events import Op, SimResult, simulate
from exitlm.plan.schedule import build_schedule

if TYPE_CHECKING:
    from exitlm.plan.schedule import PipelineSchedule

__all__ = ["Op", "SimResult", "inference_schedule", "simulate", "simulate_training",
           "terapipe_schedule", "training_ops", "training_schedule"]


# ----- training: GPipe / 1F1B with exits and bubble filling ---------------------------------

def _segments(spec: PipelineSpec, s: int, backward: bool) -> list[tuple[str, float]]:
    """Segments of the forward or backward step of one microbatch on 0-based stage ``s``."""
    p, n = spec.stages, spec.exits_per_stage[s]
    if not backward:
        seg = [("input", spec.IN.f)] if s == 0 else []
        seg.append(("backbone", spec.BB.f))
        if n and not spec.deferred_exits:
            seg.append(("exit", n * spec.EE.f))
        if s == p - 1:
            seg.append(("exit", spec.FE.f))
        return [x for x in seg if x[1] > 0]
    seg = [("exit", spec.FE.b)] if s == p - 1 else []
    if n and spec.deferred_exits:  # deferred exit forward runs inside the backward step
        seg.append(("exit@F", n * spec.EE.f))
    if n:
        seg.append(("exit", n * spec.EE.b))
    seg.append(("backbone", spec.BB.b))
    if s == 0:
        seg.append(("input", spec.IN.b))
    return [x for x in seg if x[1] > 0]


def training_ops(spec: PipelineSpec, sched: PipelineSchedule) -> list[list[Op]]:
    """The per-stage ops of one training iteration that executes ``sched`` - the action
    lists :class:`~exitlm.train.parallel.pipeline.engine.PipelineEngine` runs - timed by
    ``spec`` (EE-LLM Table 2 quantities; a token slice takes its share of a microbatch's
    time). Labels: regular microbatches ``1..M``, bubble-filling ones ``a1..`` (Part 1,
    warm-up) and ``z1..`` (Part 2, cool-down), ``.s`` for slice ``s``."""
    if sched.num_stages != spec.stages:
        raise PlanError(f"the schedule has {sched.num_stages} stages, the cost model "
                        f"{spec.stages}")
    names = _labels(sched)
    total = sum(sched.slices)
    out: list[list[Op]] = [[] for _ in range(sched.num_stages)]
    for k, actions in enumerate(sched.actions):
        for a in actions:
            route = sched.routes[a.mb]
            share = sched.slices[a.slice] / total
            segs = [(cat, d * share) for cat, d in _segments(spec, k, a.kind == "B")]
            if a.kind == "F":
                deps: list[Hashable] = [("F", a.mb, a.slice, k - 1)] if k > 0 else []
            else:
                deps = [("F", a.mb, a.slice, k)]
                if k < route.fwd_last:
                    deps.append(("B", a.mb, a.slice, k + 1))
            label = names[a.mb] + (f".{a.slice}" if a.slice else "")
            out[k].append(Op((a.kind, a.mb, a.slice, k), k, label, a.kind, segs, deps))
    return out


def _labels(sched: PipelineSchedule) -> list[str]:
    counts = {"regular": 0, "fill1": 0, "fill2": 0}
    prefix = {"regular": "", "fill1": "a", "fill2": "z"}
    out = []
    for r in sched.routes:
        counts[r.kind] += 1
        out.append(f"{prefix[r.kind]}{counts[r.kind]}")
    return out


def training_schedule(spec: PipelineSpec, schedule: str = "1f1b", fill: str = "none", *,
                      backward_forward_ratio: float | None = None,
                      fill_microbatches: int | None = None,
                      slices: Sequence[int] = (1,)) -> PipelineSchedule:
    """The schedule ``exitlm train`` would execute for ``spec``'s pipeline
    (:func:`exitlm.plan.schedule.build_schedule`): ``schedule`` ``1f1b`` or
    ``gpipe``; ``fill`` ``none`` / ``warmup`` (EE-LLM App. C.2.1 Part 1) / ``cooldown``
    (Part 2) / ``both``; the fill counts from the backward/forward ratio, by default the
    cost model's ``b / f`` of the slowest stage (as ``parallel.backward_forward_ratio``)."""

    if backward_forward_ratio is None:
        steps = stage_step_times(spec)
        f, b = max(x for x, _ in steps), max(y for _, y in steps)
        backward_forward_ratio = b / f if f > 0 and b > 0 else 1.0
    exit_stages = [i for i, n in enumerate(spec.exits_per_stage) if n]
    try:
        return build_schedule(schedule, spec.stages, spec.microbatches, tuple(slices),
                              fill=fill, exit_stages=exit_stages,
                              backward_forward_ratio=backward_forward_ratio,
                              fill_microbatches=fill_microbatches)
    except ConfigError as err:
        raise PlanError(str(err)) from err


def simulate_training(spec: PipelineSpec, schedule: str = "1f1b", fill: str = "none", *,
                      backward_forward_ratio: float | None = None,
                      fill_microbatches: int | None = None,
                      slices: Sequence[int] = (1,)) -> SimResult:
    """Simulate one training iteration of the schedule ``exitlm train`` executes (see
    :func:`training_schedule` for the arguments, :func:`training_ops` for the timing)."""
    sched = training_schedule(spec, schedule, fill,
                              backward_forward_ratio=backward_forward_ratio,
                              fill_microbatches=fill_microbatches, slices=slices)
    return simulate(training_ops(spec, sched))


# ----- TeraPipe token slices -----------------------------------------------------------------

def terapipe_schedule(slices: Sequence[int], stages: int,
                      t_fwd: Callable[[int, int], float],
                      t_bwd: Callable[[int, int], float] | None = None,
                      batch_splits: Sequence[int] = (1,)) -> list[list[Op]]:
    """Token-sliced pipeline of one sequence (TeraPipe Fig. 2d / Sec. 3.2), GPipe-style.

    Slice ``j`` of length ``l_j`` with context ``sum_{i<j} l_i`` takes ``t_fwd(l_j, ctx)`` on
    every stage and waits for the previous stage (its input) and, through the stage order,
    for the earlier slices (their keys/values). Backward runs the slices in reverse order:
    slice ``j``'s backward needs the gradients flowing into its keys/values from later
    slices. With ``batch_splits`` the same slicing is pipelined for each batch split (Sec.
    3.4); ``t_fwd`` then receives the split's batch size as a third argument.
    """
    if stages < 1:
        raise PlanError(f"stages must be >= 1, got {stages}")
    if any(int(x) < 1 for x in slices):
        raise PlanError(f"slice lengths must be >= 1, got {list(slices)}")
    multi = tuple(batch_splits) != (1,)

    def tf(fn: Callable[..., float], length: int, ctx: int, b: int) -> float:
        return float(fn(length, ctx, b) if multi else fn(length, ctx))

    units = []
    for d, b in enumerate(batch_splits):
        ctx = 0
        for j, length in enumerate(slices):
            units.append((d, j, int(length), ctx, int(b)))
            ctx += int(length)
    ops: list[list[Op]] = [[] for _ in range(stages)]
    for s in range(stages):
        for d, j, length, ctx, b in units:
            deps = [("F", (d, j), s - 1)] if s else []
            label = f"{j + 1}" if not multi else f"{d + 1}.{j + 1}"
            ops[s].append(Op(("F", (d, j), s), s, label, "F",
                             [("backbone", tf(t_fwd, length, ctx, b))], deps))
        if t_bwd is not None:
            for d, j, length, ctx, b in reversed(units):
                deps = [("F", (d, j), s)] + ([("B", (d, j), s + 1)] if s < stages - 1 else [])
                label = f"{j + 1}" if not multi else f"{d + 1}.{j + 1}"
                ops[s].append(Op(("B", (d, j), s), s, label, "B",
                                 [("backbone", tf(t_bwd, length, ctx, b))], deps))
    return ops


# ----- EE-LLM pipeline-based early-exit inference (Fig. 5) -----------------------------------

def inference_schedule(exit_layers: Sequence[int], num_layers: int, stages: int,
                       layer_time: float = 1.0, exit_time: float = 0.0,
                       pipelined: bool = True) -> list[list[Op]]:
    """Per-stage ops of generating ``len(exit_layers)`` tokens (EE-LLM Sec. 4, Fig. 5).

    Token ``n`` exits after 1-based layer ``exit_layers[n]`` (``num_layers`` = full model).
    With ``pipelined`` (Fig. 5 bottom) the next token starts on stage 1 as soon as token
    ``n``'s exit output exists, while token ``n`` continues through the remaining layers to
    fill its KV caches; each stage still handles tokens in order. Without it (Fig. 5 top)
    every token runs the full model before the next starts. Every layer takes
    ``layer_time``; an exit head takes ``exit_time``.
    """
    if num_layers % stages:
        raise PlanError(f"num_layers={num_layers} is not divisible by stages={stages}")
    per = num_layers // stages
    ops: list[list[Op]] = [[] for _ in range(stages)]
    prev_exit: Hashable | None = None
    for n, e in enumerate(exit_layers):
        if not 1 <= e <= num_layers:
            raise PlanError(f"exit layer {e} of token {n} must be in [1, {num_layers}]")
        e = e if pipelined else num_layers
        last: Hashable | None = None
        for s in range(stages):
            lo, hi = s * per, (s + 1) * per  # layers (lo, hi] in 1-based terms
            deps = [last] if last is not None else ([prev_exit] if prev_exit else [])
            if lo < e < hi or (e == hi and e < num_layers):
                a = Op(("T", n, s, "a"), s, str(n + 1), "F",
                       [("backbone", (e - lo) * layer_time), ("exit", exit_time)], deps)
                ops[s].append(a)
                prev_exit = a.key
                last = a.key
                if e < hi:
                    b = Op(("T", n, s, "b"), s, str(n + 1), "F",
                           [("backbone", (hi - e) * layer_time)], [a.key])
                    ops[s].append(b)
                    last = b.key
            else:
                segs = [("backbone", per * layer_time)]
                if e == num_layers and s == stages - 1:
                    segs.append(("exit", exit_time))
                op = Op(("T", n, s, "a"), s, str(n + 1), "F", segs, deps)
                ops[s].append(op)
                last = op.key
                if e == num_layers and s == stages - 1:
                    prev_exit = op.key
    return ops
