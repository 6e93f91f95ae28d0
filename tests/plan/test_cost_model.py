"""EE-LLM App. A.3 (time and memory), App. C.2.1 (bubble filling), App. A.2 (placement)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitlm.plan.cost_model import (
    OpCost,
    PipelineSpec,
    PlanError,
    bubble_fill_capacity,
    exits_per_stage,
    iteration_time_bound,
    iteration_time_no_exits,
    iteration_time_uniform,
    part1_forward_depths,
    part2_backward_stages,
    recommend_exits,
    stage_memory,
)
from exitlm.plan.simulate import simulate, simulate_training, training_ops, training_schedule


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_step1_closed_form_equals_simulation(schedule: str) -> None:
    # App. A.3.1 Step 1: (P-1)(f+b) + M(f+b) for equal stages.
    for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 7)):
        spec = PipelineSpec(p, m, (0,) * p, BB=OpCost(1.0, 2.5))
        sim = simulate_training(spec, schedule)
        assert sim.makespan == pytest.approx(iteration_time_uniform(p, m, 1.0, 2.5))


def test_step2_closed_form_equals_simulation() -> None:
    # Step 2 with f_IN < f_FE, b_IN < b_FE (last stage is the bottleneck), M >= P.
    for p, m in [(2, 2), (3, 4), (4, 6), (4, 8)]:
        spec = PipelineSpec(p, m, (0,) * p, IN=OpCost(0.1, 0.2), BB=OpCost(1, 2),
                            FE=OpCost(0.6, 1.1))
        assert simulate_training(spec).makespan == pytest.approx(iteration_time_no_exits(spec))
        # hand: f_IN + b_IN + (P-1)(f_BB+b_BB) + M(f_BB+b_BB+f_FE+b_FE)
        assert iteration_time_no_exits(spec) == pytest.approx(0.3 + (p - 1) * 3 + m * 4.7)


def test_step3_bound_holds_and_is_tight_for_balanced_middle_exits() -> None:
    # EE-LLM Fig. 3(b)/(c): one exit per middle stage, exit = final-exit cost: the critical
    # path gains exactly k (f_EE + b_EE) (App. A.1, Remark A.2).
    base = dict(IN=OpCost(0.1, 0.2), BB=OpCost(1, 2), FE=OpCost(0.5, 1), EE=OpCost(0.5, 1))
    for deferred in (True, False):
        spec = PipelineSpec(4, 6, (0, 1, 1, 0), deferred_exits=deferred, **base)
        no_exit = PipelineSpec(4, 6, (0, 0, 0, 0), **base)
        bound = iteration_time_bound(spec)["total"]
        assert bound == pytest.approx(iteration_time_no_exits(no_exit) + 2 * 1.5)
        assert simulate_training(spec).makespan == pytest.approx(bound)
    rng = np.random.default_rng(0)
    for _ in range(40):
        p = int(rng.integers(2, 6))
        m = int(rng.integers(p, 2 * p + 2))
        n = tuple(int(x) for x in rng.integers(0, 3, size=p))
        fe = OpCost(*rng.uniform(0.5, 1.0, 2))
        spec = PipelineSpec(p, m, n, IN=OpCost(*rng.uniform(0, 0.4, 2)),
                            BB=OpCost(*rng.uniform(0.5, 2, 2)), FE=fe,
                            EE=OpCost(*rng.uniform(0.1, 0.6, 2)),
                            deferred_exits=bool(rng.integers(0, 2)))
        assert simulate_training(spec).makespan <= iteration_time_bound(spec)["total"] + 1e-9


def test_memory_eq4_to_6_by_hand() -> None:
    # P=4, N=(0,1,1,0), alpha=2. m: IN=1 BB=4 EE=1 FE=1; m†: IN=0.1 BB=2 EE=0.5 FE=0.5.
    kw = dict(IN=OpCost(m=1, m_act=0.1), BB=OpCost(m=4, m_act=2), EE=OpCost(m=1, m_act=0.5),
              FE=OpCost(m=1, m_act=0.5), alpha=2.0)
    mem = stage_memory(PipelineSpec(4, 8, (0, 1, 1, 0), **kw))
    # stage 1: 2*(4+1) + (4*2 + 4*0.1) = 10 + 8.4
    assert mem[0]["total"] == pytest.approx(18.4)
    # stage 2: 2*(4+1) + (3*2 + 0.5) = 10 + 6.5
    assert mem[1]["total"] == pytest.approx(16.5)
    # stage 4: 2*(4+1) + (1*2 + 0.5) = 12.5
    assert mem[3]["total"] == pytest.approx(12.5)
    # not deferred: stage 2 keeps the exit logits of its P+1-i = 3 in-flight microbatches
    mem_nd = stage_memory(PipelineSpec(4, 8, (0, 1, 1, 0), deferred_exits=False, **kw))
    assert mem_nd[1]["activations"] == pytest.approx(3 * 2 + 3 * 0.5)
    assert mem_nd[2]["activations"] == pytest.approx(2 * 2 + 2 * 0.5)


def test_bubble_filling_counts_from_the_paper() -> None:
    # App. C.2.1: floor((P-1)/(f/b+1)); Part 2 backward stages floor(P - i(f/b+1)).
    assert bubble_fill_capacity(4, 1, 2) == 2  # floor(3 / 1.5)
    assert bubble_fill_capacity(4, 1, 1) == 1  # floor(3 / 2)
    assert bubble_fill_capacity(8, 1, 2) == 4  # floor(7 / 1.5) = 4
    assert bubble_fill_capacity(6, 1, 3) == 3  # floor(5 / (4/3)) = 3
    assert part2_backward_stages(4, 1, 2) == [2, 1]  # floor(4-1.5), floor(4-3)
    assert part2_backward_stages(8, 1, 2) == [6, 5, 3, 2]  # floor(8 - 1.5 i)
    # Part 1: i-th goes through K+1-i stages, cut back to the last stage with an exit
    assert part1_forward_depths((0, 1, 1, 0), 2) == [2, 0]
    assert part1_forward_depths((0, 1, 0, 1, 1, 0, 0, 0), 4) == [4, 2, 2, 0]


@pytest.mark.parametrize("p,f,b,part1_extra", [(4, 1, 1, 0), (4, 1, 2, 0), (8, 1, 2, 0),
                                                (6, 1, 3, 0), (5, 1, 2, 0), (8, 1, 3, 4.0)])
def test_bubble_filling_in_the_executed_schedule(p: int, f: float, b: float,
                                                 part1_extra: float) -> None:
    """EE-LLM App. C.2.1 through the action lists ``exitlm train`` executes: the fill
    microbatches' routes come from the cost model's counts; Part 2 fills the cool-down
    bubbles without adding time (planned for a larger b/f than the real one, it costs time);
    Part 1 is free except where both ends of a link must see messages in the same order
    (p=8, b=3f: +4 of 92; the paper's Fig. 4 order, which ignores that, is free)."""
    spec = PipelineSpec(p, 2 * p, (0,) * p, BB=OpCost(f, b))
    base = simulate_training(spec).makespan
    sched = training_schedule(spec, fill="cooldown")
    cap = bubble_fill_capacity(p, f, b)
    assert [p - r.bwd_first for r in sched.routes if r.kind == "fill2"] == [
        n for n in part2_backward_stages(p, f, b, cap) if n > 0]
    assert simulate(training_ops(spec, sched)).makespan == pytest.approx(base)
    assert simulate_training(spec, fill="cooldown",
                             backward_forward_ratio=3 * b / f).makespan >= base
    ex = (0,) + (1,) * (p - 2) + (0,)
    spec1 = PipelineSpec(p, 2 * p, ex, BB=OpCost(f, b))
    sched1 = training_schedule(spec1, fill="warmup")
    assert [r.fwd_last + 1 for r in sched1.routes if r.kind == "fill1"] == [
        d for d in part1_forward_depths(ex, cap) if d > 0]
    assert simulate(training_ops(spec1, sched1)).makespan == pytest.approx(
        simulate_training(spec1).makespan + part1_extra)


def test_an_optimistic_backward_forward_ratio_costs_time() -> None:
    spec = PipelineSpec(8, 16, (0,) * 8, BB=OpCost(1, 2))
    base = simulate_training(spec).makespan
    assert simulate_training(spec, fill="cooldown", backward_forward_ratio=4.0).makespan > base


def test_exit_placement_rules() -> None:
    # App. A.2: an exit at a stage boundary belongs to the beginning of the later stage.
    assert exits_per_stage((8, 16), 32, 4) == (0, 1, 1, 0)
    assert exits_per_stage((7, 9), 32, 4) == (1, 1, 0, 0)
    rec = recommend_exits(32, 4, 2)
    assert rec["exits_per_stage"] == [0, 1, 1, 0]  # middle stages only
    rec = recommend_exits(48, 8, 3)
    assert rec["exits_per_stage"][0] == rec["exits_per_stage"][-1] == 0
    assert max(rec["exits_per_stage"]) == 1
    assert any("middle stages" in n for n in recommend_exits(12, 4, 5)["notes"])


def test_errors_name_the_setting() -> None:
    with pytest.raises(PlanError, match="--exits-per-stage"):
        PipelineSpec(4, 8, (0, 1))
    with pytest.raises(PlanError, match="--microbatches"):
        PipelineSpec(4, 0, (0,) * 4)
    with pytest.raises(PlanError, match="divisible"):
        exits_per_stage((3,), 10, 4)
