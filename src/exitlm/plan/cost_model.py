"""EE-LLM's training cost model for pipeline parallelism with early exits (EE-LLM App. A).

Quantities follow EE-LLM Table 2: ``P`` stages, ``N_i`` early exits on stage ``i``, ``M``
microbatches per iteration and, for each component ``o`` in {IN, EE, FE, BB}, forward and
backward time ``f_o``, ``b_o`` of one microbatch (seconds or any time unit), parameter memory
``m_o`` and activation memory ``m_o†`` of one microbatch (bytes or any memory unit).

Implemented here:

* time per iteration of 1F1B (App. A.3.1 Steps 1-3, the Step-3 bound with the per-stage max);
* per-stage memory (App. A.3.2 Eq. 4-6), with exit forwards deferred to the backward step
  (App. A.2, ``m_EE†`` once) or not (``(P+1-i) m_EE†``, one per in-flight microbatch);
* bubble filling counts (App. C.2.1): microbatches insertable into Part 1 / Part 2, the
  forward depth of each Part-1 microbatch and the backward stages of each Part-2 microbatch;
* exit placement advice (App. A.2 "rules of thumb").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from exitlm.errors import ExitlmError

_EPS = 1e-9  # tolerance for floors of ratios such as (P-1)/(f/b+1) computed in floating point


class PlanError(ExitlmError, ValueError):
    """A planning input is invalid; the message says which value to change."""


@dataclass(frozen=True)
class OpCost:
    """One component of EE-LLM Table 2: ``f_o, b_o`` (time / microbatch), ``m_o`` (parameter
    memory), ``m_o†`` = ``m_act`` (activation memory of one microbatch)."""

    f: float = 0.0
    b: float = 0.0
    m: float = 0.0
    m_act: float = 0.0

    def __post_init__(self) -> None:
        for key in ("f", "b", "m", "m_act"):
            v = getattr(self, key)
            if not math.isfinite(v) or v < 0:
                raise PlanError(f"cost {key} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class PipelineSpec:
    """A 1F1B pipeline with early exits in terms of EE-LLM Table 2.

    ``exits_per_stage[i-1]`` is ``N_i``. ``alpha`` is the factor of Eq. 4 (parameters +
    gradients + optimizer states = ``alpha`` x parameters; e.g. 8 for fp16 params with fp32
    Adam master weights and moments stored alongside, 1 to count parameters only).
    ``deferred_exits`` moves every exit forward into the backward step (EE-LLM App. A.2).
    """

    stages: int
    microbatches: int
    exits_per_stage: tuple[int, ...]
    IN: OpCost = field(default_factory=OpCost)
    BB: OpCost = field(default_factory=OpCost)
    EE: OpCost = field(default_factory=OpCost)
    FE: OpCost = field(default_factory=OpCost)
    alpha: float = 1.0
    deferred_exits: bool = True

    def __post_init__(self) -> None:
        if int(self.stages) < 1:
            raise PlanError(f"--stages (P) must be >= 1, got {self.stages}")
        if int(self.microbatches) < 1:
            raise PlanError(f"--microbatches (M) must be >= 1, got {self.microbatches}")
        n = tuple(int(x) for x in self.exits_per_stage)
        if len(n) != self.stages:
            raise PlanError(
                f"--exits-per-stage has {len(n)} entries but there are {self.stages} stages; "
                "give one count N_i per stage"
            )
        if any(x < 0 for x in n):
            raise PlanError(f"--exits-per-stage counts must be >= 0, got {list(n)}")
        object.__setattr__(self, "exits_per_stage", n)
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise PlanError(f"alpha must be a positive number, got {self.alpha!r}")

    @property
    def num_exits(self) -> int:
        return sum(self.exits_per_stage)


def stage_step_times(spec: PipelineSpec) -> list[tuple[float, float]]:
    """Forward and backward step time of one microbatch on each stage (EE-LLM App. A.3.1).

    Stage ``i`` runs BB, plus IN if ``i = 1``, FE if ``i = P`` and ``N_i`` exits. With deferred
    exits (App. A.2) the exit forward ``f_EE`` is part of the backward step. Returns
    ``[(f_i, b_i)]`` for ``i = 1..P``.
    """
    out = []
    p = spec.stages
    for i in range(1, p + 1):
        n = spec.exits_per_stage[i - 1]
        f = spec.BB.f + (spec.IN.f if i == 1 else 0.0) + (spec.FE.f if i == p else 0.0)
        b = spec.BB.b + (spec.IN.b if i == 1 else 0.0) + (spec.FE.b if i == p else 0.0)
        if spec.deferred_exits:
            b += n * (spec.EE.f + spec.EE.b)
        else:
            f += n * spec.EE.f
            b += n * spec.EE.b
        out.append((f, b))
    return out


def iteration_time_uniform(stages: int, microbatches: int, f: float, b: float) -> float:
    """1F1B time per iteration with equal stages, EE-LLM App. A.3.1 Step 1:
    ``(P-1)(f+b) + M(f+b)``."""
    return (stages - 1) * (f + b) + microbatches * (f + b)


def iteration_time_no_exits(spec: PipelineSpec) -> float:
    """EE-LLM App. A.3.1 Step 2 (no exits, ``f_IN < f_FE``, ``b_IN < b_FE``):
    ``f_IN + b_IN + (P-1)(f_BB+b_BB) + M(f_BB+b_BB+f_FE+b_FE)``."""
    bb, fe, inp = spec.BB, spec.FE, spec.IN
    return (
        inp.f + inp.b + (spec.stages - 1) * (bb.f + bb.b)
        + spec.microbatches * (bb.f + bb.b + fe.f + fe.b)
    )


def iteration_time_bound(spec: PipelineSpec) -> dict[str, float]:
    """Upper bound on 1F1B time per iteration with early exits, EE-LLM App. A.3.1 Step 3.

    ``f_IN + b_IN + (P-1)(f_BB+b_BB) + sum_{i<P} N_i (f_EE+b_EE)``   (Parts 1 and 3)
    ``+ M max_i {f_BB+b_BB + 1(i=1)(f_IN+b_IN) + 1(i=P)(f_FE+b_FE) + N_i (f_EE+b_EE)}`` (Part 2)

    (For ``P = 1`` the single stage holds IN, BB, FE and its exits; the bound is then
    ``M`` times that stage's per-microbatch time.) Returns the parts and the total.
    """
    p, bb, ee = spec.stages, spec.BB, spec.EE
    per_stage = [f + b for f, b in stage_step_times(spec)]
    if p == 1:
        return {"parts_1_3": 0.0, "part_2": spec.microbatches * per_stage[0],
                "total": spec.microbatches * per_stage[0]}
    parts13 = (
        spec.IN.f + spec.IN.b + (p - 1) * (bb.f + bb.b)
        + sum(spec.exits_per_stage[: p - 1]) * (ee.f + ee.b)
    )
    part2 = spec.microbatches * max(per_stage)
    return {"parts_1_3": parts13, "part_2": part2, "total": parts13 + part2}


def stage_memory(spec: PipelineSpec) -> list[dict[str, float]]:
    """Memory of each stage, EE-LLM App. A.3.2 Eq. 4-6.

    Parameters (Eq. 5): ``m_BB + 1(i=1) m_IN + 1(i=P) m_FE + N_i m_EE``, times ``alpha``
    (Eq. 4). Activations (Eq. 6): ``(P+1-i) m_BB† + 1(i=1) P m_IN† + 1(i=P) m_FE† +
    N_i m_EE†`` with deferred exits; without deferral each of the ``P+1-i`` in-flight
    microbatches keeps its exit logits, giving ``N_i (P+1-i) m_EE†`` (App. A.2).
    (With fewer microbatches than stages, only ``min(M, P+1-i)`` are in flight.)
    """
    p = spec.stages
    out = []
    for i in range(1, p + 1):
        n = spec.exits_per_stage[i - 1]
        inflight = min(p + 1 - i, spec.microbatches)
        params = spec.BB.m + (spec.IN.m if i == 1 else 0.0) + (spec.FE.m if i == p else 0.0)
        params += n * spec.EE.m
        ee_act = n * spec.EE.m_act * (1 if spec.deferred_exits else inflight)
        acts = (
            inflight * spec.BB.m_act
            + (min(p, spec.microbatches) * spec.IN.m_act if i == 1 else 0.0)
            + (spec.FE.m_act if i == p else 0.0)
            + ee_act
        )
        out.append({
            "params": params,
            "params_grads_optimizer": spec.alpha * params,
            "activations": acts,
            "total": spec.alpha * params + acts,
        })
    return out


# ----- bubble filling (EE-LLM App. C.2.1) ----------------------------------------------------

def bubble_fill_capacity(stages: int, f: float, b: float) -> int:
    """Microbatches that fit into Part 1 or Part 2 of the explicit bubbles without slowing
    the iteration, EE-LLM App. C.2.1: ``floor((P-1) b / (f+b)) = floor((P-1)/(f/b+1))``."""
    _check_fb(f, b)
    return max(0, math.floor((stages - 1) * b / (f + b) + _EPS))


def part2_backward_stages(stages: int, f: float, b: float, count: int | None = None) -> list[int]:
    """Backward stages of the ``i``-th microbatch inserted into the cool-down bubbles,
    EE-LLM App. C.2.1: ``floor(P - i (f/b + 1))`` for ``i = 1..K``.

    ``count`` defaults to :func:`bubble_fill_capacity`; entries are clipped at 0 (a
    microbatch with no backward stage contributes nothing).
    """
    _check_fb(f, b)
    k = bubble_fill_capacity(stages, f, b) if count is None else int(count)
    return [max(0, math.floor(stages - i * (f / b + 1) + _EPS)) for i in range(1, k + 1)]


def part1_forward_depths(exits_per_stage: tuple[int, ...] | list[int],
                         count: int) -> list[int]:
    """Forward depth (stages) of the ``i``-th microbatch inserted between warm-up and steady
    phases, EE-LLM App. C.2.1 "Details about Part 1": nominally ``K+1-i`` stages, cut back to
    the last of those stages that has an early exit (0: the microbatch is useless, no exit
    loss is reachable)."""
    depths = []
    for i in range(1, count + 1):
        d = min(count + 1 - i, len(exits_per_stage))
        while d > 0 and exits_per_stage[d - 1] == 0:
            d -= 1
        depths.append(d)
    return depths


def _check_fb(f: float, b: float) -> None:
    if not (f >= 0 and b > 0):
        raise PlanError(f"bubble filling needs forward time f >= 0 and backward time b > 0, "
                        f"got f={f}, b={b}")


# ----- exit placement (EE-LLM App. A.2 rules of thumb) ---------------------------------------

def stage_of_exit(layer: int, num_layers: int, stages: int) -> int:
    """1-based stage that hosts the exit after (1-based) ``layer`` when ``num_layers`` are
    split evenly: an exit on a stage boundary goes to the *beginning of the later stage*
    (EE-LLM App. A.2, Optimization 2), except after the last layer."""
    if num_layers % stages:
        raise PlanError(f"num_layers={num_layers} is not divisible by stages={stages}; "
                        "EE-LLM's analysis assumes equal layers per stage, pick a divisor")
    per = num_layers // stages
    return min(layer // per + 1, stages)


def exits_per_stage(layers: tuple[int, ...] | list[int], num_layers: int,
                    stages: int) -> tuple[int, ...]:
    """``N_i`` for exits at the given 1-based layers (see :func:`stage_of_exit`)."""
    n = [0] * stages
    for layer in layers:
        n[stage_of_exit(layer, num_layers, stages) - 1] += 1
    return tuple(n)


def recommend_exits(num_layers: int, stages: int, num_exits: int) -> dict[str, object]:
    """Suggest exit layers following EE-LLM App. A.2: exits at the *beginning* of middle
    stages (never the first or last stage), at most one per stage, spread evenly.

    Returns ``{"layers", "exits_per_stage", "notes"}``; ``layers`` are 1-based exit layers
    (an exit at the start of stage ``s`` reads the output of layer ``(s-1) L/P``).
    """
    if num_exits < 0:
        raise PlanError(f"number of exits must be >= 0, got {num_exits}")
    if num_layers % stages:
        raise PlanError(f"num_layers={num_layers} is not divisible by stages={stages}; "
                        "choose a stage count that divides the layers")
    per = num_layers // stages
    middle = list(range(2, stages))  # stages 2..P-1
    notes: list[str] = []
    if num_exits > len(middle):
        notes.append(
            f"{num_exits} exits but only {len(middle)} middle stages: extra exits share stages "
            "or sit on the first/last stage, adding N_i (f_EE + b_EE) to the bottleneck; "
            "consider fewer exits (EE-LLM App. A.2)")
    if num_exits == 0:
        layers: list[int] = []
    elif num_exits <= len(middle):
        # evenly spaced middle stages, exit at each chosen stage's first layer input
        picks = [middle[(j * len(middle)) // num_exits + (len(middle) // num_exits) // 2]
                 for j in range(num_exits)]
        layers = sorted((s - 1) * per for s in picks)
    else:
        if num_exits > num_layers - 1:
            raise PlanError(f"{num_exits} exits requested but a {num_layers}-layer model has "
                            f"only {num_layers - 1} exit positions; ask for fewer exits")
        layers = sorted({max(1, round((j + 1) * num_layers / (num_exits + 1)))
                         for j in range(num_exits)})
    notes.append("an exit at a stage boundary is placed at the beginning of the later stage "
                 "(balances load: EE-LLM Table 1, Optimization 2)")
    return {"layers": layers,
            "exits_per_stage": list(exits_per_stage(layers, num_layers, stages)),
            "notes": notes}
