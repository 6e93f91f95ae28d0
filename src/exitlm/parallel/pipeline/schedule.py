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

``K = floor((p - 1) / (f/b + 1))`` per part (App. C.2.1) unless given.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from exitlm.config import ConfigError


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


def fill_counts(stages: int, backward_forward_ratio: float) -> int:
    """How many microbatches fit one explicit bubble: ``floor((p-1) / (f/b + 1))``
    (EE-LLM App. C.2.1)."""
    fb = 1.0 / backward_forward_ratio
    return max(0, math.floor((stages - 1) / (fb + 1) + 1e-9))


def fill_routes(stages: int, exit_stages: Sequence[int], part: Literal[1, 2],
                count: int, backward_forward_ratio: float) -> list[Route]:
    """Routes of the ``count`` microbatches inserted into Part 1 or Part 2 (App. C.2.1)."""
    routes = []
    fb = 1.0 / backward_forward_ratio
    for i in range(1, count + 1):
        if part == 1:
            reach = count - i  # 0-based index of stage K + 1 - i
            with_exit = [s for s in exit_stages if s <= reach]
            if not with_exit:
                continue  # it would visit no loss: nothing to learn
            routes.append(Route(fwd_last=max(with_exit), bwd_first=0, kind="fill1"))
        else:
            n = math.floor(stages - i * (fb + 1) + 1e-9)
            if n < 1:
                continue
            routes.append(Route(fwd_last=stages - 1, bwd_first=stages - n, kind="fill2"))
    return routes


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
    part1: list[Route] = []
    part2: list[Route] = []
    if fill in ("warmup", "both"):
        k = fill_counts(stages, backward_forward_ratio) if fill_microbatches is None \
            else fill_microbatches
        part1 = fill_routes(stages, exit_stages, 1, k, backward_forward_ratio)
    if fill in ("cooldown", "both"):
        k = fill_counts(stages, backward_forward_ratio) if fill_microbatches is None \
            else fill_microbatches
        part2 = fill_routes(stages, exit_stages, 2, k, backward_forward_ratio)
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
        # Part 1: forwards after the same regular forward unit on every stage (the warm-up
        # length of the deepest stage they reach), then their backwards, shortest route first.
        mine1 = [m for m in p1 if all_routes[m].forwards(k)]
        if mine1:
            deepest = max(all_routes[m].fwd_last for m in p1)
            at = _after_forward_units(acts, (n_slices - 1) + (stages - 1 - deepest)
                                      if kind == "1f1b" else len(f_reg))
            ins = fwd_units(mine1) + bwd_units(sorted(mine1, key=lambda m:
                                                      all_routes[m].fwd_last))
            acts = acts[:at] + ins + acts[at:]
        # Part 2: forwards right after the last regular forward, backwards at the very end.
        if p2:
            at = _after_forward_units(acts, len(f_reg), only_regular=microbatches)
            acts = acts[:at] + fwd_units(p2) + acts[at:]
            acts += bwd_units([m for m in p2 if all_routes[m].backwards(k)])
        sched.actions.append(acts)
    check_schedule(sched)
    return sched


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
