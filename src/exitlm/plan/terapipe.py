"""TeraPipe's token-slicing planner (TeraPipe Sec. 3.3-3.4).

Given the time ``t(l, c)`` of one pipeline stage on a slice of ``l`` tokens that attends to
``c`` earlier tokens, choose slice lengths ``l_1 + ... + l_M = L`` minimising the pipeline
latency of Eq. 5, ``sum_i t_i + (K - 1) max_j t_j``, for ``K`` stages.

* :class:`PerfModel` - Eq. 9, ``t(i, j) = t(i, 0) + t_ctx(i, j)`` with the fitted
  ``t_ctx(i, j) = a0 + a1 i + a2 j + a3 i j`` for ``j > 0`` and ``t_ctx(i, 0) = 0``;
* :func:`solve_tmax` - Algorithm 1 / Eq. 7-8 for a batch of ``t_max`` values at once;
* :func:`plan_slices` - Eq. 6: enumerate ``t_max`` from small to large with the early stop
  ``K t_max >= best`` and the ``eps`` spacing (``method="enumerate"``, the paper's), or an
  exact branch-and-bound over the same candidates (``method="bisect"``, uses that
  ``S*(L; t_max)`` is non-increasing in ``t_max``);
* :func:`plan_batch` - Sec. 3.4: a slicing per batch size, then a 1-D knapsack over batch
  splits ``b_1 + ... + b_D = B``.

Cost matrices are indexed ``cost[l, c]`` (slice length ``l >= 1``, context ``c``), valid for
``l + c <= L``; times are in any unit (the profile's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exitlm.plan.cost_model import PlanError


@dataclass(frozen=True)
class PerfModel:
    """TeraPipe Eq. 9 for one stage: ``t_noctx[i-1] = t(i, 0)`` for ``i = 1..L`` and
    ``ctx_coef = (a0, a1, a2, a3)``."""

    t_noctx: tuple[float, ...]
    ctx_coef: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        t = tuple(float(x) for x in self.t_noctx)
        if not t:
            raise PlanError("t_noctx is empty; give t(i, 0) for every slice length i = 1..L")
        if any(not math.isfinite(x) or x < 0 for x in t):
            raise PlanError("t_noctx entries must be finite and >= 0")
        c = tuple(float(x) for x in self.ctx_coef)
        if len(c) != 4 or any(not math.isfinite(x) for x in c):
            raise PlanError(f"ctx_coef must be 4 finite numbers [a0, a1, a2, a3], got {c}")
        object.__setattr__(self, "t_noctx", t)
        object.__setattr__(self, "ctx_coef", c)

    @property
    def seq_len(self) -> int:
        return len(self.t_noctx)

    def t(self, length: int, ctx: int) -> float:
        """``t_fwd(length, ctx)`` of Eq. 9."""
        a0, a1, a2, a3 = self.ctx_coef
        extra = a0 + a1 * length + a2 * ctx + a3 * length * ctx if ctx > 0 else 0.0
        return self.t_noctx[length - 1] + extra

    def matrix(self) -> np.ndarray:
        """``cost[l, c]`` ``(L+1, L+1)``; ``inf`` where ``l = 0`` or ``l + c > L``.

        Negative model predictions (a badly fitted ``t_ctx``) are clipped to 0."""
        n = self.seq_len
        a0, a1, a2, a3 = self.ctx_coef
        ln = np.arange(n + 1, dtype=np.float64)[:, None]
        cx = np.arange(n + 1, dtype=np.float64)[None, :]
        base = np.concatenate([[0.0], np.asarray(self.t_noctx)])[:, None]
        ctx = np.where(cx > 0, a0 + a1 * ln + a2 * cx + a3 * ln * cx, 0.0)
        cost = np.maximum(base + ctx, 0.0)
        cost[(ln + cx > n) | (ln == 0)] = np.inf
        return cost


def fit_ctx_coef(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """Least-squares fit of ``t_ctx(i, j) = a0 + a1 i + a2 j + a3 i j`` (TeraPipe Eq. 9) to
    measured ``(i, j, t_fwd(i, j) - t_fwd(i, 0))`` with ``j > 0``."""
    rows = [(i, j, t) for i, j, t in samples if j > 0]
    if len(rows) < 4:
        raise PlanError(f"fitting t_ctx needs >= 4 samples with context j > 0, got {len(rows)}")
    a = np.array([[1.0, i, j, i * j] for i, j, _ in rows])
    y = np.array([t for _, _, t in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))


def _by_end(cost: np.ndarray) -> np.ndarray:
    """``E[e, m] = cost[e - m, m]``: a slice covering tokens ``(m, e]``; ``inf`` if ``m >= e``."""
    n = cost.shape[0] - 1
    e = np.arange(n + 1)[:, None]
    m = np.arange(n + 1)[None, :]
    ln = np.clip(e - m, 0, n)
    out = cost[ln, m]
    out[m >= e] = np.inf
    return out


def _check_cost(cost: np.ndarray) -> np.ndarray:
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[0] != cost.shape[1] or cost.shape[0] < 2:
        raise PlanError(f"cost must be a square (L+1, L+1) matrix, got shape {cost.shape}")
    return cost


def solve_tmax(cost: np.ndarray, tmax: Sequence[float] | np.ndarray,
               _by_end_cache: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """TeraPipe Algorithm 1 (Eq. 8) for several ``t_max`` at once.

    ``S*(e; t_max) = min_{1<=k<=e} S*(e-k; t_max) + t(k, e-k)`` over slices with
    ``t(k, e-k) <= t_max``. Returns ``S ((n_t, L+1))`` (``inf``: infeasible) and the last
    slice length ``q ((n_t, L+1))`` for back-tracking.
    """
    cost = _check_cost(cost)
    ends = _by_end(cost) if _by_end_cache is None else _by_end_cache
    n = cost.shape[0] - 1
    tm = np.asarray(tmax, dtype=np.float64).reshape(-1)
    s = np.full((tm.size, n + 1), np.inf)
    s[:, 0] = 0.0
    q = np.zeros((tm.size, n + 1), dtype=np.int64)
    rows = np.arange(tm.size)
    for e in range(1, n + 1):
        c = ends[e, :e]  # (e,) cost of the slice (m, e] for m = 0..e-1
        v = np.where(c[None, :] <= tm[:, None], s[:, :e] + c[None, :], np.inf)  # (n_t, e)
        m = np.argmin(v, axis=1)
        s[:, e] = v[rows, m]
        q[:, e] = e - m
    return s, q


def _backtrack(q: np.ndarray, n: int) -> list[int]:
    out: list[int] = []
    e = n
    while e > 0:
        out.append(int(q[e]))
        e -= int(q[e])
    return out[::-1]


def slicing_latency(cost: np.ndarray, slices: Sequence[int], stages: int) -> float:
    """TeraPipe Eq. 5 for a given slicing: ``sum t_i + (K-1) max t_i``."""
    ts = slice_times(cost, slices)
    return float(sum(ts) + (stages - 1) * max(ts))


def slice_times(cost: np.ndarray, slices: Sequence[int]) -> list[float]:
    """``t_i = t(l_i, l_1 + ... + l_{i-1})`` (TeraPipe Eq. 4)."""
    out, c = [], 0
    for ln in slices:
        out.append(float(cost[int(ln), c]))
        c += int(ln)
    return out


def uniform_slicing(seq_len: int, num_slices: int) -> list[int]:
    """``num_slices`` near-equal slices (the first ``L mod n`` one token longer)."""
    q, r = divmod(seq_len, num_slices)
    return [q + 1] * r + [q] * (num_slices - r)


def best_uniform(cost: np.ndarray, stages: int) -> dict[str, object]:
    """The best uniform slicing over ``n = 1..L`` slices (TeraPipe Sec. 4.2 baseline).

    Every count's slice times are looked up at once (``L^2 / 2`` lookups in all, no Python
    loop over slices); the chosen slicing's latency is :func:`slicing_latency`'s."""
    cost = _check_cost(cost)
    n = cost.shape[0] - 1
    best_k, best_lat = 0, math.inf
    for k in range(1, n + 1):
        q, r = divmod(n, k)
        idx = np.arange(k)
        lengths = np.where(idx < r, q + 1, q)  # uniform_slicing(n, k)
        times = cost[lengths, idx * q + np.minimum(idx, r)]  # t(l_i, l_1 + ... + l_{i-1})
        lat = float(times.sum() + (stages - 1) * times.max())
        if lat < best_lat:
            best_k, best_lat = k, lat
    if best_k == 0:
        return {"latency": math.inf}
    sl = uniform_slicing(n, best_k)
    return {"latency": slicing_latency(cost, sl, stages), "slices": sl, "num_slices": best_k}


MAX_DP_WORK = 15_000_000_000
"""The most work one plan may take, in DP cells (a slice end ``e`` and start ``m`` for one
``t_max``; :class:`DPBudget`): about a minute here. The paper's enumeration with
``epsilon = 0`` evaluates up to every distinct ``t(l, c)`` - ``L^2 / 2`` values - at
``L^2 / 2`` cells each, which is hours from a few thousand tokens on; the bisection needs a
few dozen evaluations."""

_CALL_CELLS = 4000
"""The fixed cost of one step ``e`` of :func:`solve_tmax` (a few numpy calls), in cells."""


class DPBudget:
    """The work left to a plan (:data:`MAX_DP_WORK` by default), shared by the plans of a
    joint batch plan: an evaluation that would overspend it is refused before it runs."""

    def __init__(self, cells: int | None = None) -> None:
        self.limit = MAX_DP_WORK if cells is None else cells
        self.left = self.limit

    def spend(self, rows: int, seq_len: int, done: int) -> None:
        """Account for :func:`solve_tmax` over ``rows`` values of ``t_max``; ``done``: the
        evaluations made so far (for the message)."""
        need = rows * seq_len * (seq_len + 1) // 2 + seq_len * _CALL_CELLS
        if need > self.left:
            raise PlanError(
                f"TeraPipe planning of {seq_len:,} tokens stopped after {done:,} dynamic-"
                f"program evaluations: more would take over {self.limit:,} DP cells "
                "(minutes to hours)",
                hint="use --method bisect (the default: a few dozen evaluations), a larger "
                     "--epsilon with --method enumerate, or a shorter --seq-len")
        self.left -= need


def plan_slices(cost: np.ndarray, stages: int, epsilon: float = 0.0,
                method: str = "enumerate", batch: int = 32,
                budget: DPBudget | None = None) -> dict[str, object]:
    """Optimal slicing for ``stages`` (K) stages, TeraPipe Eq. 6 over Algorithm 1.

    Candidates for ``t_max`` are the distinct values ``t(l, c)``, from the smallest feasible
    one (the min-max slicing) upwards. ``enumerate`` evaluates them in increasing order
    (``batch`` at a time), skipping values within ``epsilon`` of the last evaluated one, and
    stops once ``K t_max >= best`` (TeraPipe Sec. 3.3 "Optimization"; also once
    ``S*(L; inf) + (K-1) t_max >= best``, an equally valid bound). ``bisect`` prunes
    intervals of candidates with ``S*(L; hi) + (K-1) lo >= best`` or ``S*(lo) = S*(hi)``.
    Both return the optimum for ``epsilon = 0``; with ``epsilon > 0`` the result is within
    ``K epsilon`` of it. ``budget`` bounds the work (:class:`DPBudget`; a
    :class:`PlanError` when spent). Returns slices, latency (Eq. 5), slice times and
    counters.
    """
    cost = _check_cost(cost)
    if stages < 1:
        raise PlanError(f"--stages (K) must be >= 1, got {stages}")
    if epsilon < 0:
        raise PlanError(f"--epsilon must be >= 0, got {epsilon}")
    n = cost.shape[0] - 1
    ends = _by_end(cost)
    finite = cost[np.isfinite(cost)]
    if finite.size == 0:
        raise PlanError("the cost table has no finite entry")
    cand = np.unique(finite)  # sorted ascending
    # smallest feasible t_max: the min-max slicing (bottleneck DP)
    bott = np.full(n + 1, np.inf)
    bott[0] = -np.inf
    for e in range(1, n + 1):
        bott[e] = np.min(np.maximum(bott[:e], ends[e, :e]))
    cand = cand[cand >= bott[n]]
    state = {"evals": 0, "best": math.inf, "slices": [], "tmax": math.nan}
    budget = DPBudget() if budget is None else budget

    def evaluate(tms: np.ndarray) -> np.ndarray:
        budget.spend(len(tms), n, int(state["evals"]))
        s, q = solve_tmax(cost, tms, ends)
        state["evals"] += len(tms)
        for r in range(len(tms)):
            if not np.isfinite(s[r, n]):
                continue
            sl = _backtrack(q[r], n)
            lat = slicing_latency(cost, sl, stages)
            if lat < state["best"]:
                state.update(best=lat, slices=sl, tmax=float(tms[r]))
        return s[:, n]

    s_inf = float(evaluate(np.array([np.inf]))[0])
    if method == "enumerate":
        i, last = 0, -math.inf
        while i < len(cand):
            pick: list[float] = []
            while i < len(cand) and len(pick) < batch:
                t = float(cand[i])
                i += 1
                if t < last + epsilon:
                    continue
                if stages * t >= state["best"] or s_inf + (stages - 1) * t >= state["best"]:
                    i = len(cand)
                    break
                pick.append(t)
                last = t
            if pick:
                evaluate(np.array(pick))
    elif method == "bisect":
        if epsilon > 0:
            grid, last = [], -math.inf
            for t in cand:
                if t >= last + epsilon:
                    grid.append(t)
                    last = t
            cand = np.array(grid)
        lo_s = evaluate(cand[:1])[0]
        hi = int(np.searchsorted(cand, state["best"] / stages, side="left"))
        hi = max(1, min(hi, len(cand)))
        vals = {0: float(lo_s)}
        if hi - 1 > 0:
            vals[hi - 1] = float(evaluate(cand[hi - 1:hi])[0])
        work = [(0, hi - 1)] if hi - 1 > 0 else []
        while work:
            live = [(a, b) for a, b in work
                    if b - a > 1 and vals[a] != vals[b]
                    and vals[b] + (stages - 1) * cand[a] < state["best"]]
            if not live:
                break
            mids = sorted({(a + b) // 2 for a, b in live} - set(vals))
            for k in range(0, len(mids), batch):
                chunk = mids[k:k + batch]
                for mi, v in zip(chunk, evaluate(cand[chunk]), strict=True):
                    vals[mi] = float(v)
            work = [x for a, b in live for x in ((a, (a + b) // 2), ((a + b) // 2, b))]
    else:
        raise PlanError(f"unknown method {method!r}; use 'enumerate' or 'bisect'")
    sl = state["slices"]
    times = slice_times(cost, sl)
    # t_max of the result is its slowest slice (the t_max searched for it may be inf: the
    # unconstrained DP's answer)
    return {"slices": sl, "latency": state["best"], "tmax": max(times, default=math.nan),
            "slice_times": times, "num_slices": len(sl),
            "dp_evaluations": state["evals"], "candidates": len(cand)}


def plan_batch(costs: Sequence[np.ndarray], batch_size: int, stages: int,
               epsilon: float = 0.0, method: str = "enumerate") -> dict[str, object]:
    """Joint batch x token slicing, TeraPipe Sec. 3.4.

    ``costs[b-1]`` is the cost matrix for a batch split of ``b`` sequences, ``b = 1..B``.
    Runs :func:`plan_slices` per ``b`` to get ``T_b``, then a 1-D (unbounded) knapsack picks
    ``b_1 + ... + b_D = B`` minimising ``sum_d T_{b_d}``. Also reports the latency of
    running all splits' slices back to back in one pipeline, ``sum t + (K-1) max t``.
    """
    if batch_size < 1 or len(costs) < batch_size:
        raise PlanError(f"need a cost table for every batch size 1..{batch_size}, "
                        f"got {len(costs)}")
    budget = DPBudget()  # one budget for the whole joint plan
    per_b = [plan_slices(costs[b], stages, epsilon, method, budget=budget)
             for b in range(batch_size)]
    t_b = [float(p["latency"]) for p in per_b]  # type: ignore[arg-type]
    best = [0.0] + [math.inf] * batch_size
    choice = [0] * (batch_size + 1)
    for x in range(1, batch_size + 1):
        for b in range(1, x + 1):
            v = best[x - b] + t_b[b - 1]
            if v < best[x]:
                best[x], choice[x] = v, b
    splits, x = [], batch_size
    while x > 0:
        splits.append(choice[x])
        x -= choice[x]
    splits.sort(reverse=True)
    times = [t for b in splits for t in per_b[b - 1]["slice_times"]]  # type: ignore[union-attr]
    return {"batch_splits": splits,
            "slices": [per_b[b - 1]["slices"] for b in splits],
            "latency": best[batch_size],
            "pipelined_latency": float(sum(times) + (stages - 1) * max(times)),
            "per_batch_latency": t_b}
