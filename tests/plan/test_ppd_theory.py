"""PPD Sec. 4: Theorem 4.1, Eq. 3/5/6 and the Sec. 4.3 / Fig. 3 worked numbers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from exitlm.plan.cost_model import PlanError
from exitlm.plan.ppd_theory import (
    approx_compute_per_time,
    approx_compute_per_token,
    approx_latency_per_token,
    expected_compute,
    expected_latency,
    monte_carlo,
    predict,
    simulate_matches,
)

# PPD Table 2, layer-20 column (d = 40, d_bar = d/2 = 20), typed in from the paper:
# (dataset, k, trained) -> p_correct
LAYER20 = {
    ("SQUAD", 1, "N"): 0.3890, ("SQUAD", 1, "Y"): 0.5281, ("SQUAD", 3, "N"): 0.5404,
    ("SQUAD", 3, "Y"): 0.6837, ("SQUAD", 5, "N"): 0.6015, ("SQUAD", 5, "Y"): 0.7415,
    ("WMT", 1, "N"): 0.2163, ("WMT", 1, "Y"): 0.2917, ("WMT", 3, "N"): 0.3169,
    ("WMT", 3, "Y"): 0.4114, ("WMT", 5, "N"): 0.3713, ("WMT", 5, "Y"): 0.4784,
    ("CNN", 1, "N"): 0.3208, ("CNN", 1, "Y"): 0.4365, ("CNN", 3, "N"): 0.4636,
    ("CNN", 3, "Y"): 0.6060, ("CNN", 5, "N"): 0.5251, ("CNN", 5, "Y"): 0.6733,
}


def test_sec43_range_of_normalized_latency_and_compute() -> None:
    # Sec. 4.3: "normalized latency per token ranges from 0.629 (SQUAD+tr, k=5) to 0.892
    # (WMT, k=1)" and compute "can increase by a factor of 1.561 to nearly 4.973".
    lat = {key: approx_latency_per_token(p) for key, p in LAYER20.items()}
    comp = {key: approx_compute_per_time(key[1], p) for key, p in LAYER20.items()}
    assert min(lat, key=lat.get) == ("SQUAD", 5, "Y")
    assert max(lat, key=lat.get) == ("WMT", 1, "N")
    assert round(min(lat.values()), 3) == 0.629
    assert round(max(lat.values()), 3) == 0.892
    assert round(min(comp.values()), 3) == 1.561
    assert round(max(comp.values()), 3) == 4.973
    # "latency improvements of between 10.8% and 37.1%"
    assert round(100 * (1 - max(lat.values())), 1) == 10.8
    assert round(100 * (1 - min(lat.values())), 1) == 37.1


def test_fig3_caption_example() -> None:
    # Fig. 3: k=3, SQUAD with trained classifier: "latency can be reduced by 34% at the
    # expense of using 3.2 times more computational resources".
    p = LAYER20[("SQUAD", 3, "Y")]
    assert round(100 * (1 - approx_latency_per_token(p))) == 34
    assert 3.2 <= approx_compute_per_time(3, p) < 3.3


def test_eq6_is_product_of_eq3_and_eq5() -> None:
    for k, p in itertools.product((1, 3, 5), np.linspace(0, 0.99, 7)):
        prod = approx_latency_per_token(p) * approx_compute_per_time(k, p)
        assert approx_compute_per_token(k, p) == pytest.approx(prod)


def test_theorem_matches_exhaustive_expectation() -> None:
    # Exact expectation over all 2^(ell-1) match patterns, weighted by their probability,
    # with the mechanical timing of simulate_matches (independent of the closed form).
    for d, d_bar, k, ell, p in [(8, 4, 1, 5, 0.3), (10, 7, 3, 6, 0.8), (6, 3, 2, 1, 0.5),
                                (12, 12, 2, 4, 0.6)]:
        lat = comp = 0.0
        for pat in itertools.product((0, 1), repeat=ell - 1):
            w = float(np.prod([p if x else 1 - p for x in pat]))
            a, c = simulate_matches(np.array(pat, dtype=bool), d, d_bar, k)
            lat += w * a
            comp += w * c
        assert expected_latency(d, d_bar, k, ell, p) == pytest.approx(lat)
        assert expected_compute(d, d_bar, k, ell, p) == pytest.approx(comp)


def test_fig2_run_of_three() -> None:
    # Fig. 2: X = k = 3, p = 1: latency d + 2 d_bar; four resources busy for 3 (d - d_bar),
    # one resource the rest of the time.
    d, d_bar, k = 10, 6, 3
    lat, comp = simulate_matches(np.array([True, True]), d, d_bar, k)
    assert lat == d + 2 * d_bar
    assert comp == (lat - 3 * (d - d_bar)) + 4 * 3 * (d - d_bar)


def test_monte_carlo_agrees_with_theorem() -> None:
    d, d_bar, k, ell, p = 40, 24, 3, 64, 0.55
    mc = monte_carlo(d, d_bar, k, ell, p, runs=4000, seed=1)
    assert abs(mc["latency"] - expected_latency(d, d_bar, k, ell, p)) < 4 * mc["latency_se"]
    assert abs(mc["compute"] - expected_compute(d, d_bar, k, ell, p)) < 4 * mc["compute_se"]
    assert mc["latency_by_runs"] == pytest.approx(mc["latency"])  # proof's run accounting


def test_exact_tends_to_approximation_for_long_sequences() -> None:
    out = predict(40, 20, 5, 10**6, 0.7415)
    assert out["latency_per_token_normalized"] == pytest.approx(0.62925, abs=1e-5)
    assert out["compute_per_time_unit"] == pytest.approx((7 - 0.7415) / (2 - 0.7415), rel=1e-5)
    assert out["speedup"] == pytest.approx(1 / out["latency_per_token_normalized"])


def test_bad_inputs_say_what_to_change() -> None:
    with pytest.raises(PlanError, match="d/2 <= d_bar"):
        expected_latency(40, 10, 1, 8, 0.5)
    with pytest.raises(PlanError, match="--p-correct"):
        expected_latency(40, 20, 1, 8, 1.5)
    with pytest.raises(PlanError, match="--k"):
        expected_latency(40, 20, 0, 8, 0.5)
