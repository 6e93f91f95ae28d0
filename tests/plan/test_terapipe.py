"""TeraPipe planner: optimality by brute force, Eq. 9 model, Sec. 3.4 knapsack."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitlm.plan.cost_model import PlanError
from exitlm.plan.terapipe import (
    PerfModel,
    best_uniform,
    fit_ctx_coef,
    plan_batch,
    plan_slices,
    slicing_latency,
)


def _compositions(n: int):
    for cuts in itertools.product((0, 1), repeat=n - 1):
        out, cur = [], 1
        for c in cuts:
            if c:
                out.append(cur)
                cur = 1
            else:
                cur += 1
        yield [*out, cur]


def _random_cost(rng: np.random.Generator, n: int, integer: bool) -> np.ndarray:
    cost = np.full((n + 1, n + 1), np.inf)
    for ln in range(1, n + 1):
        for c in range(n - ln + 1):
            cost[ln, c] = float(rng.integers(1, 12)) if integer else float(rng.random())
    return cost


@pytest.mark.parametrize("method", ["enumerate", "bisect"])
def test_dp_is_optimal_against_brute_force(method: str) -> None:
    rng = np.random.default_rng(0)
    for trial in range(60):
        n, k = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        cost = _random_cost(rng, n, integer=trial % 2 == 0)  # ties and no ties
        brute = min(slicing_latency(cost, s, k) for s in _compositions(n))
        res = plan_slices(cost, k, method=method)
        assert res["latency"] == pytest.approx(brute)
        assert sum(res["slices"]) == n
        assert slicing_latency(cost, res["slices"], k) == pytest.approx(res["latency"])


def test_epsilon_gap_is_at_most_k_eps() -> None:
    rng = np.random.default_rng(1)
    for _ in range(30):
        n, k = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        cost = _random_cost(rng, n, integer=False)
        opt = plan_slices(cost, k)["latency"]
        for eps in (0.05, 0.2):
            for method in ("enumerate", "bisect"):
                got = plan_slices(cost, k, epsilon=eps, method=method)["latency"]
                assert opt - 1e-12 <= got <= opt + k * eps + 1e-12


def test_beats_or_ties_best_uniform_on_eq9_model() -> None:
    n = 96
    i = np.arange(1, n + 1)
    for k in (2, 8, 24):
        pm = PerfModel(tuple(np.maximum(0.3, 0.01 * i) + 0.02), (0.01, 1e-3, 2e-3, 1e-4))
        cost = pm.matrix()
        dp = plan_slices(cost, k)
        assert dp["latency"] <= best_uniform(cost, k)["latency"] + 1e-12
        # attention makes later tokens costlier: the last slice is not longer than the first
        assert dp["slices"][-1] <= dp["slices"][0]


def test_eq9_model_and_fit() -> None:
    pm = PerfModel((1.0, 1.5, 2.0, 2.5), (0.1, 0.2, 0.3, 0.04))
    assert pm.t(2, 0) == 1.5  # t_ctx(i, 0) = 0
    assert pm.t(2, 2) == pytest.approx(1.5 + 0.1 + 0.4 + 0.6 + 0.16)
    cost = pm.matrix()
    assert cost[2, 2] == pytest.approx(pm.t(2, 2)) and np.isinf(cost[3, 2])
    a = (0.05, 0.002, 0.001, 3e-5)
    samples = [(i, j, a[0] + a[1] * i + a[2] * j + a[3] * i * j)
               for i in (1, 8, 32) for j in (4, 16, 64)]
    assert fit_ctx_coef(samples) == pytest.approx(a, rel=1e-6, abs=1e-12)
    with pytest.raises(PlanError, match=">= 4 samples"):
        fit_ctx_coef(samples[:2])


def test_joint_batch_plan_is_optimal_knapsack() -> None:
    rng = np.random.default_rng(2)
    n, big_b, k = 6, 4, 3
    costs = [_random_cost(rng, n, integer=False) * b ** 0.7 for b in range(1, big_b + 1)]
    res = plan_batch(costs, big_b, k)
    t_b = [plan_slices(c, k)["latency"] for c in costs]
    # brute force over integer partitions of B
    best = min(sum(t_b[x - 1] for x in part)
               for m in range(1, big_b + 1)
               for part in itertools.product(range(1, big_b + 1), repeat=m)
               if sum(part) == big_b)
    assert res["latency"] == pytest.approx(best)
    assert sum(res["batch_splits"]) == big_b
    assert res["pipelined_latency"] <= res["latency"] + 1e-12


def test_plans_errors() -> None:
    with pytest.raises(PlanError, match="--stages"):
        plan_slices(np.ones((3, 3)), 0)
    with pytest.raises(PlanError, match="method"):
        plan_slices(np.ones((3, 3)), 2, method="magic")
    with pytest.raises(PlanError, match="t_noctx"):
        PerfModel(())
