"""Discrete-event simulation of pipeline schedules from per-operation times.

Each stage (device) executes a fixed, ordered list of operations; an operation starts when
its stage is free *and* every operation it depends on has finished (P2P latency ignored, as
in EE-LLM App. A.3 and TeraPipe Sec. 3.3). With fixed per-stage orders this list schedule is
exactly the discrete-event execution of the pipeline.

Schedules built here:

* GPipe and 1F1B training with early exits, deferred (EE-LLM Fig. 3c, App. A.2) or not
  (Fig. 3b), and EE-LLM's bubble filling (App. C.2.1, Fig. 4): Part 1 partial forward /
  backward microbatches after the warm-up, Part 2 extra cool-down microbatches;
* TeraPipe token slices (TeraPipe Fig. 2, Sec. 3.2) optionally over batch splits (Sec. 3.4);
* EE-LLM's pipeline-based early-exit inference (EE-LLM Sec. 4, Fig. 5).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from exitlm.plan.cost_model import PipelineSpec, PlanError


@dataclass
class Op:
    """One operation on one stage. ``segments`` are ``(category, duration)`` pieces drawn back
    to back (e.g. backbone backward then exit backward); ``label`` is drawn in the block."""

    key: Hashable
    stage: int  # 0-based stage (device) index
    label: str
    kind: str  # "F" (forward-type) or "B" (backward-type), picks the colour family
    segments: list[tuple[str, float]]
    deps: list[Hashable] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0

    @property
    def duration(self) -> float:
        return sum(d for _, d in self.segments)


@dataclass
class SimResult:
    """Simulated schedule: ``ops`` with start/end filled, ``makespan`` (time per iteration),
    per-stage ``busy`` and ``idle`` time within ``[0, makespan]``."""

    ops: list[Op]
    num_stages: int
    makespan: float
    busy: list[float]
    idle: list[float]

    def to_dict(self) -> dict[str, object]:
        return {"makespan": self.makespan, "busy": self.busy, "idle": self.idle,
                "bubble_fraction": [i / self.makespan if self.makespan else 0.0
                                    for i in self.idle]}


def simulate(stage_ops: Sequence[Sequence[Op]]) -> SimResult:
    """Execute per-stage ordered op lists; each op starts at
    ``max(stage free, max(end of deps))``. Raises :class:`PlanError` on a deadlock."""
    keys = {}
    for ops in stage_ops:
        for op in ops:
            if op.key in keys:
                raise PlanError(f"operation {op.key!r} appears twice in the schedule")
            keys[op.key] = op
    for ops in stage_ops:
        for op in ops:
            for d in op.deps:
                if d not in keys:
                    raise PlanError(f"operation {op.key!r} depends on {d!r}, which is not "
                                    "scheduled on any stage")
    done: dict[Hashable, float] = {}
    ptr = [0] * len(stage_ops)
    free = [0.0] * len(stage_ops)
    remaining = sum(len(o) for o in stage_ops)
    while remaining:
        progress = False
        for s, ops in enumerate(stage_ops):
            while ptr[s] < len(ops) and all(d in done for d in ops[ptr[s]].deps):
                op = ops[ptr[s]]
                op.start = max([free[s]] + [done[d] for d in op.deps])
                op.end = op.start + op.duration
                free[s] = op.end
                done[op.key] = op.end
                ptr[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            blocked = [ops[ptr[s]].key for s, ops in enumerate(stage_ops) if ptr[s] < len(ops)]
            raise PlanError(f"schedule deadlocks; stages wait on {blocked}: reorder the ops")
    all_ops = [op for ops in stage_ops for op in ops]
    makespan = max((op.end for op in all_ops), default=0.0)
    busy = [sum(op.duration for op in ops) for ops in stage_ops]
    return SimResult(all_ops, len(stage_ops), makespan, busy, [makespan - b for b in busy])


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


def _fwd(spec: PipelineSpec, s: int, mb: object, label: str) -> Op:
    deps = [("F", mb, s - 1)] if s > 0 else []
    return Op(("F", mb, s), s, label, "F", _segments(spec, s, False), deps)


def _bwd(spec: PipelineSpec, s: int, mb: object, label: str, last: int | None = None) -> Op:
    last = spec.stages - 1 if last is None else last
    deps = [("F", mb, s)] + ([("B", mb, s + 1)] if s < last else [])
    return Op(("B", mb, s), s, label, "B", _segments(spec, s, True), deps)


def training_schedule(spec: PipelineSpec, schedule: str = "1f1b",
                      fill_part1: Sequence[int] = (),
                      fill_part2: Sequence[int] = ()) -> list[list[Op]]:
    """Per-stage op lists of one training iteration (microbatches numbered from 1).

    ``schedule``: ``"gpipe"`` (all forwards, then backwards in reverse order) or ``"1f1b"``
    (stage ``i`` runs ``P-i`` warm-up forwards, then alternates, EE-LLM Fig. 3).
    ``fill_part1[i-1]`` is the forward depth of the ``i``-th microbatch inserted after the
    warm-up (EE-LLM App. C.2.1 Part 1, see ``cost_model.part1_forward_depths``): it runs
    forward on stages ``1..depth`` right after each stage's first steady forward, then
    backward of the exit losses it visited. ``fill_part2[i-1]`` is the number of backward
    stages of the ``i``-th extra cool-down microbatch (Part 2): a full forward after the
    last regular forward of each stage, then backward on the last ``n_i`` stages after the
    stage's regular backwards.
    """
    p, m = spec.stages, spec.microbatches
    stages: list[list[Op]] = [[] for _ in range(p)]
    for s in range(p):
        if schedule == "gpipe":
            stages[s] += [_fwd(spec, s, j, str(j)) for j in range(1, m + 1)]
            stages[s] += [_bwd(spec, s, j, str(j)) for j in range(m, 0, -1)]
        elif schedule == "1f1b":
            warm = min(p - 1 - s, m)
            order: list[Op] = [_fwd(spec, s, j, str(j)) for j in range(1, warm + 1)]
            for j in range(warm + 1, m + 1):
                order.append(_fwd(spec, s, j, str(j)))
                order.append(_bwd(spec, s, j - warm, str(j - warm)))
            order += [_bwd(spec, s, j, str(j)) for j in range(m - warm + 1, m + 1)]
            stages[s] = order
        else:
            raise PlanError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
    for i, depth in enumerate(fill_part1, start=1):
        if not 0 <= depth <= p:
            raise PlanError(f"Part-1 depth {depth} of inserted microbatch {i} must be in [0, {p}]")
    for i, nb in enumerate(fill_part2, start=1):
        if not 0 <= nb <= p:
            raise PlanError(f"Part-2 backward stages {nb} of microbatch {i} must be in [0, {p}]")
    for s in range(p):
        ops = stages[s]
        # Part 1: after the first steady forward (before the first backward)
        first_b = next((k for k, op in enumerate(ops) if op.kind == "B"), len(ops))
        ins = [i for i, d in enumerate(fill_part1, start=1) if d > s]
        fw = [_fwd(spec, s, ("p1", i), f"a{i}") for i in ins]
        bw = [_bwd(spec, s, ("p1", i), f"a{i}", last=fill_part1[i - 1] - 1)
              for i in reversed(ins)]
        ops[first_b:first_b] = fw + bw
        # Part 2: the i-th extra forward rides in the cool-down gap right after the regular
        # backward B(M-w+i-1) (w = warm-up count), later ones and the extras' backwards form
        # a tail ordered by readiness (see simulate_training)
        w = min(p - 1 - s, m)
        for i in range(1, len(fill_part2) + 1):
            op = _fwd(spec, s, ("p2", i), f"z{i}")
            target = m - w + i - 1
            k = next((k for k, o in enumerate(ops) if o.key == ("B", target, s)), None)
            if k is None or i > w + 1:
                ops.append(op)
            else:
                ops.insert(k + 1, op)
        for i, nb in enumerate(fill_part2, start=1):
            if s >= p - nb:
                ops.append(_bwd(spec, s, ("p2", i), f"z{i}"))
    return stages


def simulate_training(spec: PipelineSpec, schedule: str = "1f1b",
                      fill_part1: Sequence[int] = (),
                      fill_part2: Sequence[int] = ()) -> SimResult:
    """Simulate one training iteration (see :func:`training_schedule`).

    Ops after a stage's last regular backward (bubble-filling extras) are re-ordered by the
    time their inputs become ready, re-simulating until the order is stable.
    """
    stages = training_schedule(spec, schedule, fill_part1, fill_part2)
    res = simulate(stages)
    for _ in range(4 * spec.stages + 4):
        changed = False
        end = {x.key: x.end for x in res.ops}
        for ops in stages:
            last_b = max((k for k, o in enumerate(ops) if o.kind == "B" and o.label.isdigit()),
                         default=-1)
            tail = ops[last_b + 1:]
            ready = {o.key: max([0.0] + [end[d] for d in o.deps]) for o in tail}
            new = sorted(tail, key=lambda o: (ready[o.key], o.kind != "F"))
            if [o.key for o in new] != [o.key for o in tail]:
                ops[last_b + 1:] = new
                changed = True
        if not changed:
            break
        res = simulate(stages)
    return res


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
