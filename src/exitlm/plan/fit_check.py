"""Whether a TeraPipe cost model (Eq. 9, :class:`~exitlm.plan.terapipe.PerfModel`) can
support a plan, and how to show its times.

A profile measured on a busy or tiny workload can fit ``t_ctx`` so badly that the model
predicts slices that take no time at all (``t(l, c) <= 0``): the planner would then cut the
sequence into one-token slices at 0 s and report a meaningless speed-up. :func:`check_model`
refuses such a model with one line saying what is wrong and what to do; milder signs (a
context cost that falls as the context grows, a poor fit) are returned as warnings that the
plan's output shows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from exitlm.plan.cost_model import PlanError
from exitlm.plan.terapipe import PerfModel
from exitlm.table import number

#: what to do about a fit that cannot be planned on (the refusal's hint)
REFIT_HINT = ("profile again with more --repeats, a longer --seq-len, or on a quieter machine "
              "(timing noise swamps the measured differences)")
#: below this R^2 the fitted context cost is reported as poor
MIN_R2 = 0.5


def format_time(value: float, unit: str | None) -> str:
    """A time of the cost model with its unit: ``"1.23 ms"`` for profiles in seconds or
    milliseconds, ``"1.23 units"`` for a profile that names no unit."""
    if unit == "s":
        return f"{number(value * 1e3)} ms"
    if unit == "ms":
        return f"{number(value)} ms"
    return f"{number(value)} units"


def time_column(unit: str | None) -> tuple[str, float]:
    """The header and the factor of a time column (``"time (ms)"``, 1000 for seconds)."""
    if unit == "s":
        return "time (ms)", 1e3
    if unit == "ms":
        return "time (ms)", 1.0
    return "time (units)", 1.0


def parse_samples(raw: Any, where: str) -> list[tuple[int, int, float]]:
    """``[[i, j, t_ctx], ...]`` from a profile's ``measured.ctx_samples``."""
    out = []
    for k, row in enumerate(raw if isinstance(raw, list) else [None]):
        ok = (isinstance(row, (list, tuple)) and len(row) == 3
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row))
        if not ok or not math.isfinite(float(row[2])):
            raise PlanError(f"{where}: measured.ctx_samples[{k}] must be [i, j, t_ctx] "
                            f"numbers, got {row!r}")
        out.append((int(row[0]), int(row[1]), float(row[2])))
    return out


def ctx_fit_r2(samples: Sequence[tuple[int, int, float]],
               coef: Sequence[float]) -> float | None:
    """R^2 of ``t_ctx(i, j) = a0 + a1 i + a2 j + a3 i j`` on the measured samples with
    ``j > 0``; ``None`` when there are too few samples or they do not vary."""
    rows = [(i, j, t) for i, j, t in samples if j > 0]
    if len(rows) < 5:
        return None
    a0, a1, a2, a3 = coef
    y = np.array([t for _, _, t in rows])
    pred = np.array([a0 + a1 * i + a2 * j + a3 * i * j for i, j, _ in rows])
    total = float(np.sum((y - y.mean()) ** 2))
    if total <= 0:
        return None
    return 1.0 - float(np.sum((y - pred) ** 2)) / total


def check_model(pm: PerfModel, where: str, unit: str | None = None,
                samples: Sequence[tuple[int, int, float]] | None = None) -> list[str]:
    """Refuse (:class:`PlanError`) a cost model whose predictions over the plan's domain
    (``l >= 1``, ``l + c <= L``) are non-finite or ``<= 0``; return warnings for a context
    cost predicted negative somewhere and for a poor ``t_ctx`` fit (R^2 < :data:`MIN_R2`)."""
    n = pm.seq_len
    a0, a1, a2, a3 = pm.ctx_coef
    ln = np.arange(1, n + 1, dtype=np.float64)[:, None]
    cx = np.arange(0, n, dtype=np.float64)[None, :]
    valid = ln + cx <= n
    ctx = np.where(cx > 0, a0 + a1 * ln + a2 * cx + a3 * ln * cx, 0.0)
    t = np.asarray(pm.t_noctx)[:, None] + ctx
    coef = ", ".join(f"a{k}={c:.3g}" for k, c in enumerate(pm.ctx_coef))
    if not np.all(np.isfinite(t[valid])):
        raise PlanError(f"{where}: the cost model predicts non-finite slice times "
                        f"(ctx_coef {coef}); no plan can be made from it", hint=REFIT_HINT)
    bad = valid & (t <= 0)
    if bad.any():
        li, ci = np.unravel_index(np.argmin(np.where(valid, t, np.inf)), t.shape)
        raise PlanError(
            f"{where}: the fitted cost model predicts slice times <= 0 for "
            f"{int(bad.sum()):,} of {int(valid.sum()):,} (tokens, context) pairs, e.g. "
            f"t({li + 1} tokens, {ci} context) = {format_time(float(t[li, ci]), unit)} "
            f"(t_noctx and ctx_coef {coef}); a plan on it would be meaningless",
            hint=REFIT_HINT)
    warnings = []
    neg = valid & (cx > 0) & (ctx < 0)
    if neg.any():
        share = neg.sum() / (valid & (cx > 0)).sum()
        warnings.append(
            f"the fitted context cost t_ctx is negative for {round(100 * share)}% of the "
            f"(tokens, context) pairs ({coef}): more context is predicted to be faster, so the "
            "measured context cost is within timing noise")
    r2 = ctx_fit_r2(samples, pm.ctx_coef) if samples else None
    if r2 is not None and r2 < MIN_R2:
        warnings.append(f"the t_ctx fit is poor (R^2 = {r2:.2f} on {len(samples or [])} "
                        "measurements); " + REFIT_HINT)
    return warnings


def check_plan(res: dict[str, Any], unit: str | None) -> None:
    """Refuse a plan whose latency, slice times or bottleneck are not finite and positive
    (never print such a plan as a result)."""
    times = [float(x) for x in res["slice_times"]]
    values = [float(res["latency"]), float(res["tmax"]), *times]
    if not res["slices"] or not all(math.isfinite(v) and v > 0 for v in values):
        shown = ", ".join(format_time(v, unit) for v in values[:4])
        raise PlanError(f"the planned slicing has non-finite or non-positive times "
                        f"(latency, t_max, slice times: {shown}...); the cost model cannot "
                        "support a plan", hint=REFIT_HINT)
