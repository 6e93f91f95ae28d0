"""Helpers shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, which puts
this folder on ``sys.path``): progress notes on stderr, nearest-rank percentiles, held-out
prompts fitted to a model's context (and a long held-out source file), the machine every
report names, and bad input reported in one line."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from collections.abc import Iterator
from typing import Any


class StreamTimer:
    """A ``transformers`` streamer recording when each step's tokens arrive (``calls[0]`` is
    the prompt, ``calls[1]`` the first new token)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def put(self, value: Any) -> None:
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


def machine() -> dict[str, Any]:
    """The machine and library versions a benchmark's JSON reports: architecture, processor,
    cores, the load average when the run ended, Python, numpy, and torch and exitlm's kernel
    path when the script loaded them."""
    info: dict[str, Any] = {
        "machine": platform.machine(), "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }
    for name in ("numpy", "torch"):
        mod = sys.modules.get(name)
        if mod is not None:
            info[name] = mod.__version__
    if "exitlm.kernels.native" in sys.modules:
        info["kernels"] = sys.modules["exitlm.kernels.native"].kernel_path().describe()
    return info


def note(msg: str) -> None:
    """A progress line on stderr (stdout carries only the JSON result)."""
    print(msg, file=sys.stderr, flush=True)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (0.0 for no samples)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def held_out_prompt_ids(tokenizer: Any, n: int, context: int, new_tokens: int,
                        keep: int = 128) -> list[list[int]]:
    """Token ids of ``n`` held-out standard-library prompts (``exitlm bench``'s), each cut to
    its last ``keep`` tokens and to what leaves room for ``new_tokens`` in ``context``."""
    from exitlm.bench.run import builtin_prompts

    keep = max(1, min(keep, context - new_tokens - 1))
    return [tokenizer.encode(p)[-keep:] for p in builtin_prompts(n)]


class ByteIds:
    """Token ids of a model without a tokenizer (the random ``debug`` preset): its bytes,
    modulo the vocabulary."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab for b in text.encode()]


def long_prompt_ids(tokenizer: Any, n: int, script: str) -> list[int]:
    """``n`` tokens of held-out standard-library source (``argparse.py``: real code and
    docstrings, not in any shipped model's training corpus list); ``script`` names the
    benchmark in the error when the file is shorter."""
    import argparse as source

    with open(source.__file__, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    if len(ids) < n:
        raise SystemExit(f"{script}: {source.__file__} has only {len(ids)} tokens, "
                         f"the prompt asks for {n}")
    return ids[:n]


@contextlib.contextmanager
def one_line_errors(script: str) -> Iterator[None]:
    """Bad input (an :class:`~exitlm.errors.ExitlmError`: an unknown model, a setting out of
    range) ends the script with one line on stderr and status 2, as the ``exitlm`` command
    does, instead of a traceback."""
    from exitlm.errors import ExitlmError

    try:
        yield
    except ExitlmError as err:
        print(f"{script}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
