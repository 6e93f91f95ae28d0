"""Plain autoregressive decoding: the baseline every other strategy is measured against.

One :class:`~exitlm.model.kv_cache.KVCache` holds the whole batch (prompt + new tokens).
Prompts are right-padded (the token at position ``p`` lives in cache slot ``p``), prefilled
with positions ``0..T-1``; each sequence's first token comes from the logits at its own last
prompt position, and every later step feeds one token per sequence at that sequence's own
position. Finished sequences stay in the batch (their outputs are ignored) until all are done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import FinishReason, GenerationResult, SequenceResult, Timings
from exitlm.infer.sampling import choose, make_generator
from exitlm.infer.stopping import TextCallback, TextTracker
from exitlm.model.kv_cache import KVCache
from exitlm.model.layers import decode_threads, gemv_bound
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class AROptions:
    """Options of plain autoregressive decoding (none so far beyond :class:`SamplingOptions`)."""


def prefill(
    model: EarlyExitLM, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Run right-padded prompts ``tokens`` ``(B, T)`` through the model, filling ``cache``;
    return the final logits ``(B, V)`` at each sequence's last real position."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    ctx = model.context(positions, cache)
    h = model.embed(tokens, positions)
    h = model.run_layers(h, 0, model.num_layers, cache=cache, ctx=ctx)
    last = h[torch.arange(b, device=h.device), lengths.to(h.device) - 1]  # (B, D)
    return model.final_logits(last)


def generate_ar(
    model: EarlyExitLM,
    prompt_ids: list[list[int]],
    sampling: SamplingOptions,
    *,
    tokenizer: Tokenizer | None = None,
    stream: TextCallback | None = None,
    options: AROptions | None = None,
    start_time: float | None = None,
) -> GenerationResult:
    """Generate continuations of ``prompt_ids`` (one list of token ids per sequence).

    Stops each sequence independently at a stop token (the model's EOS unless
    ``sampling.ignore_eos``, plus ``sampling.stop_token_ids``), a stop string, or after
    ``sampling.max_new_tokens`` tokens.
    """
    t_start = time.perf_counter() if start_time is None else start_time
    cfg = model.config
    num_layers = model.num_layers
    b = len(prompt_ids)
    lens = [len(p) for p in prompt_ids]
    if b == 0 or min(lens) == 0:
        raise ValueError("every prompt needs at least one token (add a BOS token to empty ones)")
    t = max(lens)
    max_new = sampling.max_new_tokens
    if cfg.pos == "learned" and t + max_new > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({t} tokens) + max_new_tokens ({max_new}) exceeds the model's "
            f"{cfg.max_seq_len} learned positions; lower max_new_tokens or shorten the prompt"
        )
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids.update(cfg.eos_token_ids)
        if tokenizer is not None:
            stop_ids.update(tokenizer.eos_token_ids)
    trackers = [
        TextTracker(tokenizer, i, stop_strings=sampling.stop_strings, stream=stream)
        for i in range(b)
    ]
    finish: list[FinishReason | None] = [None] * b
    timings = Timings(prompt_tokens=sum(lens))

    if max_new == 0:
        return _result(trackers, finish, lens, timings, num_layers, t_start)

    device = model.embed_tokens.weight.device
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    tokens = torch.full((b, t), pad, dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor(lens, dtype=torch.long)
    generator = None if sampling.greedy else make_generator(sampling, device)

    with torch.inference_mode():
        cache = model.new_cache(b, t + max_new)
        t0 = time.perf_counter()
        logits = prefill(model, tokens.to(device), lengths, cache)
        cache.lengths = lengths.clone()
        nxt = choose(logits, sampling, generator)  # (B,)
        ids = nxt.tolist()
        t1 = time.perf_counter()
        timings.prefill_s = t1 - t0
        timings.time_to_first_token_s = t1 - t_start
        active = _record(ids, trackers, finish, stop_ids, max_new)
        positions = lengths.to(device)[:, None].clone()  # (B, 1): each sequence's next slot
        decode_tokens = 0
        with decode_threads(b == 1 and gemv_bound(model.embed_tokens.weight.dtype, device)):
            while active:
                h = model.embed(nxt[:, None], positions)
                ctx = model.context(positions, cache)
                h = model.run_layers(h, 0, num_layers, cache=cache, ctx=ctx)
                logits = model.final_logits(h[:, -1])  # (B, V)
                positions += 1
                cache.lengths += 1
                nxt = choose(logits, sampling, generator)
                ids = nxt.tolist()
                decode_tokens += active
                active = _record(ids, trackers, finish, stop_ids, max_new)
        t2 = time.perf_counter()
    timings.decode_s = t2 - t1
    timings.decode_tokens = decode_tokens
    return _result(trackers, finish, lens, timings, num_layers, t_start)


def _record(
    ids: list[int],
    trackers: list[TextTracker],
    finish: list[FinishReason | None],
    stop_ids: set[int],
    max_new: int,
) -> int:
    """Append each unfinished sequence's new token, update its finish state; return how many
    sequences are still running."""
    active = 0
    for i, tok in enumerate(ids):
        if finish[i] is not None:
            continue
        tr = trackers[i]
        if tr.push(tok):
            finish[i] = "stop_string"
        elif tok in stop_ids:
            finish[i] = "stop_token"
        elif len(tr.ids) >= max_new:
            finish[i] = "length"
        else:
            active += 1
    return active


def _result(
    trackers: list[TextTracker],
    finish: list[FinishReason | None],
    lens: list[int],
    timings: Timings,
    num_layers: int,
    t_start: float,
) -> GenerationResult:
    seqs = []
    for tr, why, n in zip(trackers, finish, lens, strict=True):
        text = tr.finish()
        k = len(tr.ids)
        seqs.append(
            SequenceResult(
                token_ids=list(tr.ids), text=text, exit_layers=[num_layers] * k,
                finish_reason=why or "length", prompt_tokens=n, layer_evaluations=k * num_layers,
            )
        )
    timings.new_tokens = sum(len(s.token_ids) for s in seqs)
    timings.total_s = time.perf_counter() - t_start
    return GenerationResult(seqs, timings, strategy="ar", num_layers=num_layers)
