"""A steady clock for TeraPipe's profiler: ``exitlm plan terapipe --model`` times real layers,
and on a loaded CI machine timing noise can make the fitted cost model predict slice times
<= 0, which the command rightly refuses. Tests of the command's path (profiling, fitting,
planning, saving) patch ``exitlm.plan.profile._median_time`` with :func:`steady_median_time`
so that their outcome does not depend on the machine's load."""

from __future__ import annotations

from collections.abc import Callable

BASE_S, PER_TOKEN_S, PER_CONTEXT_S, CROSS_S = 1e-4, 2e-5, 2e-6, 1e-8


def steady_median_time(fn: Callable[[], object], repeats: int) -> float:
    """Run ``fn`` once (the real code path) and return the time a steady machine would take:
    ``fn`` is the profiler's ``step`` (a slice of ``len(h)`` tokens after ``j`` of context) or
    ``ctx_only`` (the ``j`` context tokens alone), read from its closure."""
    fn()
    cells = dict(zip(fn.__code__.co_freevars,
                     (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    j = int(cells["j"])
    context = PER_CONTEXT_S * j
    if "h" not in cells:  # ctx_only
        return context
    i = int(cells["h"].shape[1])
    return BASE_S + PER_TOKEN_S * i + context + CROSS_S * i * j
