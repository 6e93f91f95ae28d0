"""The early-exit decoder-only transformer (one class for the Llama family and GPT-2).

Every algorithm in exitlm is a composition of four calls (DESIGN.md, "One model, sliced by
layer range"):

* :meth:`EarlyExitLM.embed` - token (+ learned position) embedding;
* :meth:`EarlyExitLM.run_layers` - layers ``[start, end)`` (0-based slots) on hidden states,
  with explicit positions and an optional :class:`~exitlm.model.kv_cache.KVCache`;
* :meth:`EarlyExitLM.exit_logits` - logits of the exit after layer ``l`` (1-based, as in the
  papers; ``l = L`` is the final output);
* :meth:`EarlyExitLM.final_logits` - final norm + LM head.

The model never imports ``torch.distributed``; parallelism wraps it from ``exitlm.parallel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from exitlm.config import ModelConfig
from exitlm.model.exits import ExitHead
from exitlm.model.kv_cache import KVCache, WritePlan
from exitlm.model.layers import (
    Block,
    Linear,
    Norm,
    attention_dtype,
    linear,
    rope_inv_freq,
    rope_tables,
)


@dataclass
class ModelOutput:
    """Final logits ``(B, T, V)`` and the logits of every requested exit, keyed by layer."""

    logits: torch.Tensor
    exit_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepContext:
    """What one forward over given positions shares across layers: rotary angles, the
    cache write plan and the attention mask."""

    positions: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    plan: WritePlan | None
    mask: torch.Tensor | None


class EarlyExitLM(nn.Module):
    """A decoder-only transformer whose hidden states can exit after any configured layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_positions = (
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos == "learned" else None
        )
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.dim, cfg.norm, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        )
        self.exits = nn.ModuleDict({str(layer): ExitHead(cfg, layer) for layer in cfg.exits.layers})
        self._block_exit_slots = {
            layer: cfg.num_layers + i
            for i, layer in enumerate(cfg.exits.layers)
            if cfg.exits.head == "block"
        }
        if cfg.pos == "rope":
            inv = rope_inv_freq(cfg.hdim, cfg.rope_theta, cfg.rope_scaling)
            self.register_buffer("rope_inv_freq", inv, persistent=False)
        else:
            self.rope_inv_freq = None
        self.apply(self._init_weights)

    # ----- initialisation ------------------------------------------------------------------
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    # ----- shapes and bookkeeping ----------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_cache_slots(self) -> int:
        """Backbone layers plus one slot per exit whose head is a full transformer block."""
        return self.config.num_layers + len(self._block_exit_slots)

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """Allocate a KV cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens."""
        ref = self.embed_tokens.weight
        return KVCache(
            self.num_cache_slots,
            batch_size,
            max_seq_len or self.config.max_seq_len,
            self.config.n_kv_heads,
            self.config.hdim,
            dtype=dtype or attention_dtype(ref.dtype, ref.device),
            device=device or ref.device,
        )

    def output_embedding(self) -> torch.Tensor:
        """The final LM head's weight ``(V, D)`` (the input embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ----- composable pieces ---------------------------------------------------------------
    def context(self, positions: torch.Tensor, cache: KVCache | None = None) -> StepContext:
        """Rotary angles, cache write plan and attention mask for a forward at ``positions``."""
        rope = None
        if self.rope_inv_freq is not None:
            angles = positions[..., None].to(self.rope_inv_freq) * self.rope_inv_freq  # (B,T,D/2)
            ref = self.embed_tokens.weight
            rope = rope_tables(angles, attention_dtype(ref.dtype, ref.device))  # (B, T, 1, D)
        plan = cache.plan(positions) if cache is not None else None
        mask = None
        t = positions.shape[1]
        if plan is not None:
            last = positions[:, -1]
            if not (t == 1 and bool((last == plan.end - 1).all())):
                slots = torch.arange(plan.end, device=positions.device)
                mask = slots[None, None, None, :] <= positions[:, None, :, None]  # (B,1,T,S)
        return StepContext(positions, rope, plan, mask)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``(B, T, D)``, plus learned position embeddings for GPT-2."""
        h = self.embed_tokens(tokens)
        if self.embed_positions is not None:
            if positions is None:
                positions = default_positions(tokens)
            if int(positions.max()) >= self.config.max_seq_len:
                raise ValueError(
                    f"position {int(positions.max())} exceeds the model's learned positions "
                    f"(max_seq_len={self.config.max_seq_len})"
                )
            h = h + self.embed_positions(positions)
        return h

    def run_layers(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
        active: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run transformer layers ``[start, end)`` (0-based slots) on ``h`` ``(B, T, D)``.

        With a cache, keys/values are written at ``positions`` and attention reads every
        slot up to each query's own position. Without one, attention is causal over ``h``.

        ``active`` (training only, LayerSkip Eq. 1 layer dropout): one entry per layer in the
        range, either ``None`` (every sequence runs the layer) or a 1-D index tensor of the
        batch rows that run it; the other rows skip the layer (identity). Skipped rows are
        removed from the layer's computation, so dropout saves real compute.
        """
        if not 0 <= start <= end <= self.num_layers:
            raise ValueError(
                f"layer range [{start}, {end}) is outside [0, {self.num_layers}]"
            )
        if active is not None and len(active) != end - start:
            raise ValueError(
                f"active needs one entry per layer in [{start}, {end}), got {len(active)}"
            )
        if active is not None and cache is not None:
            raise ValueError("layer dropout (active=...) is for training; pass cache=None")
        if ctx is None:
            if positions is None:
                positions = default_positions(h[..., 0])
            ctx = self.context(positions, cache)
        for i in range(start, end):
            rows = None if active is None else active[i - start]
            if rows is None:
                h = self.layers[i](h, ctx.rope, cache, i, ctx.plan, ctx.mask)
            elif rows.numel() > 0:
                rope = None if ctx.rope is None else (ctx.rope[0][rows], ctx.rope[1][rows])
                mask = None if ctx.mask is None else ctx.mask[rows]
                out = self.layers[i](h[rows], rope, None, i, None, mask)
                h = h.index_copy(0, rows, out)
        return h

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the last layer (final norm + LM head)."""
        return linear(self.norm(h), self.output_embedding())

    def exit_logits(
        self,
        h: torch.Tensor,
        layer: int,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
    ) -> torch.Tensor:
        """Logits of the exit after layer ``layer`` (1-based; ``layer == L`` is final).

        ``h`` is the hidden state after that layer. Layers without their own head exit
        through the final norm and LM head when ``exits.every_layer`` is set (LayerSkip).
        """
        return linear(*self.exit_features(h, layer, positions, cache, ctx))

    def exit_features(
        self,
        h: torch.Tensor,
        layer: int,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exit's input to its output embedding and that embedding ``(V, D)``:
        ``exit_logits == linear(*exit_features(...))``. Decoders that need only some
        vocabulary rows (a restricted draft vocabulary) project onto a slice of the weight."""
        if layer == self.num_layers:
            return self.norm(h), self.output_embedding()
        head = self.exits[str(layer)] if str(layer) in self.exits else None  # noqa: SIM401
        if head is None:
            if not self.config.exits.every_layer:
                raise ValueError(
                    f"the model has no exit at layer {layer}; configured exits: "
                    f"{list(self.config.exits.layers)} (set exits.layers or exits.every_layer)"
                )
            return self.norm(h), self.output_embedding()
        if head.block is not None:
            if ctx is None:
                if positions is None:
                    positions = default_positions(h[..., 0])
                ctx = self.context(positions, cache)
            h = head.block(h, ctx.rope, cache, self._block_exit_slots[layer], ctx.plan, ctx.mask)
        if head.mlp is not None:
            h = h + head.mlp(head.mlp_norm(h))
        norm = self.config.exits.norm
        if norm == "own":
            h = head.norm(h)
        elif norm == "final":
            h = self.norm(h)
        out = self.config.exits.output
        if out == "own":
            weight = head.proj.weight
        elif out == "tied_embedding":
            weight = self.embed_tokens.weight
        else:
            weight = self.output_embedding()
        return h, weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        exit_layers: tuple[int, ...] | None = None,
    ) -> ModelOutput:
        """Full forward; ``exit_layers`` (default: the configured exits) are also computed."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        if positions is None:
            positions = default_positions(tokens)
        want = self.config.exits.layers if exit_layers is None else tuple(exit_layers)
        ctx = self.context(positions, cache)
        h = self.embed(tokens, positions)
        exits: dict[int, torch.Tensor] = {}
        done = 0
        for layer in sorted(want):
            h = self.run_layers(h, done, layer, cache=cache, ctx=ctx)
            done = layer
            exits[layer] = self.exit_logits(h, layer, cache=cache, ctx=ctx)
        h = self.run_layers(h, done, self.num_layers, cache=cache, ctx=ctx)
        return ModelOutput(self.final_logits(h), exits)

    def num_parameters(self, *, exits_only: bool = False) -> int:
        """Number of distinct parameters (tied tensors counted once)."""
        mods = self.exits.parameters() if exits_only else self.parameters()
        return sum(p.numel() for p in mods)


def default_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Positions ``0..T-1`` for every row of ``tokens`` ``(B, T)``."""
    b, t = tokens.shape[:2]
    return torch.arange(t, device=tokens.device).expand(b, t)
