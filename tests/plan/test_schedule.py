"""Pipeline schedules: shapes of GPipe / 1F1B, bubble-filling counts and routes (EE-LLM App.
C.2.1), and the checker that rejects deadlocks and mismatched message orders."""

from __future__ import annotations

import itertools

import pytest

from exitlm.config import ConfigError
from exitlm.plan.cost_model import bubble_fill_capacity, part2_backward_stages
from exitlm.plan.schedule import (
    Action,
    PipelineSchedule,
    Route,
    build_schedule,
    check_schedule,
    fill_routes,
)


def _names(sched: PipelineSchedule, stage: int) -> str:
    return " ".join(str(a) for a in sched.actions[stage])


def test_1f1b_warmup_steady_cooldown() -> None:
    s = build_schedule("1f1b", 4, 6)
    # stage k runs p - 1 - k warm-up forwards, then one forward / one backward, then drains
    assert _names(s, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _names(s, 2) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert _names(s, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


def test_gpipe_all_forward_then_all_backward() -> None:
    s = build_schedule("gpipe", 2, 3)
    assert _names(s, 0) == "F0 F1 F2 B2 B1 B0"
    assert _names(s, 1) == "F0 F1 F2 B2 B1 B0"


def test_token_slices_backward_in_reverse_order() -> None:
    s = build_schedule("1f1b", 2, 2, (4, 4, 4))
    # the last stage holds all 3 slices of microbatch 0 before its first backward
    assert _names(s, 1).startswith("F0 F0.1 F0.2 B0.2 F1 B0.1 ")
    for k in range(2):
        backs = [a for a in s.actions[k] if a.kind == "B" and a.mb == 0]
        assert [a.slice for a in backs] == [2, 1, 0]


def test_fill_counts_follow_app_c21() -> None:
    # floor((p - 1) / (f/b + 1)): p=4, b=2f -> floor(3 / 1.5) = 2 - the cost model's function
    # is the one the schedule uses (fill_microbatches unset)
    for p, ratio, k in [(4, 2.0, 2), (4, 1.0, 1), (8, 3.0, 5), (2, 2.0, 0)]:
        assert bubble_fill_capacity(p, 1.0, ratio) == k
        s = build_schedule("1f1b", p, 2 * p, fill="cooldown", backward_forward_ratio=ratio)
        assert s.num_microbatches - 2 * p == len(part2_backward_stages(p, 1.0, ratio, k))


def test_fill_routes() -> None:
    # Part 1: the i-th of K microbatches reaches stage K + 1 - i, cut back to an exit stage
    assert fill_routes(4, [0, 1, 2], 1, 2, 2.0) == [Route(1, 0, "fill1"), Route(0, 0, "fill1")]
    assert fill_routes(4, [1], 1, 2, 2.0) == [Route(1, 0, "fill1")]  # i=2 visits no exit
    # Part 2: full forward, backward over the last floor(p - i (f/b + 1)) stages
    assert fill_routes(4, [], 2, 2, 2.0) == [Route(3, 2, "fill2"), Route(3, 3, "fill2")]


@pytest.mark.parametrize("kind,fill", list(itertools.product(["1f1b", "gpipe"],
                                                        ["none", "warmup", "cooldown", "both"])))
def test_every_schedule_is_complete_and_deadlock_free(kind: str, fill: str) -> None:
    for p, m, slices in itertools.product([1, 2, 3, 4, 6], [1, 2, 5, 8], [(1,), (3, 3)]):
        s = build_schedule(kind, p, m, slices, fill=fill, exit_stages=list(range(p)),
                           backward_forward_ratio=3.0)
        assert s.num_regular == m
        extra = s.num_microbatches - m
        if fill == "none" or p == 1:
            assert extra == 0


def test_checker_rejects_deadlock_and_order_mismatch() -> None:
    routes = [Route(1), Route(1)]
    bad = PipelineSchedule("bad", 2, routes, (1,), [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)],  # B before its F
    ])
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(bad)
    swapped = PipelineSchedule("swapped", 2, routes, (1,), [
        [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ])
    with pytest.raises(ValueError, match="order"):
        check_schedule(swapped)
    missing = PipelineSchedule("missing", 2, routes, (1,), [
        [Action("F", 0), Action("F", 1), Action("B", 0)],
        [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
    ])
    with pytest.raises(ValueError, match="missing"):
        check_schedule(missing)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="schedule"):
        build_schedule("zero-bubble", 2, 2)
    with pytest.raises(ConfigError, match="microbatch"):
        build_schedule("1f1b", 2, 0)
