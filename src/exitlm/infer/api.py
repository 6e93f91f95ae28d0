"""The single entry point for one-shot text generation: :func:`generate`.

It is a thin driver of the :class:`~exitlm.infer.engine.Engine`: every prompt becomes a
request of one engine sized for the batch, the engine runs until all are done, and the
requests' results become one :class:`~exitlm.infer.result.GenerationResult`.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.engine import Engine
from exitlm.infer.executor import EngineSpec, Executor
from exitlm.infer.options import SAMPLING_FIELDS, SamplingOptions
from exitlm.infer.request import Update
from exitlm.infer.result import GenerationResult, Timings
from exitlm.infer.stopping import TextCallback
from exitlm.infer.strategies import STRATEGIES, Strategy, get_strategy, register_strategy
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.runner import Runner
from exitlm.tokenizer import Tokenizer

Prompts = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]

__all__ = ["STRATEGIES", "Strategy", "encode_prompts", "generate", "register_strategy"]


def generate(
    model: EarlyExitLM | Runner | Executor,
    tokenizer: Tokenizer | None,
    prompts: Prompts,
    *,
    strategy: str = "ar",
    sampling: SamplingOptions | None = None,
    options: Any = None,
    stream: TextCallback | None = None,
    chat: bool = False,
    threads: int | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Generate continuations of one or several prompts, decoded together.

    Args:
        model: the model (its dtype and device are used as they are), the runner that
            computes its forwards (:func:`~exitlm.runtime.prepare`; pass one to reuse it
            across calls), or the executor to run on (:mod:`exitlm.infer.executors`:
            tensor-parallel ranks, pipeline stages; the caller closes it).
        tokenizer: encodes text prompts and decodes outputs; may be ``None`` when the prompts
            are token ids (the result's texts are then empty).
        prompts: a string, a list of strings, a list of token ids, or a list of such lists.
        strategy: the decoding strategy, a key of :data:`STRATEGIES`.
        sampling: token choice and stopping (default: greedy, 64 new tokens). With a seed
            ``s``, sequence ``i`` samples from its own generator seeded ``s + i`` (modulo
            2**32), so each sequence gets the same tokens as when generated alone with it.
        options: the strategy's own options dataclass (default: its defaults).
        stream: ``stream(sequence_index, text_piece)`` receives text as it is produced;
            the pieces of a sequence concatenate to its final ``text``. A callback with a true
            ``wants_layers`` attribute is called as ``stream(index, piece, exit_layer)``.
        chat: wrap each text prompt as a user message with the tokenizer's chat template.
        threads: CPU threads per decoding step (default: measured, see
            :class:`~exitlm.infer.threads.ThreadPolicy`).
        **overrides: fields of :class:`SamplingOptions` (``max_new_tokens=16``,
            ``temperature=0.7``, ...) or of the strategy's options, replacing those given.
    """
    start = time.perf_counter()
    spec, sampling, prompt_ids = generation_spec(tokenizer, prompts, strategy=strategy,
                                                 sampling=sampling, options=options, chat=chat,
                                                 threads=threads, **overrides)
    engine = Engine(model, tokenizer, strategy, spec.options, max_batch=spec.max_batch,
                    threads=threads)
    try:
        reqs = []
        for i, ids in enumerate(prompt_ids):
            seeded = (sampling if sampling.seed is None
                      else sampling.replace(seed=(sampling.seed + i) % 2**32))
            reqs.append(engine.submit(ids, seeded, on_update=_streamer(stream, i)))
        engine.run()
    finally:
        engine.close()
    num_layers = engine.model.num_layers
    seqs = [r.result(num_layers) for r in reqs]
    t_first = max(r.t_first for r in reqs)
    timings = Timings(
        prefill_s=engine.prefill_s, decode_s=engine.decode_s, startup_s=engine.startup_s,
        prompt_tokens=sum(len(ids) for ids in prompt_ids),
        new_tokens=sum(len(s.token_ids) for s in seqs),
        decode_tokens=sum(max(0, len(s.token_ids) - 1) for s in seqs),
        time_to_first_token_s=t_first - start, total_s=time.perf_counter() - start,
    )
    return GenerationResult(seqs, timings, strategy=strategy, num_layers=num_layers,
                            stats=engine.decoder.stats_type.total(s.stats for s in seqs),
                            options=engine.decoder.resolved_options())


def generation_spec(tokenizer: Tokenizer | None, prompts: Prompts, *, strategy: str = "ar",
                    sampling: SamplingOptions | None = None, options: Any = None,
                    chat: bool = False, threads: int | None = None, **overrides: Any
                    ) -> tuple[EngineSpec, SamplingOptions, list[list[int]]]:
    """What :func:`generate` builds its engine from (the arguments are its own): the engine's
    spec, the sampling options and the prompts' token ids. The ranks of a ``torchrun`` job
    build the engine they replay from it."""
    strat = get_strategy(strategy)
    own_fields = {f.name for f in dataclasses.fields(strat.options_type)}
    unknown = sorted(set(overrides) - SAMPLING_FIELDS - own_fields)
    if unknown:
        raise ConfigError(f"unknown generation options {unknown}; sampling options: "
                          f"{sorted(SAMPLING_FIELDS)}, {strategy!r} options: {sorted(own_fields)}")
    own = {k: v for k, v in overrides.items() if k not in SAMPLING_FIELDS}
    opts = strat.options(options, **own)
    sampling = (sampling or SamplingOptions()).replace(
        **{k: v for k, v in overrides.items() if k in SAMPLING_FIELDS})
    prompt_ids = encode_prompts(tokenizer, prompts, chat=chat)
    return (EngineSpec(strategy, opts, tokenizer, len(prompt_ids), None, threads), sampling,
            prompt_ids)


def _streamer(stream: TextCallback | None, index: int) -> Any:
    """An engine update callback feeding ``stream`` the text of sequence ``index``."""
    if stream is None:
        return None
    with_layers = bool(getattr(stream, "wants_layers", False))

    def on_update(update: Update) -> None:
        for piece, layer in update.pieces:
            if with_layers:
                stream(index, piece, layer)  # type: ignore[call-arg]
            else:
                stream(index, piece)

    return on_update


def encode_prompts(
    tokenizer: Tokenizer | None, prompts: Prompts, *, chat: bool = False
) -> list[list[int]]:
    """Token ids of every prompt (text prompts go through ``tokenizer``)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    items = list(prompts)
    if not items:
        raise ConfigError("no prompts given")
    if all(_is_id(x) for x in items):
        return [[int(x) for x in items]]  # type: ignore[call-overload]
    out: list[list[int]] = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise ConfigError("text prompts need a tokenizer; pass token ids instead")
            text = (
                tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p
            )
            out.append(tokenizer.encode(text))
        else:
            if chat:
                raise ConfigError("chat=True needs text prompts, got token ids")
            ids = None if isinstance(p, bytes | Mapping) else _listed(p)
            if ids is None or not all(_is_id(x) for x in ids):
                raise ConfigError(f"prompt {len(out)}: expected a string or a list of integer "
                                  f"token ids, got {_shown(p)}")
            out.append([int(x) for x in ids])
    return out


def _is_id(x: object) -> bool:
    """Whether ``x`` is one token id: an integer (Python, numpy or a 0-d integer tensor)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and not x.is_complex()
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _listed(p: object) -> list[Any] | None:
    """The items of an iterable prompt (a list, tuple, tensor or array), else None."""
    try:
        return list(p)  # type: ignore[call-overload]
    except TypeError:
        return None


def _shown(p: object) -> str:
    """A prompt item named in an error: its type and a short repr."""
    text = repr(p)
    return f"{type(p).__name__} {text[:40] + '...' if len(text) > 40 else text}"
