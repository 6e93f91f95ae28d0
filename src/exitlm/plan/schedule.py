"""Pipeline schedules as per-stage lists of actions.

An action is the forward (``F``) or backward (``B``) step of one token slice of one
microbatch on one stage. A schedule is a list of actions per stage plus, for every
microbatch, its *route*: the last stage its forward reaches and the first stage its backward
reaches. Regular microbatches go everywhere; EE-LLM's bubble-filling microbatches do not
(App. C.2.1):

* Part 1 (warm-up bubble): the ``i``-th of ``K`` inserted microbatches runs the forward of the
  first ``K + 1 - i`` stages (cut back to the last of them that has an early exit), then the
  backward of the exit losses it visited.
* Part 2 (cool-down bubble): the ``i``-th runs the whole forward, then the backward of only the
  last ``floor(p - i (f/b + 1))`` stages.

``K = floor((p - 1) / (f/b + 1))`` per part (App. C.2.1) unless given. The counts come from
:mod:`exitlm.plan.cost_model` - one home for them - and ``exitlm plan pipeline`` simulates
these very action lists (:func:`exitlm.plan.simulate.training_ops`).

Schedules:

* GPipe: every forward, then every backward (microbatches and slices in reverse).
* 1F1B (PipeDream-Flush; EE-LLM Sec. 3.1.3): stage ``k`` runs ``w_k`` warm-up forwards,
  then alternates one forward and one backward, then drains the backwards. With ``S`` token
  slices per microbatch the unit of work is one slice and ``w_k = (S - 1) + (p - 1 - k)``:
  the last stage must hold all slices of a microbatch before its first backward (TeraPipe
  runs slices' backward in reverse order, since slice ``s`` sends key/value gradients to the
  slices before it).

:func:`check_schedule` executes a schedule symbolically and raises if it could deadlock or
if the two ends of a link would see messages in different orders (NCCL matches in order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from exitlm.config import ConfigError
from exitlm.plan.cost_model import (
    bubble_fill_capacity,
    part1_forward_depths,
    part2_backward_stages,
)
from exitlm.plan.events import Op, simulate


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    mb: int
    slice: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.slice}" if self.slice else "")


@dataclass(frozen=True)
class Route:
    """Stages a microbatch visits: forward on ``0..fwd_last``, backward on
    ``bwd_first..fwd_last``. ``kind``: ``regular``, ``fill1`` or ``fill2`` (App. C.2)."""

    fwd_last: int
    bwd_first: int = 0
    kind: Literal["regular", "fill1", "fill2"] = "regular"

    def forwards(self, stage: int) -> bool:
        return stage <= self.fwd_last

    def backwards(self, stage: int) -> bool:
        return self.bwd_first <= stage <= self.fwd_last


@dataclass
class PipelineSchedule:
    """Actions per stage, routes per microbatch, token slice lengths."""

    name: str
    num_stages: int
    routes: list[Route]
    slices: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_microbatches(self) -> int:
        return len(self.routes)

    @property
    def num_regular(self) -> int:
        return sum(r.kind == "regular" for r in self.routes)

    def describe(self) -> str:
        """One line of actions per stage, e.g. ``stage 0: F0 F1 B0 F2 B1 B2``."""
        return "\n".join(f"stage {k}: " + " ".join(map(str, acts))
                         for k, acts in enumerate(self.actions))


def fill_routes(stages: int, exit_stages: Sequence[int], part: Literal[1, 2],
                count: int, backward_forward_ratio: float) -> list[Route]:
    """Routes of the ``count`` microbatches inserted into Part 1 or Part 2 (EE-LLM App.
    C.2.1), from the cost model's functions (:func:`~exitlm.plan.cost_model.
    part1_forward_depths`, :func:`~exitlm.plan.cost_model.part2_backward_stages`, with
    ``f = 1`` and ``b = backward_forward_ratio``); microbatches that would reach no loss or
    run no backward are left out."""
    if part == 1:
        n = [1 if k in set(exit_stages) else 0 for k in range(stages)]
        return [Route(fwd_last=d - 1, bwd_first=0, kind="fill1")
                for d in part1_forward_depths(n, count) if d > 0]
    return [Route(fwd_last=stages - 1, bwd_first=stages - n, kind="fill2")
            for n in part2_backward_stages(stages, 1.0, backward_forward_ratio, count) if n > 0]


def build_schedule(
    kind: str,
    stages: int,
    microbatches: int,
    slices: Sequence[int] = (1,),
    *,
    fill: str = "none",
    exit_stages: Sequence[int] = (),
    backward_forward_ratio: float = 2.0,
    fill_microbatches: int | None = None,
) -> PipelineSchedule:
    """Build and check a ``gpipe`` or ``1f1b`` schedule.

    ``exit_stages``: stages holding an early exit (Part 1 fill needs them).
    """
    if kind not in ("gpipe", "1f1b"):
        raise ConfigError(f"parallel.schedule must be 1f1b or gpipe, got {kind!r}")
    if microbatches < 1:
        raise ConfigError(f"a step needs at least one microbatch (train.grad_accum), got "
                          f"{microbatches}")
    routes = [Route(stages - 1) for _ in range(microbatches)]
    if fill not in ("none", "warmup", "cooldown", "both"):
        raise ConfigError(f"parallel.bubble_fill must be none, warmup, cooldown or both, got "
                          f"{fill!r}")
    k = (bubble_fill_capacity(stages, 1.0, backward_forward_ratio)
         if fill_microbatches is None else fill_microbatches)
    part1 = fill_routes(stages, exit_stages, 1, k, backward_forward_ratio) \
        if fill in ("warmup", "both") else []
    part2 = fill_routes(stages, exit_stages, 2, k, backward_forward_ratio) \
        if fill in ("cooldown", "both") else []
    n_slices = len(slices)
    regular = list(range(microbatches))
    p1 = list(range(microbatches, microbatches + len(part1)))
    p2 = list(range(microbatches + len(part1), microbatches + len(part1) + len(part2)))
    all_routes = routes + part1 + part2
    sched = PipelineSchedule(kind, stages, all_routes, tuple(slices))

    def fwd_units(mbs: Sequence[int]) -> list[Action]:
        return [Action("F", m, s) for m in mbs for s in range(n_slices)]

    def bwd_units(mbs: Sequence[int]) -> list[Action]:
        return [Action("B", m, s) for m in mbs for s in reversed(range(n_slices))]

    for k in range(stages):
        f_reg = fwd_units(regular)
        b_reg = bwd_units(regular)
        if kind == "gpipe":
            b_reg = bwd_units(list(reversed(regular)))
            acts = f_reg + b_reg
        else:
            warm = min(len(f_reg), (n_slices - 1) + (stages - 1 - k))
            acts = f_reg[:warm]
            fi, bi = warm, 0
            while fi < len(f_reg):
                acts.append(f_reg[fi])
                fi += 1
                acts.append(b_reg[bi])
                bi += 1
            acts += b_reg[bi:]
        # Part 1, deepest microbatch first: its forwards after the same number of regular
        # forward units on every stage it visits (both ends of a link must order messages
        # alike) - in 1F1B the warm-up of its last stage plus that stage's first steady
        # forward - and its backwards just before the stage's first regular backward.
        for m in sorted((m for m in p1 if all_routes[m].forwards(k)),
                        key=lambda m: -all_routes[m].fwd_last):
            last = all_routes[m].fwd_last
            at = _after_forward_units(acts, n_slices + stages - 1 - last if kind == "1f1b"
                                      else len(f_reg))
            while at < len(acts) and acts[at].mb in p1:  # after fills placed here before
                at += 1
            fwd = fwd_units([m])
            acts = acts[:at] + fwd + acts[at:]
            first_b = next((j for j, a in enumerate(acts)
                            if a.kind == "B" and a.mb < microbatches), len(acts))
            first_b = max(first_b, at + len(fwd))  # fewer microbatches than the warm-up
            acts = acts[:first_b] + bwd_units([m]) + acts[first_b:]
        # Part 2: the i-th extra forward rides in the cool-down gap after the regular
        # backward of microbatch M - w - 1 + i (w: this stage's warm-up) in 1F1B without
        # token slices, else right after the last regular forward; backwards go last.
        if p2:
            warm = min(microbatches, stages - 1 - k)
            for i, m in enumerate(p2):
                target = microbatches - warm - 1 + i
                spread = kind == "1f1b" and n_slices == 1 and i <= warm  # (slices: at the end)
                at = _after_backward_of(acts, target) if spread else None
                if at is None:  # after the last regular forward and the earlier extras
                    before = set(regular) | set(p2[:i])
                    at = 1 + max(j for j, a in enumerate(acts) if a.kind == "F"
                                 and a.mb in before)
                acts = acts[:at] + fwd_units([m]) + acts[at:]
            acts += bwd_units([m for m in p2 if all_routes[m].backwards(k)])
        sched.actions.append(acts)
    if p2 and kind == "1f1b":
        _order_cooldown(sched, microbatches, backward_forward_ratio)
    check_schedule(sched)
    return sched


def _after_backward_of(acts: list[Action], mb: int) -> int | None:
    """Index just after the last backward action of microbatch ``mb`` (``None``: none)."""
    idx = [i for i, a in enumerate(acts) if a.kind == "B" and a.mb == mb]
    return idx[-1] + 1 if idx else None


def _order_cooldown(sched: PipelineSchedule, regular: int, ratio: float,
                    rounds: int = 32) -> None:
    """Order each stage's actions after its last regular backward by the time their inputs
    arrive (simulated with forward 1, backward ``ratio`` per microbatch), forwards and
    backwards each keeping their order so both ends of every link still agree; repeated
    until stable. EE-LLM App. C.2.1: Part 2 then fills the cool-down bubbles without
    lengthening the step (when the ratio is right)."""

    share = [n / sum(sched.slices) for n in sched.slices]
    for _ in range(rounds):
        ops = []
        for k, acts in enumerate(sched.actions):
            row = []
            for a in acts:
                if a.kind == "F":
                    deps = [("F", a.mb, a.slice, k - 1)] if k > 0 else []
                    cost = share[a.slice]
                else:
                    deps = [("F", a.mb, a.slice, k)]
                    if k < sched.routes[a.mb].fwd_last:
                        deps.append(("B", a.mb, a.slice, k + 1))
                    cost = ratio * share[a.slice]
                row.append(Op((a.kind, a.mb, a.slice, k), k, "", a.kind, [("x", cost)], deps))
            ops.append(row)
        end = {op.key: op.end for op in simulate(ops).ops}
        changed = False
        for k, acts in enumerate(sched.actions):
            last = max((i for i, a in enumerate(acts) if a.kind == "B" and a.mb < regular),
                       default=-1)
            tail = acts[last + 1:]
            merged = _merge_by_readiness(tail, lambda a, k=k, end=end: _ready(sched, end, a, k))
            if merged != tail:
                sched.actions[k] = acts[: last + 1] + merged
                changed = True
        if not changed:
            return


def _ready(sched: PipelineSchedule, end: dict[tuple[str, int, int, int], float], a: Action,
           k: int) -> float:
    """When action ``a`` on stage ``k`` has its inputs, given simulated end times."""
    if a.kind == "F":
        return end.get(("F", a.mb, a.slice, k - 1), 0.0)
    if k < sched.routes[a.mb].fwd_last:
        return end[("B", a.mb, a.slice, k + 1)]
    return end[("F", a.mb, a.slice, k)]


def _merge_by_readiness(tail: list[Action], ready: Callable[[Action], float]) -> list[Action]:
    """``tail``'s forwards and backwards merged by readiness (forwards first on ties), each
    kind in its original order."""
    queues = {"F": [a for a in tail if a.kind == "F"], "B": [a for a in tail if a.kind == "B"]}
    merged = []
    while queues["F"] or queues["B"]:
        head = min((q[0] for q in queues.values() if q),
                   key=lambda a: (ready(a), a.kind != "F"))
        merged.append(queues[head.kind].pop(0))
    return merged


def _after_forward_units(acts: list[Action], n: int, only_regular: int | None = None) -> int:
    """Index just after the ``n``-th forward action in ``acts`` (of microbatches below
    ``only_regular`` when given); 0 when ``n == 0``."""
    if n <= 0:
        return 0
    seen = 0
    for i, a in enumerate(acts):
        if a.kind == "F" and (only_regular is None or a.mb < only_regular):
            seen += 1
            if seen == n:
                j = i + 1
                return j
    return len(acts)


def check_schedule(sched: PipelineSchedule) -> None:
    """Execute ``sched`` symbolically; raise ``ValueError`` if it can deadlock, misses or
    repeats an action, or if a link's two ends order their messages differently."""
    p = sched.num_stages
    n_slices = len(sched.slices)
    expected: list[set[Action]] = [set() for _ in range(p)]
    for m, r in enumerate(sched.routes):
        for k in range(p):
            for s in range(n_slices):
                if r.forwards(k):
                    expected[k].add(Action("F", m, s))
                if r.backwards(k):
                    expected[k].add(Action("B", m, s))
    for k, acts in enumerate(sched.actions):
        if len(set(acts)) != len(acts) or set(acts) != expected[k]:
            missing = sorted(map(str, expected[k] - set(acts)))
            extra = sorted(map(str, set(acts) - expected[k]))
            raise ValueError(f"stage {k} schedule is wrong: missing {missing}, unexpected "
                             f"{extra}, or repeated actions")
    # message order on each directed link must agree at both ends
    for k in range(p - 1):
        sent = [(a.mb, a.slice) for a in sched.actions[k]
                if a.kind == "F" and sched.routes[a.mb].forwards(k + 1)]
        got = [(a.mb, a.slice) for a in sched.actions[k + 1] if a.kind == "F"]
        if sent != got:
            raise ValueError(f"activations {k}->{k + 1} are sent in order {sent} but received "
                             f"in order {got}")
        sent_g = [(a.mb, a.slice) for a in sched.actions[k + 1]
                  if a.kind == "B" and sched.routes[a.mb].backwards(k)]
        got_g = [(a.mb, a.slice) for a in sched.actions[k]
                 if a.kind == "B" and sched.routes[a.mb].fwd_last > k]
        if sent_g != got_g:
            raise ValueError(f"gradients {k + 1}->{k} are sent in order {sent_g} but received "
                             f"in order {got_g}")
    done: list[set[Action]] = [set() for _ in range(p)]
    pos = [0] * p
    progress = True
    while progress:
        progress = False
        for k in range(p):
            while pos[k] < len(sched.actions[k]):
                a = sched.actions[k][pos[k]]
                route = sched.routes[a.mb]
                if a.kind == "F":
                    ready = k == 0 or Action("F", a.mb, a.slice) in done[k - 1]
                    ready = ready and (a.slice == 0 or Action("F", a.mb, a.slice - 1) in done[k])
                else:
                    ready = Action("F", a.mb, a.slice) in done[k]
                    if k < route.fwd_last:
                        ready = ready and Action("B", a.mb, a.slice) in done[k + 1]
                    if a.slice < n_slices - 1:
                        ready = ready and Action("B", a.mb, a.slice + 1) in done[k]
                if not ready:
                    break
                done[k].add(a)
                pos[k] += 1
                progress = True
    stuck = [k for k in range(p) if pos[k] < len(sched.actions[k])]
    if stuck:
        waits = ", ".join(f"stage {k} at {sched.actions[k][pos[k]]}" for k in stuck)
        raise ValueError(f"schedule {sched.name!r} deadlocks: {waits}")
