"""Latency / compute theory of Predictive Pipelined Decoding (PPD Sec. 4).

Time is counted in "time units" = one transformer layer (PPD Sec. 4.1); compute in
compute-unit x time-unit. A model has ``d`` layers; the early prediction is made at layer
``d_bar`` (``d/2 <= d_bar <= d``); ``k`` sub-processes check the top-``k`` candidates;
``ell`` tokens are generated; each early prediction is correct (one of the top-``k`` equals
the final top-1) independently with probability ``p`` (``p_correct``).
"""

from __future__ import annotations

import math

import numpy as np

from exitlm.plan.cost_model import PlanError


def _check(d: int, d_bar: float, k: int, ell: int, p: float) -> None:
    if d < 1:
        raise PlanError(f"--layers (d) must be >= 1, got {d}")
    if not d / 2 <= d_bar <= d:
        raise PlanError(f"--exit-layer (d_bar) must satisfy d/2 <= d_bar <= d (Theorem 4.1), "
                        f"got d_bar={d_bar} for d={d}")
    if k < 1:
        raise PlanError(f"--k (number of sub-processes) must be >= 1, got {k}")
    if ell < 1:
        raise PlanError(f"--tokens (ell) must be >= 1, got {ell}")
    if not 0.0 <= p <= 1.0 or math.isnan(p):
        raise PlanError(f"--p-correct must be a probability in [0, 1], got {p}")


def expected_latency(d: int, d_bar: float, k: int, ell: int, p: float) -> float:
    """PPD Theorem 4.1: ``E[latency] = d ell - (d - d_bar)(ell - 1) p`` time units."""
    _check(d, d_bar, k, ell, p)
    return d * ell - (d - d_bar) * (ell - 1) * p


def expected_compute(d: int, d_bar: float, k: int, ell: int, p: float) -> float:
    """PPD Theorem 4.1: ``E[compute] = d ell - (d - d_bar)(ell - 1) p + k (d - d_bar) ell``."""
    return expected_latency(d, d_bar, k, ell, p) + k * (d - d_bar) * ell


def approx_latency_per_token(p: float) -> float:
    """PPD Eq. 3 (``ell >> 1``, ``d_bar = d/2``): per-token latency ``/ d`` = ``1 - p/2``."""
    return 1.0 - p / 2.0


def approx_compute_per_time(k: int, p: float) -> float:
    """PPD Eq. 5: average compute units in use per time unit ``(k + 2 - p) / (2 - p)``."""
    return (k + 2.0 - p) / (2.0 - p)


def approx_compute_per_token(k: int, p: float) -> float:
    """PPD Eq. 6: compute per token ``/ d`` = Eq. 3 x Eq. 5 = ``(2 + k - p) / 2``."""
    return (2.0 + k - p) / 2.0


def predict(d: int, d_bar: float, k: int, ell: int, p: float) -> dict[str, float]:
    """Everything the CLI reports: exact (Theorem 4.1) and approximate (Eq. 3, 5, 6) values.

    Normalised quantities compare with plain greedy decoding, which takes ``d`` time units
    and ``d`` compute per token with one compute unit busy.
    """
    lat = expected_latency(d, d_bar, k, ell, p)
    comp = expected_compute(d, d_bar, k, ell, p)
    return {
        "latency": lat,
        "compute": comp,
        "baseline_latency": float(d * ell),
        "latency_per_token_normalized": lat / (d * ell),
        "compute_per_time_unit": comp / lat,
        "compute_per_token_normalized": comp / (d * ell),
        "speedup": d * ell / lat,
        "extra_compute": comp / (d * ell) - 1.0,
        "approx_latency_per_token_normalized": approx_latency_per_token(p),
        "approx_compute_per_time_unit": approx_compute_per_time(k, p),
        "approx_compute_per_token_normalized": approx_compute_per_token(k, p),
        # Eq. 3 generalised to any d_bar (same law-of-large-numbers step): d - (d - d_bar) p
        "approx_latency_per_token_normalized_dbar": 1.0 - (d - d_bar) / d * p,
    }


def simulate_matches(matches: np.ndarray, d: int, d_bar: float, k: int) -> tuple[float, float]:
    """Latency and compute of one PPD generation from its per-token match outcomes.

    ``matches[t]`` (``t = 0..ell-2``) says whether token ``t+1`` was among the top-``k``
    early predictions made while generating token ``t``. Mechanics (PPD Sec. 3, Fig. 2):
    token ``t`` starts at ``s_t``; its early prediction is ready at ``s_t + d_bar``, its final
    output at ``s_t + d``. On a match the sub-process that started at ``s_t + d_bar`` already
    computes token ``t+1``: ``s_{t+1} = s_t + d_bar``; otherwise ``s_{t+1} = s_t + d``. The
    main process is busy throughout; ``k`` sub-processes run over ``[s_t + d_bar, s_t + d]``
    for every token. Runs are maximal stretches of matches (PPD Sec. 4.1).
    """
    matches = np.asarray(matches, dtype=bool)
    ell = matches.size + 1
    starts = np.concatenate([[0.0], np.cumsum(np.where(matches, d_bar, d))])
    latency = float(starts[-1] + d)
    compute = latency + k * (d - d_bar) * ell
    return latency, compute


def monte_carlo(d: int, d_bar: float, k: int, ell: int, p: float, runs: int = 10000,
                seed: int = 0) -> dict[str, float]:
    """Monte-Carlo estimate of PPD's latency and compute: ``runs`` generations with i.i.d.
    Bernoulli(``p``) matches, each timed by :func:`simulate_matches`, plus the run-length
    accounting of the proof of Theorem 4.1 (``T_X = d + (X-1) d_bar`` per run of length
    ``X``). Returns means and standard errors."""
    _check(d, d_bar, k, ell, p)
    rng = np.random.default_rng(seed)
    m = rng.random((runs, ell - 1)) < p  # (runs, ell-1)
    lat = np.empty(runs)
    comp = np.empty(runs)
    by_runs = np.empty(runs)
    for r in range(runs):
        lat[r], comp[r] = simulate_matches(m[r], d, d_bar, k)
        # runs: a failure ends a run; N = 1 + #failures, X_i the run lengths
        cuts = np.flatnonzero(~m[r]) + 1
        lengths = np.diff(np.concatenate([[0], cuts, [ell]]))
        by_runs[r] = float(np.sum(d + (lengths - 1) * d_bar))
    se = math.sqrt(max(float(lat.var(ddof=1)) if runs > 1 else 0.0, 0.0) / runs)
    return {"latency": float(lat.mean()), "latency_se": se,
            "compute": float(comp.mean()),
            "compute_se": math.sqrt(float(comp.var(ddof=1)) / runs) if runs > 1 else 0.0,
            "latency_by_runs": float(by_runs.mean()), "runs": runs}
