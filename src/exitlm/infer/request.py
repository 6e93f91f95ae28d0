"""A request's handle and what each engine step reports about it: :class:`Request`,
:class:`Update` (the data the :class:`~exitlm.infer.engine.Engine`, its executor and its
clients pass around)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from exitlm.infer.decoder import Seq
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import DecodeStats, FinishReason, SequenceResult, TokenLogprob
from exitlm.infer.stopping import TextTracker

Status = Literal["waiting", "running", "finished"]


@dataclass
class Update:
    """What one step did for one request: the tokens it kept, their exit layers, the text that
    became final (``pieces``: text with the exit layer of the token that completed it), and
    whether the request is done."""

    request: Request
    token_ids: list[int]
    exit_layers: list[int]
    pieces: list[tuple[str, int]]
    finished: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)


@dataclass(eq=False)
class Request:
    """A handle to one submitted request (created by :meth:`Engine.submit`)."""

    id: int
    prompt_ids: list[int]
    sampling: SamplingOptions
    options: Any
    seq: Seq
    stop_ids: frozenset[int]
    on_update: Callable[[Update], None] | None = None
    status: Status = "waiting"
    finish_reason: FinishReason | None = None
    exit_layers: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    layer_evaluations: int = 0
    prompt_copied: int = 0
    """Positions of the prompt copied from another row's cache instead of prefilled
    (:mod:`~exitlm.infer.prefill_plan`)."""
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    _pieces: list[tuple[str, int]] = field(default_factory=list)
    _layer: int = 0
    tracker: TextTracker = field(init=False)
    """Generated tokens and text (stop strings, incremental decoding)."""

    @property
    def token_ids(self) -> list[int]:
        return self.tracker.ids

    @property
    def text(self) -> str:
        return self.tracker.text

    @property
    def done(self) -> bool:
        return self.status == "finished"

    @property
    def stats(self) -> DecodeStats:
        return self.seq.stats

    def result(self, num_layers: int) -> SequenceResult:
        """The request's :class:`SequenceResult` (call once it is done)."""
        return SequenceResult(
            token_ids=list(self.tracker.ids), text=self.tracker.finish(),
            exit_layers=list(self.exit_layers), finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids), layer_evaluations=self.layer_evaluations,
            stats=self.seq.stats, num_layers=num_layers,
            logprobs=list(self.logprobs) if self.sampling.logprobs is not None else None,
        )
