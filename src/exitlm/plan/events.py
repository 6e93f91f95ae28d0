"""Discrete-event execution of per-stage operation lists (the engine under every timeline
exitlm simulates).

Each stage (device) executes a fixed, ordered list of operations; an operation starts when
its stage is free *and* every operation it depends on has finished (P2P latency ignored, as
in EE-LLM App. A.3 and TeraPipe Sec. 3.3). With fixed per-stage orders this list schedule is
exactly the discrete-event execution of the pipeline. Pure Python: the pipeline schedule
builder (:mod:`exitlm.plan.schedule`) uses it to order bubble-filling work.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from exitlm.plan.cost_model import PlanError


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
    # event-driven: a stage advances when the dependencies of its next op have finished, so
    # the work is linear in ops + dependencies (a sweep over every stage until nothing moves
    # is quadratic in the stages: minutes for a few hundred)
    done: dict[Hashable, float] = {}
    waiting: dict[Hashable, list[int]] = {}  # dependency -> stages whose next op needs it
    ptr = [0] * len(stage_ops)
    free = [0.0] * len(stage_ops)
    remaining = sum(len(o) for o in stage_ops)
    ready = list(range(len(stage_ops)))[::-1]
    while ready:
        s = ready.pop()
        ops = stage_ops[s]
        while ptr[s] < len(ops):
            op = ops[ptr[s]]
            missing = next((d for d in op.deps if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(s)
                break
            op.start = max([free[s]] + [done[d] for d in op.deps])
            op.end = op.start + op.duration
            free[s] = op.end
            done[op.key] = op.end
            ptr[s] += 1
            remaining -= 1
            ready.extend(waiting.pop(op.key, ()))
    if remaining:
        blocked = [ops[ptr[s]].key for s, ops in enumerate(stage_ops) if ptr[s] < len(ops)]
        raise PlanError(f"schedule deadlocks; stages wait on {blocked}: reorder the ops")
    all_ops = [op for ops in stage_ops for op in ops]
    makespan = max((op.end for op in all_ops), default=0.0)
    busy = [sum(op.duration for op in ops) for ops in stage_ops]
    return SimResult(all_ops, len(stage_ops), makespan, busy, [makespan - b for b in busy])
