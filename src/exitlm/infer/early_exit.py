"""Early-exit decoding: confidence exits (EE-LLM), fixed-layer exit (LayerSkip), state copying.

Three ways to emit a token before the last layer, chosen by :class:`EarlyExitOptions`:

* ``kv="recompute"`` (default; EE-LLM Sec. 4, App. D.3): at each checked exit in order, emit
  the token when the exit's maximum probability reaches ``threshold``. Keys/values the exited
  token skipped are recomputed in the next forward (:mod:`exitlm.infer.kv_recompute`), so the
  model never attends to an approximate entry: with ``threshold=1.0`` the output is exactly
  greedy decoding, and for any threshold it equals a cache-free full-prefix reference under the
  same exit rule. The *predictions* made at early exits are of course the exits' own.
* ``exit_layer=E`` (LayerSkip Sec. 4.2): every token runs the first ``E`` layers and leaves
  through exit ``E``; layers past ``E`` are never run, so no KV is missing. **Lossy**: this is
  a shallower model.
* ``kv="copy"`` (CALM-style state propagation, EE-LLM Sec. 4 "state propagation"): an exited
  token's hidden state at its exit is copied up to every skipped layer and only that layer's
  key/value projections are computed from it. **Lossy**: later tokens attend to approximate
  keys/values, so even the full-depth predictions drift. Offered for comparison only.

Layer evaluations (``SequenceResult.layer_evaluations``) count token x layer passes through
transformer layers, recomputation included; the copy mode's projections are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from exitlm.config import ConfigError
from exitlm.infer.common import (
    Session,
    has_block_head,
    last_positions,
    prefill_hidden,
)
from exitlm.infer.kv_recompute import RecomputeDecoder
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import GenerationResult
from exitlm.infer.sampling import choose
from exitlm.infer.stopping import TextCallback
from exitlm.model.layers import apply_rope
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class EarlyExitOptions:
    """Options of the ``early-exit`` strategy.

    Attributes:
        threshold: confidence threshold on an exit's maximum probability (EE-LLM);
            ``1.0`` never exits early (exactly greedy decoding).
        exit_layers: the 1-based exits checked, in order (default: the model's configured
            exit heads; for a LayerSkip model with only ``every_layer`` exits, the layers at
            1/4, 1/2 and 3/4 depth - each check costs an LM-head projection).
        max_pending: force a full-model pass once this many tokens wait for KV recomputation
            (EE-LLM App. D.3).
        kv: ``recompute`` (exact KV, EE-LLM) or ``copy`` (CALM state copying, lossy).
        exit_layer: fixed-layer exit at ``E`` (LayerSkip Sec. 4.2, lossy); overrides the
            confidence rule.
    """

    threshold: float = 0.9
    exit_layers: tuple[int, ...] | None = None
    max_pending: int = 8
    kv: Literal["recompute", "copy"] = "recompute"
    exit_layer: int | None = None

    def __post_init__(self) -> None:
        if self.exit_layers is not None:
            layers = tuple(sorted({int(x) for x in self.exit_layers}))
            object.__setattr__(self, "exit_layers", layers)
        if not self.threshold >= 0.0:
            raise ConfigError(f"threshold must be >= 0 (1.0 = never exit), got {self.threshold}")
        if self.max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.kv not in ("recompute", "copy"):
            raise ConfigError(f"kv must be 'recompute' or 'copy', got {self.kv!r}")


def resolve_checks(model: EarlyExitLM, opts: EarlyExitOptions) -> tuple[int, ...]:
    """The exits checked (see :attr:`EarlyExitOptions.exit_layers`), validated."""
    num_layers = model.num_layers
    available = set(model.config.exit_layers)
    if opts.exit_layers is not None:
        checks = opts.exit_layers
    elif model.config.exits.layers:
        checks = model.config.exits.layers
    elif model.config.exits.every_layer:
        checks = tuple(sorted({max(1, num_layers * k // 4) for k in (1, 2, 3)} - {num_layers}))
    else:
        raise ConfigError(
            "the model has no early exits; load it with exits (e.g. "
            "load_model(..., exits=ExitConfig(every_layer=True))) or use strategy 'ar'"
        )
    bad = [e for e in checks if e not in available]
    if bad:
        raise ConfigError(
            f"exit_layers {bad} are not exits of this model; available: "
            f"{sorted(available) if len(available) < 40 else f'1..{num_layers - 1}'}"
        )
    return tuple(checks)


def generate_early_exit(
    model: EarlyExitLM,
    prompt_ids: list[list[int]],
    sampling: SamplingOptions,
    *,
    tokenizer: Tokenizer | None = None,
    stream: TextCallback | None = None,
    options: EarlyExitOptions | None = None,
    start_time: float | None = None,
) -> GenerationResult:
    """Run the ``early-exit`` strategy (see the module docstring); batches exit per sequence."""
    opts = options or EarlyExitOptions()
    s = Session(model, prompt_ids, sampling, tokenizer=tokenizer, stream=stream,
                start_time=start_time)
    if opts.exit_layer is not None:
        return _fixed_exit(model, s, opts.exit_layer)
    checks = resolve_checks(model, opts)
    if opts.kv == "copy" and any(has_block_head(model, e) for e in checks):
        raise ConfigError("kv='copy' does not support block exit heads; use kv='recompute'")
    num_layers = model.num_layers
    cache = s.new_cache()
    with torch.inference_mode():
        s.start_prefill()
        h, _ = prefill_hidden(model, s.tokens, cache, exits=checks)
        cache.lengths = s.lengths.clone()
        cache.fill[:] = s.lengths[None, :]  # padded slots past each prompt hold nothing
        nxt = choose(model.final_logits(last_positions(h, s.lengths)), sampling, s.generator)
        for i, tok in enumerate(nxt.tolist()):
            s.push(i, [tok], [num_layers])
            s.layer_evals[i] += num_layers
        s.end_prefill()
        cls = CopyDecoder if opts.kv == "copy" else RecomputeDecoder
        dec = cls(model, cache, checks, opts.threshold, opts.max_pending, sampling, s.generator)
        while s.num_running:
            toks, layers, evals = dec.step(nxt)
            for i in range(s.b):
                if s.running(i):
                    s.push(i, [toks[i]], [layers[i]])
                    s.layer_evals[i] += evals[i]
            nxt = torch.tensor(toks, device=s.device)
    return s.result("early-exit", exit_stats(s.exit_layers, num_layers, s.layer_evals) | {
        "threshold": opts.threshold, "exit_layers_checked": list(checks), "kv": opts.kv,
        "max_pending": opts.max_pending,
    })


def exit_stats(
    exit_layers: list[list[int]], num_layers: int, layer_evals: list[int]
) -> dict[str, float]:
    """Aggregates over a batch: early-exit fraction, mean exit layer, and the layer-evaluation
    speed-up ``tokens * L / evaluations`` (1 for plain decoding)."""
    flat = [x for seq in exit_layers for x in seq]
    n = max(1, len(flat))
    return {
        "early_exit_fraction": sum(x < num_layers for x in flat) / n,
        "mean_exit_layer": sum(flat) / n,
        "layer_speedup": len(flat) * num_layers / max(1, sum(layer_evals)),
    }


def _fixed_exit(model: EarlyExitLM, s: Session, exit_layer: int) -> GenerationResult:
    """LayerSkip Sec. 4.2: every token runs layers ``1..E`` and leaves through exit ``E``."""
    num_layers = model.num_layers
    if exit_layer != num_layers and exit_layer not in model.config.exit_layers:
        raise ConfigError(
            f"exit_layer {exit_layer} is not an exit of this model (configured: "
            f"{list(model.config.exits.layers)}, every_layer={model.config.exits.every_layer})"
        )
    cache = s.new_cache()
    with torch.inference_mode():
        s.start_prefill()
        h, _ = prefill_hidden(model, s.tokens, cache, end=exit_layer)
        b, t = s.tokens.shape
        if has_block_head(model, exit_layer):  # the block's own slot needs the whole prompt
            positions = torch.arange(t, device=s.device).expand(b, t)
            ctx = model.context(positions, cache)
            all_logits = model.exit_logits(h, exit_layer, cache=cache, ctx=ctx)
            logits = last_positions(all_logits, s.lengths)
        else:
            logits = model.exit_logits(last_positions(h, s.lengths)[:, None], exit_layer)[:, 0]
        cache.lengths = s.lengths.clone()
        nxt = choose(logits, s.sampling, s.generator)
        for i, tok in enumerate(nxt.tolist()):
            s.push(i, [tok], [exit_layer])
            s.layer_evals[i] += exit_layer
        s.end_prefill()
        positions = s.lengths.to(s.device)[:, None].clone()
        while s.num_running:
            ctx = model.context(positions, cache)
            h = model.embed(nxt[:, None], positions)
            h = model.run_layers(h, 0, exit_layer, cache=cache, ctx=ctx)
            logits = model.exit_logits(h, exit_layer, cache=cache, ctx=ctx)[:, -1]
            positions += 1
            cache.lengths += 1
            nxt = choose(logits, s.sampling, s.generator)
            for i, tok in enumerate(nxt.tolist()):
                if s.running(i):
                    s.push(i, [tok], [exit_layer])
                    s.layer_evals[i] += exit_layer
    return s.result("early-exit", exit_stats(s.exit_layers, num_layers, s.layer_evals) | {
        "exit_layer": exit_layer, "lossy": exit_layer < num_layers,
    })


class CopyDecoder(RecomputeDecoder):
    """CALM-style state copying (lossy, for comparison): an exited token's exit-layer hidden
    state stands in for its skipped layers' inputs; only their key/value projections are
    computed, so nothing is ever pending and every step is one token deep."""

    def _commit(self, q: torch.Tensor, fill_old: torch.Tensor, exit_at: list[int | None]) -> None:
        model, cache = self.model, self.cache
        exits = torch.tensor([int(e) for e in exit_at if e is not None])  # (B,)
        start = int(exits.min())
        if start < self.num_layers:
            q_dev = q.to(self.device)
            rows = torch.arange(cache.batch_size, device=self.device)
            state = self.hidden[rows, q_dev][:, None]  # (B, 1, D): each row's exit state
            rope = model.context(q_dev[:, None]).rope
            for layer in range(start, self.num_layers):
                sel = (exits <= layer).nonzero().flatten().to(self.device)
                k, v = state_kv(model, layer, state[sel], None if rope is None else
                                (rope[0][sel], rope[1][sel]))
                cache.keys[layer][sel, :, q_dev[sel]] = k[:, :, 0].to(cache.keys[layer].dtype)
                cache.values[layer][sel, :, q_dev[sel]] = v[:, :, 0].to(cache.keys[layer].dtype)
        cache.fill = torch.maximum(fill_old, (q + 1)[None, :])
        cache.lengths = q + 1


def state_kv(
    model: EarlyExitLM, layer: int, h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``(n, Hkv, T, D)`` that layer ``layer`` (0-based) computes from input
    hidden states ``h`` ``(n, T, D)`` - the key/value half of the layer's attention only
    (CALM state propagation needs nothing else)."""
    blk = model.layers[layer]
    attn = blk.attn
    n, t, _ = h.shape
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.wqkv(blk.norm_attn(h))
    _, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    k = k.view(n, t, hkv, d).transpose(1, 2)  # (n, Hkv, T, D)
    v = v.view(n, t, hkv, d).transpose(1, 2)
    if rope is not None:
        k = apply_rope(k, *rope)
    return k, v
