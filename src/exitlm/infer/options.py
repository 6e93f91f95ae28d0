"""Typed options shared by every decoding strategy.

:class:`SamplingOptions` says *which* token is chosen at each step and *when* a sequence
stops; it means the same thing for plain autoregressive decoding and for the later
strategies (early exit, self-speculative, PPD), which add options of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any

from exitlm.config import ConfigError
from exitlm.schema import NonNegativeFloat, NonNegativeInt, Range, Seed, check

TopP = Annotated[float, Range(gt=0, le=1)]
MAX_LOGPROBS = 20
"""The most alternatives per token :attr:`SamplingOptions.logprobs` may ask for."""
TopLogprobs = Annotated[int, Range(ge=0, le=MAX_LOGPROBS)]


def option(default: Any, help: str, *, per_request: bool = False) -> Any:
    """A field of a strategy's options dataclass.

    ``help`` becomes the help of the command-line flag derived from the field
    (``exit_layer`` -> ``--exit-layer``, :mod:`exitlm.infer.flags`); ``per_request`` marks
    options that each request of a running engine may set for itself (the others shape the
    decoder and are fixed when the engine starts).
    """
    return dataclasses.field(default=default,
                             metadata={"help": help, "per_request": per_request})


def per_request_fields(options_type: type) -> frozenset[str]:
    """Names of the fields of ``options_type`` that a request may set for itself."""
    return frozenset(f.name for f in dataclasses.fields(options_type)
                     if f.metadata.get("per_request"))


@dataclass(frozen=True)
class SamplingOptions:
    """Token choice and stopping rules.

    Attributes:
        temperature: ``0`` (the default) decodes greedily (argmax, like ``transformers``'
            ``do_sample=False``); ``> 0`` samples from ``softmax(logits / temperature)``.
        top_k: keep only the ``k`` most likely tokens before sampling (``0``: off).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass
            reaches ``top_p`` (``1.0``: off).
        seed: seed of the sampling generator; the same seed gives the same output.
            ``None`` draws from torch's global generator.
        max_new_tokens: the most tokens generated per sequence.
        stop_token_ids: extra token ids that end a sequence (the token is kept in
            ``token_ids``; special tokens never appear in ``text``).
        stop_strings: strings that end a sequence as soon as its text contains one; the text
            is cut right before it.
        ignore_eos: do not stop at the model's end-of-sequence tokens (benchmarks use this to
            generate exactly ``max_new_tokens``).
        logprobs: report each generated token's log-probability under the distribution that
            chose it (the exit's, for an early exit; the final layer's for verified drafts),
            with this many most likely alternatives (``0``: the token's own only; ``None``:
            off).
    """

    temperature: NonNegativeFloat = 0.0
    top_k: NonNegativeInt = 0
    top_p: TopP = 1.0
    seed: Seed | None = None
    max_new_tokens: NonNegativeInt = 64
    stop_token_ids: tuple[NonNegativeInt, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: TopLogprobs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        check(self)  # types and ranges: "top_p: expected a number in (0, 1], got 2"
        if any(not s for s in self.stop_strings):
            raise ConfigError("stop_strings must not contain an empty string")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop_strings"] = list(self.stop_strings)
        return d


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingOptions))
