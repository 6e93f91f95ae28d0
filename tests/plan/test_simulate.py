"""Schedule simulator against hand-drawn timelines and closed forms."""

from __future__ import annotations

import numpy as np
import pytest

from exitlm.plan.cost_model import OpCost, PipelineSpec, PlanError
from exitlm.plan.simulate import (
    Op,
    inference_schedule,
    simulate,
    simulate_training,
    terapipe_schedule,
)
from exitlm.plan.timeline import draw_timeline


def _table(res, stage: int) -> list[tuple[str, str, float, float]]:
    return [(o.kind, o.label, o.start, o.end) for o in res.ops if o.stage == stage]


def test_1f1b_p2_m2_by_hand() -> None:
    # f = 1, b = 2. Stage 2: F1 [1,2] B1 [2,4] F2 [4,5] B2 [5,7];
    # stage 1: F1 [0,1] F2 [1,2] (idle) B1 [4,6] (idle) B2 [7,9].
    res = simulate_training(PipelineSpec(2, 2, (0, 0), BB=OpCost(1, 2)), "1f1b")
    assert _table(res, 0) == [("F", "1", 0, 1), ("F", "2", 1, 2), ("B", "1", 4, 6),
                              ("B", "2", 7, 9)]
    assert _table(res, 1) == [("F", "1", 1, 2), ("B", "1", 2, 4), ("F", "2", 4, 5),
                              ("B", "2", 5, 7)]
    assert res.busy == [6, 6] and res.idle == [3, 3]


def test_gpipe_p2_m2_by_hand() -> None:
    # Stage 2: F1 [1,2] F2 [2,3] B2 [3,5] B1 [5,7]; stage 1: F1 F2 [0,2], B2 [5,7] B1 [7,9].
    res = simulate_training(PipelineSpec(2, 2, (0, 0), BB=OpCost(1, 2)), "gpipe")
    assert _table(res, 0) == [("F", "1", 0, 1), ("F", "2", 1, 2), ("B", "2", 5, 7),
                              ("B", "1", 7, 9)]
    assert _table(res, 1) == [("F", "1", 1, 2), ("F", "2", 2, 3), ("B", "2", 3, 5),
                              ("B", "1", 5, 7)]


def test_1f1b_p3_m3_by_hand() -> None:
    # f = b = 1. Stage 3: F1 2-3 B1 3-4 F2 4-5 B2 5-6 F3 6-7 B3 7-8.
    # Stage 2 (1 warm-up): F1 1-2 F2 2-3 B1 4-5 F3 5-6 B2 6-7 B3 8-9.
    # Stage 1 (2 warm-up): F1 0-1 F2 1-2 F3 2-3 B1 5-6 B2 7-8 B3 9-10.
    res = simulate_training(PipelineSpec(3, 3, (0, 0, 0), BB=OpCost(1, 1)), "1f1b")
    assert [(k, lbl, s) for k, lbl, s, _ in _table(res, 2)] == [
        ("F", "1", 2), ("B", "1", 3), ("F", "2", 4), ("B", "2", 5), ("F", "3", 6), ("B", "3", 7)]
    assert [(k, lbl, s) for k, lbl, s, _ in _table(res, 1)] == [
        ("F", "1", 1), ("F", "2", 2), ("B", "1", 4), ("F", "3", 5), ("B", "2", 6), ("B", "3", 8)]
    assert [(k, lbl, s) for k, lbl, s, _ in _table(res, 0)] == [
        ("F", "1", 0), ("F", "2", 1), ("F", "3", 2), ("B", "1", 5), ("B", "2", 7), ("B", "3", 9)]
    assert res.makespan == 10


def test_1f1b_p4_m2_fewer_microbatches_than_stages() -> None:
    # M < P: (M + P - 1)(f + b) still holds; stage 1 warms up with only M forwards.
    res = simulate_training(PipelineSpec(4, 2, (0,) * 4, BB=OpCost(1, 1)), "1f1b")
    assert res.makespan == (2 + 4 - 1) * 2
    assert [lbl for k, lbl, _, _ in _table(res, 0)] == ["1", "2", "1", "2"]


def test_deferred_exit_moves_forward_into_backward() -> None:
    spec = PipelineSpec(2, 2, (1, 0), BB=OpCost(1, 2), EE=OpCost(0.5, 0.25))
    ops = {(o.kind, o.label, o.stage): o for o in simulate_training(spec).ops}
    assert ops[("F", "1", 0)].duration == 1
    assert ops[("B", "1", 0)].duration == 2 + 0.5 + 0.25
    spec = PipelineSpec(2, 2, (1, 0), BB=OpCost(1, 2), EE=OpCost(0.5, 0.25),
                        deferred_exits=False)
    ops = {(o.kind, o.label, o.stage): o for o in simulate_training(spec).ops}
    assert ops[("F", "1", 0)].duration == 1.5


def test_terapipe_forward_matches_eq5() -> None:
    # TeraPipe Eq. 5: sum t_i + (K-1) max t_j is the exact makespan of a K-stage pipeline.
    rng = np.random.default_rng(3)
    for _ in range(20):
        k = int(rng.integers(1, 6))
        slices = [int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 6)))]
        table = rng.uniform(0.1, 2.0, size=(40, 40))
        res = simulate(terapipe_schedule(slices, k, lambda ln, c, tb=table: tb[ln, c]))
        ts, c = [], 0
        for ln in slices:
            ts.append(table[ln, c])
            c += ln
        assert res.makespan == pytest.approx(sum(ts) + (k - 1) * max(ts))


def test_terapipe_backward_runs_slices_in_reverse() -> None:
    res = simulate(terapipe_schedule([2, 1], 2, lambda ln, c: 1.0, lambda ln, c: 2.0))
    last = [(o.kind, o.label) for o in res.ops if o.stage == 1]
    assert last == [("F", "1"), ("F", "2"), ("B", "2"), ("B", "1")]
    assert res.makespan == pytest.approx(2 + 1 + 2 * 2 + 2)  # 3 fwd steps, 3 bwd steps


def test_ee_llm_pipelined_inference_fig5() -> None:
    # Fig. 5: the latency of a token exiting at the end of stage e is e stage-times; the
    # full model takes P stage-times per token; an exit inside stage 1 waits for stage 1.
    p, layers = 4, 8
    full = simulate(inference_schedule([8] * 5, layers, p, pipelined=False))
    assert full.makespan == 5 * 8
    for e in (1, 2, 3):
        res = simulate(inference_schedule([2 * e] * 5 + [8], layers, p))
        # 5 tokens exit after e stages, the last token runs the full model
        assert res.makespan == pytest.approx(5 * 2 * e + 8)
    res = simulate(inference_schedule([1] * 4 + [8], layers, p))
    assert res.makespan == pytest.approx(4 * 2 + 8)


def test_deadlock_and_bad_schedule_errors(tmp_path) -> None:
    a = Op("a", 0, "a", "F", [("backbone", 1.0)], ["b"])
    b = Op("b", 1, "b", "F", [("backbone", 1.0)], ["a"])
    with pytest.raises(PlanError, match="deadlock"):
        simulate([[a], [b]])
    with pytest.raises(PlanError, match="gpipe"):
        simulate_training(PipelineSpec(2, 2, (0, 0)), "zigzag")
    res = simulate_training(PipelineSpec(2, 2, (0, 0), BB=OpCost(1, 2)))
    with pytest.raises(PlanError, match=r"\.png or \.svg"):
        draw_timeline(res, str(tmp_path / "x.jpg"))


def test_timeline_files(tmp_path) -> None:
    spec = PipelineSpec(4, 6, (0, 1, 1, 0), IN=OpCost(0.1, 0.2), BB=OpCost(1, 2),
                        FE=OpCost(0.5, 1), EE=OpCost(0.5, 1))
    res = simulate_training(spec, fill="both")
    assert {o.label for o in res.ops} >= {"a1", "z1", "1", "6"}
    for ext in ("png", "svg"):
        path = draw_timeline(res, str(tmp_path / f"t.{ext}"))
        assert (tmp_path / f"t.{ext}").stat().st_size > 1000
        assert path.endswith(ext)
