"""The early-exit decoder-only transformer (one class for the Llama family and GPT-2).

Every algorithm in exitlm is a composition of a few calls (docs/architecture.md, "Model,
runner, strategy, engine, executor"):

* :meth:`EarlyExitLM.embed` - token (+ learned position) embedding;
* :meth:`EarlyExitLM.run_layers` - layers ``[start, end)`` (0-based slots) on hidden states,
  with explicit positions and an optional :class:`~exitlm.model.kv_cache.KVCache`;
* :meth:`EarlyExitLM.walk` - the same, stopping after each layer of a set of exits: the one
  loop every multi-exit computation (forward, losses, evaluation, prefill, pipeline stages)
  goes through;
* :meth:`EarlyExitLM.exit_logits` - logits of the exit after layer ``l`` (1-based, as in the
  papers; ``l = L`` is the final output), following :meth:`EarlyExitLM.exit_route`, the one
  place that says which head, norm, output matrix and cache slot an exit uses;
* :meth:`EarlyExitLM.final_logits` - final norm + LM head.

The model never imports ``torch.distributed``; parallelism wraps it from ``exitlm.train.parallel``.
It never knows which kernels run it either: a runtime runner (:mod:`exitlm.runtime`) passes
its products through :class:`StepContext` (``ops``) and leaves the model as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from exitlm.config import ConfigError, ModelConfig
from exitlm.model.exits import ExitHead
from exitlm.model.kv_cache import KVCache, WritePlan
from exitlm.model.layers import (
    Block,
    Linear,
    Norm,
    Products,
    attention_dtype,
    rope_inv_freq,
    rope_tables,
)


@dataclass
class ModelOutput:
    """Final logits ``(B, T, V)`` and the logits of every requested exit, keyed by layer."""

    logits: torch.Tensor
    exit_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ExitRoute:
    """How the exit after layer ``layer`` turns a hidden state into logits (EE-LLM App. D.1,
    LayerSkip Sec. 4.2): ``h -> [head.block | head.mlp] -> norm -> output embedding``.

    Attributes:
        layer: the 1-based layer (``L`` is the final output).
        head: the exit's own parameters (:class:`~exitlm.model.exits.ExitHead`), or ``None``
            when it exits through the shared final norm and LM head (LayerSkip, the final
            output, or a shared-head evaluation of any layer).
        norm: ``own`` (the head's norm), ``final`` (the backbone's) or ``none``.
        output: ``own`` (the head's matrix), ``tied_embedding`` (the input embedding) or
            ``final_head`` (the LM head, which is the input embedding when tied).
        cache_slot: the KV-cache slot of a block head (``None`` for other heads).
    """

    layer: int
    head: ExitHead | None
    norm: Literal["own", "final", "none"]
    output: Literal["own", "tied_embedding", "final_head"]
    cache_slot: int | None

    @property
    def has_block(self) -> bool:
        """Whether the exit runs a transformer block of its own (with its own KV slot)."""
        return self.head is not None and self.head.block is not None

    @property
    def kind(self) -> str:
        """``final``, ``shared`` (final norm + head at an earlier layer) or the head type."""
        if self.head is not None:
            return "block" if self.has_block else "mlp" if self.head.mlp is not None else "linear"
        return "shared"


@dataclass
class StepContext:
    """What one forward over given positions shares across layers: rotary angles, the
    cache write plan, the attention mask, and the kernels its products run on (``ops``,
    :data:`~exitlm.model.layers.Products`; ``None``: each layer's own forward)."""

    positions: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    plan: WritePlan | None
    mask: torch.Tensor | None
    ops: Products | None = None


class OutputLayout:
    """How a parallel layout computes the model's output products (every exit's and the LM
    head's logits) when it shards the output embeddings by vocabulary rows: installed with
    :meth:`EarlyExitLM.set_output_layout` (tensor parallelism, :mod:`exitlm.train.parallel`)."""

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Logits ``(..., V)`` of ``h`` on the (sharded) output embedding ``weight``."""
        raise NotImplementedError


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
        self.register_module("tied_head", None)
        """An output copy of the input embedding (a module whose ``weight`` is ``(V, D)``): where
        the input embedding serves as an output embedding (the tied LM head, exits with
        ``output="tied_embedding"``), products read this copy instead and lookups keep the
        embedding (an int8 head, :func:`exitlm.kernels.quantized.quantize_heads`); ``None``:
        the embedding itself."""
        self.exits = nn.ModuleDict({str(layer): ExitHead(cfg, layer) for layer in cfg.exits.layers})
        self._block_exit_slots = {
            layer: cfg.num_layers + i
            for i, layer in enumerate(cfg.exits.layers)
            if cfg.exits.head == "block"
        }
        if cfg.pos == "rope":
            with torch.device("cpu"):  # real arithmetic also while built on ``meta``
                inv = rope_inv_freq(cfg.hdim, cfg.rope_theta, cfg.rope_scaling)
            self.register_buffer("rope_inv_freq", inv.to(torch.get_default_device()),
                                 persistent=False)
        else:
            self.rope_inv_freq = None
        self._rope_cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.output_layout: OutputLayout | None = None
        """A parallel layout's output products (:meth:`set_output_layout`); ``None``: the
        whole vocabulary here."""
        self.token_order: torch.Tensor | None = None
        """Token ids from the most to the least frequent on a corpus
        (:meth:`set_token_order`): a draft vocabulary of ``N`` ids is their first ``N``
        (:meth:`draft_ids`); ``None``: the first ``N`` ids."""
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
        """Allocate a KV cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens,
        holding the key/value heads the layers compute (a tensor-parallel shard's: its own)."""
        ref = self.embed_tokens.weight
        kv_heads = next((b.attn.num_kv_heads for b in self.layers if isinstance(b, Block)),
                        self.config.n_kv_heads)
        return KVCache(
            self.num_cache_slots,
            batch_size,
            max_seq_len or self.config.max_seq_len,
            kv_heads,
            self.config.hdim,
            dtype=dtype or attention_dtype(ref.dtype, ref.device),
            device=device or ref.device,
        )

    def output_embedding(self) -> torch.Tensor:
        """The final LM head's weight ``(V, D)`` (the input embedding when tied, or its output
        copy :attr:`tied_head`)."""
        return self.tied_embedding() if self.lm_head is None else self.lm_head.weight

    def tied_embedding(self) -> torch.Tensor:
        """The input embedding as an output embedding ``(V, D)``: :attr:`tied_head`'s weight
        when the model has that copy, else the embedding's own."""
        copy = self.tied_head
        return self.embed_tokens.weight if copy is None else copy.weight

    # ----- composable pieces ---------------------------------------------------------------
    def context(self, positions: torch.Tensor, cache: KVCache | None = None,
                ops: Products | None = None) -> StepContext:
        """Rotary angles, cache write plan and attention mask for a forward at ``positions``
        (its products on ``ops``, default: the layers' own)."""
        rope = None
        if self.rope_inv_freq is not None:
            ref = self.embed_tokens.weight
            cos, ssin = self._rope_table(positions, attention_dtype(ref.dtype, ref.device))
            rope = (cos[positions], ssin[positions])  # (B, T, 1, D)
        plan = cache.plan(positions) if cache is not None else None
        mask = None
        b, t = positions.shape
        if plan is not None and not (b == 1 and t == 1):  # one position: nothing after it
            last = positions[:, -1]
            if not (t == 1 and bool((last == plan.end - 1).all())):
                slots = torch.arange(plan.end, device=positions.device)
                mask = slots[None, None, None, :] <= positions[:, None, :, None]  # (B,1,T,S)
        return StepContext(positions, rope, plan, mask, ops)

    def _rope_table(self, positions: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``(N, 1, D)`` covering ``positions`` (:func:`rope_tables` of every
        position ``< N``, computed once and grown by doubling): indexing them gives the bits
        computing the angles of ``positions`` gives (elementwise arithmetic), in a fraction of
        the operations - a decoding step builds its context once per token."""
        inv = self.rope_inv_freq
        assert inv is not None
        if positions.numel() == 1:
            low = need = int(positions)
        else:
            lo, hi = torch.aminmax(positions)
            low, need = int(lo), int(hi)
        if low < 0:
            raise ValueError(f"negative position {low}")
        need += 1
        got = self._rope_cache.get(dtype)
        if got is None or got[0] is not inv or got[1].shape[0] < need:
            n = max(256, 1 << (need - 1).bit_length())
            with torch.no_grad():
                angles = torch.arange(n, device=inv.device)[None, :, None].to(inv) * inv
                cos, ssin = rope_tables(angles, dtype)  # (1, n, 1, D)
            got = (inv, cos[0], ssin[0])
            self._rope_cache[dtype] = got
        return got[1], got[2]

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
                h = self.layers[i](h, ctx.rope, cache, i, ctx.plan, ctx.mask, ops=ctx.ops)
            elif rows.numel() > 0:
                rope = None if ctx.rope is None else (ctx.rope[0][rows], ctx.rope[1][rows])
                mask = None if ctx.mask is None else ctx.mask[rows]
                out = self.layers[i](h[rows], rope, None, i, None, mask, ops=ctx.ops)
                h = h.index_copy(0, rows, out)
        return h

    def walk(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        stops: Sequence[int] = (),
        *,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
        active: Sequence[torch.Tensor | None] | None = None,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Run layers ``[start, end)`` and yield ``(layer, h)`` after every 1-based layer of
        ``stops`` in ``[start, end]`` and, last, after ``end`` (once, in increasing order).

        The one walk through a set of exits (multi-exit forward, EE-LLM Eq. 1 losses,
        per-exit evaluation, prefill, pipeline stages); a stop at ``start`` yields ``h``
        unchanged (an exit after a stage's first layer placed on the next stage, EE-LLM
        Optimization 2). ``active`` is LayerSkip's per-layer row selection (see
        :meth:`run_layers`), one entry per model layer.
        """
        points = sorted({int(s) for s in stops if start <= s <= end} | {end})
        done = start
        for p in points:
            rows = None if active is None else active[done:p]
            h = self.run_layers(h, done, p, cache=cache, ctx=ctx, active=rows)
            done = p
            yield p, h

    def exit_route(self, layer: int, *, shared_ok: bool = False,
                   setting: str = "exit layer") -> ExitRoute:
        """How the exit after 1-based ``layer`` computes its logits (see :class:`ExitRoute`).

        Raises a :class:`~exitlm.config.ConfigError` naming ``setting`` when the model cannot
        exit there: the one check of "is this layer an exit". ``shared_ok`` lets any layer
        exit through the final norm and head (per-exit evaluation of an untrained model).
        """
        cfg = self.config
        if not 1 <= layer <= cfg.num_layers or (
            layer < cfg.num_layers and str(layer) not in self.exits
            and not (cfg.exits.every_layer or shared_ok)
        ):
            raise ConfigError(
                f"{setting} {layer} is not an exit of this model (configured exits: "
                f"{list(cfg.exits.layers)}, every_layer={cfg.exits.every_layer}); exits lie in "
                f"[1, {cfg.num_layers - 1}] and {cfg.num_layers} is the final output"
            )
        if layer == cfg.num_layers or str(layer) not in self.exits:
            return ExitRoute(layer, None, "final", "final_head", None)
        ex = cfg.exits
        return ExitRoute(layer, self.exits[str(layer)], ex.norm, ex.output,
                         self._block_exit_slots.get(layer))

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the last layer (final norm + LM head)."""
        return self.project(self.norm(h), self.output_embedding())

    def set_token_order(self, order: torch.Tensor | None) -> None:
        """Rank the vocabulary for draft heads (FR-Spec, arXiv 2502.14856: drafting over the
        most frequent tokens cuts the head's cost and keeps most accepted drafts): ``order``
        is a permutation of ``0..V-1``, most frequent first; ``None`` drops the ranking."""
        if order is None:
            self.token_order = None
            return
        v = self.config.vocab_size
        order = torch.as_tensor(order).to(torch.long).flatten()
        if order.numel() != v or not torch.equal(torch.sort(order).values, torch.arange(v)):
            raise ValueError(f"token order: expected a permutation of the {v} token ids, got "
                             f"{order.numel()} ids")
        self.token_order = order.to(self.embed_tokens.weight.device)

    def draft_ids(self, vocab: int | None) -> torch.Tensor | None:
        """The token ids of a draft vocabulary of ``vocab`` ids: the first ``vocab`` of
        :attr:`token_order`, or ``None`` where they are simply ids ``0..vocab-1`` (no ranking,
        or the whole vocabulary)."""
        order = self.token_order
        if order is None or vocab is None or vocab >= self.config.vocab_size:
            return None
        device = self.embed_tokens.weight.device
        if order.device != device:  # the model moved since
            order = self.token_order = order.to(device)
        return order[:vocab]

    def set_output_layout(self, layout: OutputLayout | None) -> None:
        """Route :meth:`project` through ``layout`` (a parallel layout that shards the output
        embeddings by vocabulary rows; ``None``: back to one process's product)."""
        self.output_layout = layout

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Logits ``h @ weight.T`` of an exit's features on an output embedding ``(V, D)``:
        the one product every exit's and the final head's logits go through. A weight that
        is not a tensor (a quantized weight, :mod:`exitlm.kernels.quant`) computes its own
        product (``weight.linear(h)``); a parallel layout's :attr:`output_layout` computes
        sharded ones."""
        if self.output_layout is not None:
            return self.output_layout.project(h, weight)
        if isinstance(weight, torch.Tensor):
            return F.linear(h, weight)
        return weight.linear(h)

    def exit_logits(
        self,
        h: torch.Tensor,
        layer: int,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
        *,
        shared_ok: bool = False,
    ) -> torch.Tensor:
        """Logits of the exit after layer ``layer`` (1-based; ``layer == L`` is final).

        ``h`` is the hidden state after that layer. Layers without their own head exit
        through the final norm and LM head when ``exits.every_layer`` (LayerSkip) or
        ``shared_ok`` is set (see :meth:`exit_route`).
        """
        return self.project(*self.exit_features(h, layer, positions, cache, ctx,
                                                shared_ok=shared_ok))

    def exit_features(
        self,
        h: torch.Tensor,
        layer: int,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        ctx: StepContext | None = None,
        *,
        shared_ok: bool = False,
        ops: Products | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The exit's input to its output embedding and that embedding ``(V, D)``:
        ``exit_logits == project(*exit_features(...))``. Decoders that need only some
        vocabulary rows (a restricted draft vocabulary) project onto a slice of the weight.
        A head's products run on ``ops`` (or ``ctx.ops``; default: its layers' own)."""
        route = self.exit_route(layer, shared_ok=shared_ok)
        head = route.head
        if ctx is not None:
            ops = ctx.ops
        if head is not None and head.block is not None:
            assert route.cache_slot is not None
            if ctx is None:
                if positions is None:
                    positions = default_positions(h[..., 0])
                ctx = self.context(positions, cache, ops)
            h = head.block(h, ctx.rope, cache, route.cache_slot, ctx.plan, ctx.mask, ops=ops)
        if head is not None and head.mlp is not None:
            h = h + head.mlp(head.mlp_norm(h), ops=ops)
        if route.norm == "own":
            assert head is not None
            h = head.norm(h)
        elif route.norm == "final":
            h = self.norm(h)
        if route.output == "own":
            assert head is not None
            return h, head.proj.weight
        if route.output == "tied_embedding":
            return h, self.tied_embedding()
        return h, self.output_embedding()

    def write_kv(
        self, h: torch.Tensor, layer: int, positions: torch.Tensor, cache: KVCache,
        rows: torch.Tensor, ops: Products | None = None,
    ) -> None:
        """Write the keys/values that 0-based ``layer`` computes from its input hidden
        states ``h`` ``(n, T, D)`` at ``positions`` ``(n, T)`` of cache rows ``rows``
        ``(n,)``: the key/value half of the layer only (CALM-style state propagation,
        EE-LLM Sec. 4). ``cache.fill`` is left to the caller."""
        rope = self.context(positions).rope
        k, v = self.layers[layer].kv(h, rope, ops)
        cache.put(layer, rows, positions, k, v)

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
        h0 = self.embed(tokens, positions)
        exits: dict[int, torch.Tensor] = {}
        for layer, h in self.walk(h0, 0, self.num_layers, want, cache=cache, ctx=ctx):
            if layer < self.num_layers:
                exits[layer] = self.exit_logits(h, layer, cache=cache, ctx=ctx)
        return ModelOutput(self.final_logits(h), exits)

    def num_parameters(self, *, exits_only: bool = False) -> int:
        """Number of distinct parameters (tied tensors counted once)."""
        mods = self.exits.parameters() if exits_only else self.parameters()
        return sum(p.numel() for p in mods)


def default_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Positions ``0..T-1`` for every row of ``tokens`` ``(B, T)``."""
    b, t = tokens.shape[:2]
    return torch.arange(t, device=tokens.device).expand(b, t)
