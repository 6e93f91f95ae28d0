"""The one result type every decoding strategy returns, whatever runner and executor decoded
it.

A :class:`GenerationResult` holds one :class:`SequenceResult` per prompt (generated token ids,
text, the layer each token exited at, why it stopped, the layer evaluations spent, the
strategy's per-sequence :class:`DecodeStats`), the :class:`Timings` of the call, the batch's
summed statistics and the strategy options that were in force. :meth:`GenerationResult.exits`
and :meth:`SequenceResult.exits` summarise where tokens exited (:class:`ExitSummary`). The CLI,
the engine, the server and the benchmarks all read these objects or their JSON form.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

FinishReason = Literal["length", "stop_token", "stop_string", "cancelled", "error"]

S = TypeVar("S", bound="DecodeStats")


@dataclass
class DecodeStats:
    """Per-sequence counters of a decoding strategy; a batch's statistics are their sum.

    Strategies subclass this with their own integer fields (drafts accepted, branches
    confirmed, ...) and derived properties; plain decoding has none.
    """

    def add(self: S, other: S) -> S:
        """The field-wise sum of two statistics of the same strategy."""
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                             for f in dataclasses.fields(self)})

    @classmethod
    def total(cls: type[S], items: Iterable[S]) -> S:
        out = cls()
        for x in items:
            out = out.add(x)
        return out

    def derived(self) -> dict[str, float]:
        """Rates computed from the counters (e.g. an acceptance rate)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), **self.derived()}

    def describe(self) -> str:
        """A short human-readable summary for the CLI (empty when there is nothing to say)."""
        return ""


@dataclass(frozen=True)
class ExitSummary:
    """Where a set of generated tokens exited (EE-LLM / LayerSkip speed-up accounting).

    Attributes:
        tokens_per_layer: generated tokens by the 1-based layer whose output chose them.
        layer_evaluations: transformer-layer evaluations (token x layer) spent, recomputation
            and rejected drafts included.
        num_layers: the model's depth ``L``.
    """

    tokens_per_layer: dict[int, int]
    layer_evaluations: int
    num_layers: int

    @classmethod
    def of(cls, exit_layers: Iterable[int], layer_evaluations: int,
           num_layers: int) -> ExitSummary:
        counts: dict[int, int] = {}
        for layer in exit_layers:
            counts[layer] = counts.get(layer, 0) + 1
        return cls(dict(sorted(counts.items())), layer_evaluations, num_layers)

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_layer.values())

    @property
    def early_exit_fraction(self) -> float:
        """Share of tokens chosen before the last layer."""
        n = self.tokens
        early = sum(c for layer, c in self.tokens_per_layer.items() if layer < self.num_layers)
        return early / n if n else 0.0

    @property
    def mean_exit_layer(self) -> float:
        n = self.tokens
        return sum(layer * c for layer, c in self.tokens_per_layer.items()) / n if n else 0.0

    @property
    def layer_speedup(self) -> float:
        """``tokens x L / evaluations``: 1 for plain decoding, > 1 when layers were saved."""
        return self.tokens * self.num_layers / self.layer_evaluations if self.layer_evaluations \
            else 0.0

    def to_dict(self) -> dict[str, Any]:
        n = self.tokens
        return {
            "tokens_per_layer": {str(k): v for k, v in self.tokens_per_layer.items()},
            "share_per_layer": {str(k): v / n for k, v in self.tokens_per_layer.items()} if n
            else {},
            "early_exit_fraction": self.early_exit_fraction,
            "mean_exit_layer": self.mean_exit_layer,
            "layer_evaluations": self.layer_evaluations,
            "full_depth_evaluations": n * self.num_layers,
            "layer_speedup": self.layer_speedup,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely alternatives ``(id, logprob)`` at its
    position, under the (unwarped) distribution of the logits that chose it."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob,
                "top": [[t, lp] for t, lp in self.top]}


@dataclass
class Timings:
    """Wall-clock timings of one generation call.

    ``prefill_s`` runs from the start of the prompt forward to the first token being chosen;
    ``decode_s`` covers every later step. ``decode_tokens`` counts the tokens chosen during
    the decode phase (all new tokens but the first of each sequence), summed over the batch,
    so ``decode_tokens_per_s`` is the batch's decode throughput.
    ``time_to_first_token_s`` also includes prompt encoding and cache allocation, and
    ``startup_s``: helpers the strategy started during the call (PPD's branch worker process
    with ``--ppd-workers process``), which ``prefill_s`` does not count.
    """

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    startup_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        d: dict[str, float] = dataclasses.asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return d


@dataclass
class SequenceResult:
    """What one prompt produced.

    Attributes:
        token_ids: the generated tokens (not the prompt), including a final stop token.
        text: the decoded generated text (special tokens skipped, cut before a stop string).
        exit_layers: for every generated token, the 1-based layer whose output chose it
            (``num_layers`` for the final layer, i.e. plain decoding).
        finish_reason: ``length`` (max_new_tokens reached), ``stop_token``, ``stop_string``,
            ``cancelled`` or ``error`` (a failed engine step ended it,
            :meth:`~exitlm.infer.engine.Engine.abort_running`).
        prompt_tokens: the prompt's length in tokens.
        layer_evaluations: transformer-layer evaluations (token x layer) spent after the prompt,
            counting the prompt's last position, which produces the first token. Plain
            decoding spends ``len(token_ids) * num_layers``.
        stats: the strategy's per-sequence statistics.
        num_layers: the model's depth.
        logprobs: per generated token, when asked for (``SamplingOptions.logprobs``).
    """

    token_ids: list[int]
    text: str
    exit_layers: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    layer_evaluations: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    num_layers: int = 0
    logprobs: list[TokenLogprob] | None = None

    def exits(self) -> ExitSummary:
        return ExitSummary.of(self.exit_layers, self.layer_evaluations, self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "token_ids": list(self.token_ids), "text": self.text,
            "exit_layers": list(self.exit_layers), "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "layer_evaluations": self.layer_evaluations,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [x.to_dict() for x in self.logprobs]
        return out


@dataclass
class GenerationResult:
    """The outcome of :func:`exitlm.infer.generate` for a batch of prompts.

    ``stats`` is the sum of the sequences' statistics; ``options`` the strategy options that
    were used (defaults resolved, e.g. the draft exit chosen for the model).
    """

    sequences: list[SequenceResult]
    timings: Timings
    strategy: str = "ar"
    num_layers: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.sequences]

    @property
    def token_ids(self) -> list[list[int]]:
        return [s.token_ids for s in self.sequences]

    @property
    def text(self) -> str:
        """The text of the only sequence (a batch of one)."""
        if len(self.sequences) != 1:
            raise ValueError(
                f"result holds {len(self.sequences)} sequences; use .texts or .sequences[i]"
            )
        return self.sequences[0].text

    def exits(self) -> ExitSummary:
        """Where the batch's tokens exited."""
        return ExitSummary.of((x for s in self.sequences for x in s.exit_layers),
                              sum(s.layer_evaluations for s in self.sequences), self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "num_layers": self.num_layers,
            "options": dict(self.options),
            "sequences": [s.to_dict() for s in self.sequences],
            "timings": self.timings.to_dict(),
            "stats": self.stats.to_dict(),
            "exits": self.exits().to_dict(),
        }

    def to_json(self, **kwargs: Any) -> str:
        """JSON of :meth:`to_dict` (keyword arguments go to ``json.dumps``)."""
        kwargs.setdefault("ensure_ascii", False)
        return json.dumps(self.to_dict(), **kwargs)
