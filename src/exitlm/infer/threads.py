"""How many CPU threads a decoding step uses: :class:`ThreadPolicy`.

On a quiet machine more threads decode faster (2 threads: ~1.2x for batch-1 fp32 on the
project's 2-core CPUs, more for batches). On a machine where another process is busy, a step
split over threads waits for the one that shares a core, and decoding collapses - measured
here 2-7x slower with 2 threads than with 1 (docs/architecture.md; OpenMP's passive wait policy
did not help, because OpenBLAS' own workers and the split itself are the problem). No fixed
count is right for both, so by default the policy **measures**: it starts on all threads when
the load average says the machine is idle and on one otherwise, and every so often tries the
other setting for a few steps, keeping whichever decodes a token faster. A probe that loses
backs off (the interval doubles, up to :data:`MAX_INTERVAL` steps) and is abandoned after one
step when that step is clearly slower, so a busy machine pays little for the probing; a probe
that wins keeps re-checking, so a machine that becomes busy is noticed. ``--threads N`` fixes
the count instead.

Every step has a *kind*: ``gemv`` steps (one sequence on CPU: its products are numpy GEMVs
for fp32, or the native runner's kernels for every dtype that runner decodes) give the threads
to those products and leave torch one; ``torch`` steps (batches: few-row
products through oneDNN) give them to torch (:func:`~exitlm.kernels.blas.thread_split`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from exitlm.args import check_threads
from exitlm.kernels.blas import thread_split

WINDOW = 4
"""Steps per measurement window (the median is compared)."""
FIRST_PROBE = 8
"""Steps before the first probe of more threads."""
MIN_INTERVAL, MAX_INTERVAL = 64, 1024
"""Steps between probes: after a winning probe / at most after losing ones."""
GAIN = 0.9
"""A probe wins when its time per token is below this fraction of the current setting's."""
ABORT = 1.5
"""A probe step this much slower than the current setting ends the probe at once."""


def _idle(cores: int) -> bool:
    """Whether the 1-minute load average leaves ``cores`` free (POSIX; else: assume not)."""
    try:
        return os.getloadavg()[0] < cores - 0.5
    except (AttributeError, OSError):
        return False


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads for torch (``--threads``)."""
    torch.set_num_threads(check_threads(n))


@dataclass
class _Record:
    """Filled in by the caller of :meth:`ThreadPolicy.step`: tokens the step produced."""

    tokens: int = 1


@dataclass
class ThreadPolicy:
    """Threads per decoding step, fixed or measured (see the module docstring).

    Args:
        threads: a fixed thread count (``--threads``); ``None`` measures.
        max_threads: the most threads tried (default: torch's thread count at creation).
        initial: the count to start from (default: ``max_threads`` on an idle machine - a
            1-minute load average below ``max_threads - 0.5`` - else 1).
        clock: the time source (tests pass a fake one).
    """

    threads: int | None = None
    max_threads: int | None = None
    initial: int | None = None
    clock: Callable[[], float] = time.perf_counter
    current: int = field(init=False)
    _key: Hashable = field(init=False, default=None)
    _base: list[float] = field(init=False, default_factory=list)
    _trial: list[float] = field(init=False, default_factory=list)
    _probing: bool = field(init=False, default=False)
    _interval: int = field(init=False, default=MIN_INTERVAL)
    _next_probe: int = field(init=False, default=FIRST_PROBE)
    _steps: int = field(init=False, default=0)
    switches: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.threads is not None:
            check_threads(self.threads, "threads")
        if self.max_threads is None:
            self.max_threads = self.threads or torch.get_num_threads()
        if self.threads is not None:
            self.current = self.threads
        elif self.initial is not None:
            self.current = self.initial
        else:
            self.current = self.max_threads if _idle(self.max_threads) else 1

    @property
    def adaptive(self) -> bool:
        return self.threads is None and (self.max_threads or 1) > 1

    def _other(self) -> int:
        assert self.max_threads is not None
        return self.max_threads if self.current == 1 else 1

    def planned(self) -> int:
        """The thread count the next step will use."""
        return self._other() if self._probing else self.current

    @contextmanager
    def step(self, kind: str, key: Hashable = None) -> Iterator[_Record]:
        """Run one step of ``kind`` (``gemv`` or ``torch``) with the planned thread count and
        measure it; steps with different ``key`` (e.g. batch size) are not compared."""
        n = self.planned()
        rec = _Record()
        t0 = self.clock()
        with thread_split(1, n) if kind == "gemv" else thread_split(n, 1):
            yield rec
        if self.adaptive:
            self._observe(key, (self.clock() - t0) / max(1, rec.tokens))

    @contextmanager
    def split(self, kind: str) -> Iterator[None]:
        """Run unmeasured work (a prefill) with the current thread count."""
        with thread_split(1, self.current) if kind == "gemv" else \
                thread_split(self.current, 1):
            yield

    def _observe(self, key: Hashable, per_token: float) -> None:
        self._steps += 1
        if key != self._key:  # other conditions: start measuring afresh
            self._key, self._base, self._trial, self._probing = key, [], [], False
            self._next_probe = max(self._next_probe, self._steps + WINDOW)
            return
        if not self._probing:
            self._base = [*self._base, per_token][-WINDOW:]
            if self._steps >= self._next_probe and len(self._base) == WINDOW:
                self._probing, self._trial = True, []
            return
        self._trial.append(per_token)
        base = statistics.median(self._base)
        if per_token > ABORT * base or len(self._trial) == WINDOW:
            self._settle(statistics.median(self._trial) < GAIN * base)

    def _settle(self, won: bool) -> None:
        self._probing = False
        if won:
            self.current = self._other()
            self.switches += 1
            self._base, self._interval = list(self._trial), MIN_INTERVAL
        else:
            self._interval = min(MAX_INTERVAL, 2 * self._interval)
        self._next_probe = self._steps + self._interval
