"""Bookkeeping shared by the early-exit decoding strategies (early exit, self-speculative,
PPD): padded prompt batches, per-sequence stopping, per-token exit layers, timings and the
common :class:`~exitlm.infer.result.GenerationResult`.

Every strategy here follows the cache convention of :mod:`exitlm.model.kv_cache` (the token at
position ``p`` lives in cache slot ``p``, prompts are right-padded) and decides *which* tokens
are appended; :class:`Session` turns those decisions into results exactly like
:func:`exitlm.infer.autoregressive.generate_ar` does (same stop rules, same streaming).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import FinishReason, GenerationResult, SequenceResult, Timings
from exitlm.infer.sampling import make_generator
from exitlm.infer.stopping import TextCallback, TextTracker
from exitlm.model.kv_cache import KVCache
from exitlm.model.layers import linear
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer


class Session:
    """One generation call: padded prompts, trackers, finish states, exit layers, timings.

    Args:
        model: the model (its device and dtype are used).
        prompt_ids: one list of token ids per sequence.
        sampling: token choice and stopping rules.
        tokenizer: decodes text (``None``: token ids only).
        stream: streaming callback (see :class:`TextTracker`); a callback with a true
            ``wants_layers`` attribute is called as ``stream(index, piece, exit_layer)`` with
            the exit layer of the token that completed the piece (``exitlm generate
            --show-exits``).
        start_time: ``time.perf_counter()`` at the start of the call.
        extra_slots: cache slots needed past ``prompt + max_new_tokens`` (speculative
            strategies write draft tokens past the last one they keep).
    """

    def __init__(
        self,
        model: EarlyExitLM,
        prompt_ids: list[list[int]],
        sampling: SamplingOptions,
        *,
        tokenizer: Tokenizer | None,
        stream: TextCallback | None,
        start_time: float | None,
        extra_slots: int = 0,
    ) -> None:
        self.t_start = time.perf_counter() if start_time is None else start_time
        self.model = model
        self.sampling = sampling
        cfg = model.config
        self.b = len(prompt_ids)
        self.lens = [len(p) for p in prompt_ids]
        if self.b == 0 or min(self.lens) == 0:
            raise ValueError(
                "every prompt needs at least one token (add a BOS token to empty ones)"
            )
        self.t = max(self.lens)
        self.max_new = sampling.max_new_tokens
        if cfg.pos == "learned" and self.t + self.max_new + extra_slots > cfg.max_seq_len:
            raise ValueError(
                f"prompt ({self.t} tokens) + max_new_tokens ({self.max_new}) + {extra_slots} "
                f"draft slots exceeds the model's {cfg.max_seq_len} learned positions; lower "
                "max_new_tokens or shorten the prompt"
            )
        self.capacity = self.t + self.max_new + extra_slots + 1
        self.stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self.stop_ids.update(cfg.eos_token_ids)
            if tokenizer is not None:
                self.stop_ids.update(tokenizer.eos_token_ids)
        self._pushing_layer = [0] * len(prompt_ids)
        if stream is not None and getattr(stream, "wants_layers", False):
            user = stream

            def stream(i: int, piece: str) -> None:  # pass the exit layer of the token
                user(i, piece, self._pushing_layer[i])  # type: ignore[call-arg]

        self.trackers = [
            TextTracker(tokenizer, i, stop_strings=sampling.stop_strings, stream=stream)
            for i in range(self.b)
        ]
        self.finish: list[FinishReason | None] = [None] * self.b
        self.exit_layers: list[list[int]] = [[] for _ in range(self.b)]
        self.layer_evals = [0] * self.b
        self.seq_stats: list[dict[str, Any]] = [{} for _ in range(self.b)]
        self.timings = Timings(prompt_tokens=sum(self.lens))
        self.device = model.embed_tokens.weight.device
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        tokens = torch.full((self.b, self.t), pad, dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.tokens = tokens.to(self.device)
        self.lengths = torch.tensor(self.lens, dtype=torch.long)
        self.generator = None if sampling.greedy else make_generator(sampling, self.device)
        self._t_prefill_start = 0.0
        self._t_first = 0.0

    # ----- state ---------------------------------------------------------------------------
    def running(self, i: int) -> bool:
        return self.finish[i] is None

    @property
    def num_running(self) -> int:
        return sum(f is None for f in self.finish)

    def remaining(self, i: int) -> int:
        """How many more tokens sequence ``i`` may produce."""
        return 0 if self.finish[i] is not None else self.max_new - len(self.trackers[i].ids)

    def new_cache(self) -> KVCache:
        return self.model.new_cache(self.b, self.capacity)

    # ----- recording -----------------------------------------------------------------------
    def push(self, i: int, tokens: list[int], layers: list[int]) -> int:
        """Append ``tokens`` (chosen at exit ``layers``) to sequence ``i`` until it stops;
        return how many were kept."""
        kept = 0
        for tok, layer in zip(tokens, layers, strict=True):
            if self.finish[i] is not None:
                break
            tr = self.trackers[i]
            kept += 1
            self.exit_layers[i].append(layer)
            self._pushing_layer[i] = layer
            if tr.push(tok):
                self.finish[i] = "stop_string"
            elif tok in self.stop_ids:
                self.finish[i] = "stop_token"
            elif len(tr.ids) >= self.max_new:
                self.finish[i] = "length"
        return kept

    def start_prefill(self) -> None:
        self._t_prefill_start = time.perf_counter()

    def end_prefill(self) -> None:
        """Call once the first token of every sequence is recorded."""
        self._t_first = time.perf_counter()
        self.timings.prefill_s = self._t_first - self._t_prefill_start
        self.timings.time_to_first_token_s = self._t_first - self.t_start

    def result(self, strategy: str, stats: dict[str, Any] | None = None) -> GenerationResult:
        """The :class:`GenerationResult` of the call (decode timings end now)."""
        t_end = time.perf_counter()
        if self._t_first:
            self.timings.decode_s = t_end - self._t_first
        seqs = []
        for i, tr in enumerate(self.trackers):
            text = tr.finish()
            seqs.append(
                SequenceResult(
                    token_ids=list(tr.ids), text=text, exit_layers=list(self.exit_layers[i]),
                    finish_reason=self.finish[i] or "length", prompt_tokens=self.lens[i],
                    layer_evaluations=self.layer_evals[i], stats=dict(self.seq_stats[i]),
                )
            )
        self.timings.new_tokens = sum(len(s.token_ids) for s in seqs)
        self.timings.decode_tokens = sum(max(0, len(s.token_ids) - 1) for s in seqs)
        self.timings.total_s = time.perf_counter() - self.t_start
        return GenerationResult(seqs, self.timings, strategy=strategy,
                                num_layers=self.model.num_layers, stats=dict(stats or {}))


def prefill_hidden(
    model: EarlyExitLM, tokens: torch.Tensor, cache: KVCache, end: int | None = None,
    exits: tuple[int, ...] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run right-padded prompts ``(B, T)`` through layers ``[0, end)`` filling ``cache``.

    Returns the hidden states ``(B, T, D)`` after layer ``end`` and the hidden states after each
    layer in ``exits``. Exits whose head is a transformer block get their own cache slot
    filled too (later tokens attend to the prompt's keys/values in that block).
    """
    end = model.num_layers if end is None else end
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    ctx = model.context(positions, cache)
    h = model.embed(tokens, positions)
    at: dict[int, torch.Tensor] = {}
    done = 0
    for layer in sorted(x for x in exits if x <= end):
        h = model.run_layers(h, done, layer, cache=cache, ctx=ctx)
        done = layer
        at[layer] = h
        fill_exit_block(model, h, layer, ctx, cache)
    h = model.run_layers(h, done, end, cache=cache, ctx=ctx)
    return h, at


def require_exit(model: EarlyExitLM, layer: int, setting: str) -> int:
    """``layer`` if the model can exit there, else a ConfigError naming ``setting``."""
    cfg = model.config
    if layer not in cfg.exit_layers:
        raise ConfigError(
            f"{setting} {layer} is not an early exit of this model (configured: "
            f"{list(cfg.exits.layers)}, every_layer={cfg.exits.every_layer}); it must lie in "
            f"[1, {model.num_layers - 1}]"
        )
    return layer


def has_block_head(model: EarlyExitLM, layer: int) -> bool:
    """Whether the exit after ``layer`` is a full transformer block with its own KV slot."""
    head = model.exits[str(layer)] if str(layer) in model.exits else None  # noqa: SIM401
    return head is not None and head.block is not None


def block_slot(model: EarlyExitLM, layer: int) -> int:
    """The cache slot of a block-type exit head (after the backbone's layers, in exit order)."""
    return model.num_layers + model.config.exits.layers.index(layer)


def fill_exit_block(
    model: EarlyExitLM, h: torch.Tensor, layer: int, ctx: Any, cache: KVCache
) -> None:
    """Write the keys/values of a block-type exit head for every position of ``h``
    (EE-LLM App. D.1 "layer" exits attend over earlier tokens, so their cache slot must be
    complete); a no-op for exits without a block."""
    if has_block_head(model, layer) and layer < model.num_layers:
        model.exit_logits(h, layer, cache=cache, ctx=ctx)


def last_positions(h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``h[b, lengths[b] - 1]`` for every row: ``(B, D)``."""
    rows = torch.arange(h.shape[0], device=h.device)
    return h[rows, lengths.to(h.device) - 1]


class DraftHead:
    """Exit ``E``'s logits over the first ``vocab`` token ids: the exit's features
    (:meth:`~exitlm.model.transformer.EarlyExitLM.exit_features`) times a copy of the first
    ``vocab`` rows of its output embedding, laid out like the model's own weights
    (:func:`~exitlm.model.layout.optimize_layout`). With the whole vocabulary it is exactly
    ``exit_logits``."""

    def __init__(self, model: EarlyExitLM, layer: int, vocab: int) -> None:
        self.model = model
        self.layer = layer
        self.vocab = vocab
        self._weight: torch.Tensor | None = None
        self._source: tuple[int, int] | None = None
        self._keep: torch.nn.Module | None = None

    def _sliced(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight._version)
        if self._weight is None or self._source != key:
            from exitlm.model.layout import optimize_layout

            with torch.inference_mode(False):  # a normal tensor: layout code tracks versions
                lin = torch.nn.Linear(weight.shape[1], self.vocab, bias=False,
                                      dtype=weight.dtype, device=weight.device)
                lin.weight.requires_grad_(False)
                lin.weight.data = weight[: self.vocab].clone().contiguous()
                optimize_layout(lin)
            self._keep, self._weight, self._source = lin, lin.weight, key
        return self._weight

    def __call__(self, h: torch.Tensor, ctx: object, cache: object) -> torch.Tensor:
        feats, weight = self.model.exit_features(
            h, self.layer, cache=cache, ctx=ctx)  # type: ignore[arg-type]
        if self.vocab >= weight.shape[0]:
            return linear(feats, weight)
        return linear(feats, self._sliced(weight))
