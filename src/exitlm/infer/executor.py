"""Where an engine's decoder runs: the :class:`Executor` interface every process topology
implements (vLLM v1's executors: one process, several, and who owns them).

An executor owns this process's :class:`~exitlm.runtime.runner.Runner`, builds the decoder a
strategy needs on it, and owns whatever processes the topology adds: tensor-parallel ranks
that replay this engine's steps, pipeline stages, a PPD branch worker
(:mod:`exitlm.infer.executors`). The :class:`~exitlm.infer.engine.Engine` calls it at fixed
points - when it starts, when a request is admitted, before each step (with the submissions
and cancellations that step applies, in order), before a scoring forward, after a failure,
when it closes - and is otherwise the same for every topology. This class is the local one:
the engine's process only, every hook a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from exitlm.infer.decoder import Decoder
from exitlm.infer.options import SamplingOptions
from exitlm.infer.request import Request
from exitlm.runtime.runner import Runner

if TYPE_CHECKING:  # an executor builds a strategy's decoder
    from exitlm.infer.strategies import Strategy


@dataclass
class Submit:
    """A request that joins the waiting queue at the next step."""

    request: Request


@dataclass
class Cancel:
    """A cancellation that takes effect at the next step."""

    request_id: int


Event = Submit | Cancel


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is made of, for the processes that replay it: the strategy's name and
    options, the tokenizer, and the engine's limits (:class:`~exitlm.infer.engine.Engine`'s
    arguments)."""

    strategy: str
    options: Any
    tokenizer: Any
    max_batch: int
    max_seq_len: int | None
    threads: int | None
    prefill_chunk: int | None = None
    share_prompts: bool = True


class Executor:
    """This process alone (see the module docstring); topologies of several processes
    override the hooks they need."""

    name = "local"
    runner: Runner
    """This process's runner (final once :meth:`start` returned)."""
    fatal_failures = False
    """Whether a failed step leaves other processes out of step with this one (then the
    engine refuses further work: it has to be started again)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def decoder(self, strategy: Strategy, options: Any) -> Decoder:
        """The strategy's decoder on this topology (the local one: on this runner)."""
        return strategy.decoder(self.runner, options)

    def start(self, spec: EngineSpec) -> None:
        """The engine that drives this executor is being built (``spec``): where a topology
        starts the processes that replay it. :attr:`runner` is final afterwards."""

    def admit(self, sampling: SamplingOptions) -> SamplingOptions:
        """A request's sampling options as every process must apply them."""
        return sampling

    def before_step(self, events: list[Event]) -> None:
        """The submissions and cancellations the coming step applies, in order."""

    def before_score(self, ids: list[int], top: int) -> None:
        """A scoring forward (echoed prompt log-probabilities) is about to run."""

    def failure(self) -> str | None:
        """Why a step failed elsewhere (a process of the topology exited), if one did."""
        return None

    def close(self, error: BaseException | None = None) -> None:
        """Stop the processes this executor started (the runner stays usable); ``error`` is
        the exception that ends the job, if one does."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(error)
