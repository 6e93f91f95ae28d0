"""The one result type every decoding strategy returns (DESIGN.md, "Decoding strategies share
one result type").

A :class:`GenerationResult` holds one :class:`SequenceResult` per prompt (generated token ids,
text, the layer each token exited at, why it stopped, the layer evaluations spent), the
:class:`Timings` of the call and a free-form ``stats`` dict for strategy-specific aggregates
(acceptance rates of speculative decoding, ...). The CLI, the server and the benchmarks all
read this object or its JSON form.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["length", "stop_token", "stop_string"]


@dataclass
class Timings:
    """Wall-clock timings of one generation call.

    ``prefill_s`` runs from the start of the prompt forward to the first token being chosen;
    ``decode_s`` covers every later step. ``decode_tokens`` counts the tokens chosen during
    the decode phase (all new tokens but the first of each sequence), summed over the batch,
    so ``decode_tokens_per_s`` is the batch's decode throughput.
    ``time_to_first_token_s`` also includes prompt encoding and cache allocation.
    """

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0

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
        finish_reason: ``length`` (max_new_tokens reached), ``stop_token`` or ``stop_string``.
        prompt_tokens: the prompt's length in tokens.
        layer_evaluations: transformer-layer evaluations (token x layer) spent after the prompt,
            counting the prompt's last position, which produces the first token. Plain
            decoding spends ``len(token_ids) * num_layers``.
        stats: strategy-specific per-sequence numbers (e.g. draft tokens accepted).
    """

    token_ids: list[int]
    text: str
    exit_layers: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    layer_evaluations: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerationResult:
    """The outcome of :func:`exitlm.infer.generate` for a batch of prompts."""

    sequences: list[SequenceResult]
    timings: Timings
    strategy: str = "ar"
    num_layers: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "num_layers": self.num_layers,
            "sequences": [s.to_dict() for s in self.sequences],
            "timings": self.timings.to_dict(),
            "stats": dict(self.stats),
        }

    def to_json(self, **kwargs: Any) -> str:
        """JSON of :meth:`to_dict` (keyword arguments go to ``json.dumps``)."""
        kwargs.setdefault("ensure_ascii", False)
        return json.dumps(self.to_dict(), **kwargs)
