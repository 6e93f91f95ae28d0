"""What a runner's primitives cost on this machine: seconds measured on a scratch cache.

A strategy that chooses how to decode from speed - adaptive self-speculation choosing its exit
and draft length (:mod:`exitlm.infer.adaptive`) - needs the price of the calls it may make
before it has made them. :class:`PrimitiveCosts` times the runner's own primitives on a cache of
its own, once per shape, and keeps the results:

* for one sequence, the calls exactly as a decoder makes them - a chain of ``n`` steps through
  ``depth`` layers (:meth:`~exitlm.runtime.runner.Runner.chain`: a plain step, or drafting),
  layers ``[start, L)`` over ``r`` positions (:meth:`~exitlm.runtime.runner.Runner.layers`:
  verification), a head over ``r`` positions - since a fused native call costs far less than
  its layers one by one;
* for ``b > 1`` sequences, one layer and one head over ``R`` rows, from which a caller builds
  its step (the eager products of a batch cost about their layers' sum).

Sizes between two measured ones are interpolated (chains linearly in ``n``, rows between powers
of two). Measuring never touches a caller's cache or the model.

Only a runner whose primitives run in this process alone may be timed this way (a
tensor-parallel shard's products pair with other ranks' calls):
:meth:`~exitlm.runtime.runner.Runner.supports` ``("local")``.

The timings outlive the process: they are read from, and written to, exitlm's cache
(:mod:`exitlm.runtime.cost_store`), keyed by the machine, the kernels, the thread count and the
model's shapes, so that a new process on the same machine does not time them again.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from exitlm.model.kv_cache import KVCache
from exitlm.runtime import cost_store
from exitlm.runtime.runner import Runner

CONTEXT = 64
"""Tokens already in the scratch cache when a primitive is timed (attention reads them)."""
MAX_ROWS = 64
"""The most positions one timed call holds (larger shapes are extrapolated linearly)."""
CHAIN_POINTS = (1, 8)
"""Chain lengths timed per depth; other lengths are interpolated (or extrapolated) linearly."""
REPEATS = 5
"""The most calls timed per shape (the fastest is kept: the first may pack or allocate)."""
SLOW_CALL_S = 0.02
"""Calls of a shape are repeated while they took less than this together (at least two)."""


class PrimitiveCosts:
    """Seconds of a runner's primitives by shape, measured on first use (see the module
    docstring)."""

    def __init__(self, runner: Runner) -> None:
        if not runner.supports("local"):
            raise ValueError("PrimitiveCosts times primitives in this process; this runner's "
                             "calls pair with other processes")
        self._runner: Callable[[], Runner | None] = lambda: runner  # weak once bound
        self.num_layers = runner.num_layers
        self._seen: dict[tuple[object, ...], float] = {}
        self._derived: dict[tuple[object, ...], tuple[int, Any]] = {}
        """Fits and lists derived from :attr:`_seen`, with the number of timings they saw
        (timings are only added: a planner asks for them thousands of times a generation)."""
        self._cache: KVCache | None = None
        self.measured_s = 0.0
        """Wall time spent measuring so far."""
        self.learned: dict[object, dict] = {}
        """What callers learned of the runner's speed while decoding (an adaptive planner's
        measured step and round times), kept with the costs for the runner's later engines."""
        self._store: str | None = None
        """The name of these timings in exitlm's cache (:mod:`~exitlm.runtime.cost_store`),
        None when they are not kept there."""
        self._stored = 0
        """How many of :attr:`_seen` the cache holds already."""
        if cost_store.enabled():
            self._store = cost_store.store_key(runner, _kind(runner))
            self._seen.update(cost_store.load(self._store))
            self._stored = len(self._seen)

    def persist(self) -> None:
        """Write the timings to exitlm's cache when some were taken since they were read
        (:mod:`~exitlm.runtime.cost_store`; nothing when that is switched off)."""
        if (self._store is not None and len(self._seen) > self._stored
                and cost_store.save(self._store, self._seen)):
            self._stored = len(self._seen)

    @property
    def runner(self) -> Runner:
        """The runner these costs time (the latest one :func:`costs_of` was asked about)."""
        runner = self._runner()
        if runner is None:
            raise RuntimeError("the runner these costs measured is gone")
        return runner

    def bind(self, runner: Runner) -> None:
        """Time ``runner`` from now on, holding it weakly: another runner of the same model
        and kind (a new ``generate(model, ...)`` call prepares one), whose primitives cost the
        same."""
        old = self._runner()
        if runner is not old:
            if old is not None and self._cache is not None:
                old.release(self._cache)
            self._cache = None
        self._runner = weakref.ref(runner)

    # ----- one sequence: the calls as decoders make them ---------------------------------------
    def chain(self, depth: int, n: int, vocab: int | None = None) -> float:
        """Seconds of one sequence's chain of ``n`` steps through ``depth`` layers, drafting
        from exit ``depth`` over the first ``vocab`` ids (``n = 0, depth = L``: a plain step,
        the final head included).

        Chains are timed at :data:`CHAIN_POINTS` lengths for every depth asked about; once
        two depths are known, all of them are read off one least-squares fit
        ``c + (n + 1) depth l + n h`` (a call, a layer step, a head), which keeps the noise
        of single timings from ranking one depth above another."""
        if n == 0:
            return self._get(("chain", depth, 0, vocab), lambda: self._time_chain(depth, 0, vocab))
        for m in CHAIN_POINTS:
            self._get(("chain", depth, m, vocab), lambda m=m: self._time_chain(depth, m, vocab))
        fit = self._chain_fit(vocab)
        if fit is not None:
            c, per_layer, head = fit
            return max(0.0, c + (n + 1) * depth * per_layer + n * head)
        lo, hi = CHAIN_POINTS
        t_lo, t_hi = (self._seen[("chain", depth, m, vocab)] for m in (lo, hi))
        return max(0.0, t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo))

    def layers(self, start: int, positions: int) -> float:
        """Seconds of layers ``[start, L)`` over ``positions`` positions of one sequence; once
        two starts were timed at a size, one line ``a + (L - start) b`` fitted per size."""
        raw = self._rows(("layers", start), positions,
                         lambda r: self._time_layers(start, self.num_layers, r))
        sizes = self._memo(("sizes", start), lambda: sorted(
            {k[2] for k in self._seen if k[0] == "layers" and k[1] == start}))
        lo = max((r for r in sizes if r <= positions), default=None)
        hi = min((r for r in sizes if r >= positions), default=None)
        if lo is None or hi is None:
            return raw
        t_lo, t_hi = self._layers_line(lo, start), self._layers_line(hi, start)
        if t_lo is None or t_hi is None:
            return raw
        return t_lo if hi == lo else t_lo + (t_hi - t_lo) * (positions - lo) / (hi - lo)

    def _memo(self, key: tuple[object, ...], derive: Callable[[], Any]) -> Any:
        """``derive()``, computed again only once more timings were taken."""
        got = self._derived.get(key)
        if got is None or got[0] != len(self._seen):
            got = self._derived[key] = (len(self._seen), derive())
        return got[1]

    def _chain_fit(self, vocab: int | None) -> tuple[float, float, float] | None:
        return self._memo(("chain_fit", vocab), lambda: self._fit_chain(vocab))

    def _fit_chain(self, vocab: int | None) -> tuple[float, float, float] | None:
        pts = [(k[1], k[2], t) for k, t in self._seen.items()
               if k[0] == "chain" and k[3] == vocab and k[2] > 0]
        if len({d for d, _, _ in pts}) < 2:
            return None
        x = torch.tensor([[1.0, (n + 1) * d, n] for d, n, _ in pts], dtype=torch.float64)
        y = torch.tensor([t for _, _, t in pts], dtype=torch.float64)
        sol = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
        if sol[1] <= 0 or sol[2] < 0:  # not the shape of a chain: keep the timings
            return None
        return sol[0], sol[1], sol[2]

    def _layers_line(self, rows: int, start: int) -> float | None:
        line = self._memo(("layers_line", rows), lambda: fit_line(
            [(self.num_layers - k[1], t) for k, t in self._seen.items()
             if k[0] == "layers" and k[2] == rows]))
        if line is None or line[1] <= 0:
            return None
        a, b = line
        return max(0.0, a + b * (self.num_layers - start))

    # ----- any batch: per layer and per head -----------------------------------------------------
    def layer(self, rows: int) -> float:
        """Seconds of one layer over ``rows`` rows (one position of each of ``rows``
        sequences, or ``rows`` positions of one)."""
        return self._rows(("layer",), rows,
                          lambda r: self._time_layers(0, self.num_layers, r) / self.num_layers)

    def head(self, layer: int, rows: int, vocab: int | None = None) -> float:
        """Seconds of exit ``layer``'s head (``L``: the final head) for ``rows`` positions
        over the first ``vocab`` token ids (default: all)."""
        return self._rows(("head", layer, vocab), rows,
                          lambda r: self._time_head(layer, r, vocab))

    def close(self) -> None:
        """Drop the scratch cache."""
        if self._cache is not None:
            self.runner.release(self._cache)
        self._cache = None

    # ----- measuring ------------------------------------------------------------------------
    def _get(self, key: tuple[object, ...], measure: Callable[[], float]) -> float:
        got = self._seen.get(key)
        if got is None:
            with torch.inference_mode():  # the scratch cache lives in inference mode
                got = self._seen[key] = measure()
            if self._cache is not None:  # what a runner keeps per cache (captured graphs)
                self.runner.release(self._cache)
        return got

    def _rows(self, key: tuple[object, ...], rows: int, measure: Callable[[int], float]
              ) -> float:
        """Seconds at ``rows`` from measurements at powers of two (linear in between, and
        proportional past :data:`MAX_ROWS`)."""
        rows = max(1, rows)
        lo = min(1 << (rows.bit_length() - 1), MAX_ROWS)
        t_lo = self._get((*key, lo), lambda: measure(lo))
        if rows == lo:
            return t_lo
        if lo >= MAX_ROWS:
            return t_lo * rows / lo
        hi = lo * 2
        t_hi = self._get((*key, hi), lambda: measure(hi))
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)

    def _scratch(self, positions: int) -> tuple[KVCache, torch.Tensor]:
        runner = self.runner
        if self._cache is None:
            self._cache = runner.new_cache(1, CONTEXT + MAX_ROWS + max(CHAIN_POINTS) + 2)
        cache = self._cache
        cache.lengths = torch.full((1,), CONTEXT, dtype=torch.long)
        cache.fill = torch.full_like(cache.fill, CONTEXT)
        pos = torch.arange(CONTEXT, CONTEXT + positions, device=runner.device)[None]
        return cache, pos

    def _timed(self, fn: Callable[[], object]) -> float:
        """The fastest of a few calls of ``fn``: up to :data:`REPEATS`, while they take less
        than :data:`SLOW_CALL_S` together (a slow call is timed twice)."""
        start = time.perf_counter()
        best = float("inf")
        for i in range(REPEATS):
            t0 = time.perf_counter()
            fn()
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            best = min(best, time.perf_counter() - t0)
            if i >= 1 and time.perf_counter() - start >= SLOW_CALL_S:
                break
        self.measured_s += time.perf_counter() - start
        return best

    def _hidden(self, rows: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(rows)
        h = torch.randn(1, rows, self.runner.config.dim, generator=gen)
        return h.to(device=self.runner.device, dtype=self.runner.dtype)

    def _time_chain(self, depth: int, n: int, vocab: int | None) -> float:
        runner = self.runner
        token = torch.zeros(1, dtype=torch.long, device=runner.device)
        plain = n == 0 and depth == self.num_layers

        def call() -> None:
            cache, _ = self._scratch(1)
            runner.chain(token, cache, n, depth, vocab=vocab, logits=plain)

        return self._timed(call)

    def _time_layers(self, start: int, end: int, rows: int) -> float:
        runner = self.runner
        h = self._hidden(rows)
        cache, pos = self._scratch(rows)
        return self._timed(lambda: runner.layers(h, start, end, pos, cache))

    def _time_head(self, layer: int, rows: int, vocab: int | None) -> float:
        runner = self.runner
        h = self._hidden(rows)
        cache, pos = self._scratch(rows)
        return self._timed(lambda: runner.logits(h, layer, vocab=vocab, positions=pos,
                                                 cache=cache))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(intercept, slope)`` of ``y = intercept + slope * x`` through
    ``points`` ``(x, y)``; None without two distinct ``x``."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0.0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


_COSTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[object, ...], PrimitiveCosts]] = (
    weakref.WeakKeyDictionary())


def _kind(runner: Runner) -> tuple[object, ...]:
    """What a runner's costs depend on besides its model's shapes: the runner's class, the
    weights' dtype and device, and the module classes it runs (a model quantized in place
    changes them)."""
    modules = frozenset(type(m).__qualname__ for m in runner.model.modules())
    return type(runner), runner.dtype, str(runner.device), modules


def costs_of(runner: Runner) -> PrimitiveCosts:
    """The one :class:`PrimitiveCosts` of ``runner``'s model and kind (:func:`_kind`): measured
    shapes and what planners learned (:attr:`PrimitiveCosts.learned`) are kept for as long as
    the model lives, so engines, calls and the runners of later ``generate(model, ...)`` calls
    measure once and start from what the last planner learned (held by the model weakly: the
    costs keep neither the model nor a runner alive)."""
    kinds = _COSTS.setdefault(runner.model, {})
    key = _kind(runner)
    got = kinds.get(key)
    if got is None:
        got = kinds[key] = PrimitiveCosts(runner)
    got.bind(runner)
    return got


__all__ = ["CONTEXT", "MAX_ROWS", "PrimitiveCosts", "costs_of", "fit_line"]
