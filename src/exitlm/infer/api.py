"""The single entry point for text generation: :func:`generate`.

Decoding strategies register themselves in :data:`STRATEGIES` with a typed options dataclass
and a runner; every runner takes token-id prompts plus :class:`SamplingOptions` and returns a
:class:`~exitlm.infer.result.GenerationResult`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exitlm.config import ConfigError
from exitlm.infer.autoregressive import AROptions, generate_ar
from exitlm.infer.early_exit import EarlyExitOptions, generate_early_exit
from exitlm.infer.options import SAMPLING_FIELDS, SamplingOptions
from exitlm.infer.ppd import PPDOptions, generate_ppd
from exitlm.infer.result import GenerationResult
from exitlm.infer.self_speculative import SelfSpecOptions, generate_self_spec
from exitlm.infer.stopping import TextCallback
from exitlm.model.layout import optimize_layout
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class Strategy:
    """A decoding strategy: its options type and the function that runs it.

    ``run(model, prompt_ids, sampling, *, tokenizer, stream, options, start_time)`` returns a
    :class:`GenerationResult`.
    """

    name: str
    options_type: type
    run: Callable[..., GenerationResult]
    description: str = ""


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> None:
    """Make ``strategy`` available to :func:`generate` under ``strategy.name``."""
    STRATEGIES[strategy.name] = strategy


register_strategy(
    Strategy("ar", AROptions, generate_ar, "plain autoregressive decoding (the baseline)")
)
register_strategy(
    Strategy("early-exit", EarlyExitOptions, generate_early_exit,
             "confidence exits with KV recomputation (EE-LLM); fixed-layer exit (LayerSkip)")
)
register_strategy(
    Strategy("self-spec", SelfSpecOptions, generate_self_spec,
             "self-speculative decoding: draft with exit E, verify with layers E..L (LayerSkip)")
)
register_strategy(
    Strategy("ppd", PPDOptions, generate_ppd,
             "Predictive Pipelined Decoding: top-k early guesses start the next token in parallel")
)


def generate(
    model: EarlyExitLM,
    tokenizer: Tokenizer | None,
    prompts: Prompts,
    *,
    strategy: str = "ar",
    sampling: SamplingOptions | None = None,
    options: Any = None,
    stream: TextCallback | None = None,
    chat: bool = False,
    **overrides: Any,
) -> GenerationResult:
    """Generate continuations of one or several prompts as one padded batch.

    Args:
        model: the model (its dtype and device are used as they are).
        tokenizer: encodes text prompts and decodes outputs; may be ``None`` when the prompts
            are token ids (the result's texts are then empty).
        prompts: a string, a list of strings, a list of token ids, or a list of such lists.
        strategy: the decoding strategy, a key of :data:`STRATEGIES`.
        sampling: token choice and stopping (default: greedy, 64 new tokens).
        options: the strategy's own options dataclass (default: its defaults).
        stream: ``stream(sequence_index, text_piece)`` receives text as it is produced;
            the pieces of a sequence concatenate to its final ``text``.
        chat: wrap each text prompt as a user message with the tokenizer's chat template.
        **overrides: fields of :class:`SamplingOptions` (``max_new_tokens=16``,
            ``temperature=0.7``, ...) or of the strategy's options, replacing those given.
    """
    start = time.perf_counter()
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown decoding strategy {strategy!r}; available: {sorted(STRATEGIES)}"
        )
    strat = STRATEGIES[strategy]
    sampling = sampling or SamplingOptions()
    opts = options if options is not None else strat.options_type()
    if not isinstance(opts, strat.options_type):
        raise ConfigError(
            f"strategy {strategy!r} takes options of type {strat.options_type.__name__}, "
            f"got {type(opts).__name__}"
        )
    own_fields = {f.name for f in dataclasses.fields(opts)}
    unknown = sorted(set(overrides) - SAMPLING_FIELDS - own_fields)
    if unknown:
        raise ConfigError(
            f"unknown generation options {unknown}; sampling options: {sorted(SAMPLING_FIELDS)}"
            f", {strategy!r} options: {sorted(own_fields)}"
        )
    sampling_changes = {k: v for k, v in overrides.items() if k in SAMPLING_FIELDS}
    if sampling_changes:
        sampling = sampling.replace(**sampling_changes)
    own_changes = {k: v for k, v in overrides.items() if k in own_fields}
    if own_changes:
        opts = dataclasses.replace(opts, **own_changes)
    prompt_ids = encode_prompts(tokenizer, prompts, chat=chat)
    optimize_layout(model)  # idempotent: re-strides weights for fast batch-1 GEMV once
    return strat.run(
        model, prompt_ids, sampling, tokenizer=tokenizer, stream=stream, options=opts,
        start_time=start,
    )


def encode_prompts(
    tokenizer: Tokenizer | None, prompts: Prompts, *, chat: bool = False
) -> list[list[int]]:
    """Token ids of every prompt (text prompts go through ``tokenizer``)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(x, int) for x in items):
        return [[int(x) for x in items]]  # type: ignore[arg-type]
    out: list[list[int]] = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            text = (
                tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p
            )
            out.append(tokenizer.encode(text))
        else:
            if chat:
                raise ValueError("chat=True needs text prompts, got token ids")
            out.append([int(x) for x in p])  # type: ignore[union-attr]
    return out
