"""Building blocks of the transformer: norms, rotary embedding, attention, MLP, block.

Plain arithmetic. Which kernel multiplies a linear layer's weight is the caller's to choose:
every product of a block goes through :func:`product`, which calls the layer itself unless the
forward was given ``ops`` (a :data:`Products` callable, e.g. a runtime runner's CPU kernels,
:mod:`exitlm.runtime`) - the model never knows which backend runs it, and nothing is swapped
into it. Weights follow ``nn.Linear``'s ``(out_features, in_features)`` convention so
checkpoints map one-to-one; a runner may re-stride them without changing their values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from exitlm.config import ModelConfig, RopeScaling
from exitlm.model.kv_cache import KVCache, WritePlan


class Linear(nn.Linear):
    """``nn.Linear``; its own class so that a runner can tell the model's layers apart from
    a parallel layout's (which communicate inside their forward) and give them its kernels.
    A float16 weight in a float32 model (a quantized draft copy keeps the layers it cannot
    quantize that way, :mod:`exitlm.runtime.draft_copy`) multiplies float32 activations as
    float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype is torch.float16 and x.dtype is torch.float32:
            return F.linear(x, w.float(), self.bias)
        return F.linear(x, w, self.bias)


Products = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``ops(layer, x)``: the product of linear layer ``layer`` with ``x``, computed by whatever
kernel the caller chose (same values as ``layer(x)`` up to rounding)."""


def product(layer: nn.Module, x: torch.Tensor, ops: Products | None) -> torch.Tensor:
    """``layer(x)``, or ``ops(layer, x)`` when the forward was given kernels to use."""
    return layer(x) if ops is None else ops(layer, x)


class Norm(nn.Module):
    """RMSNorm (Llama family) or LayerNorm (GPT-2), chosen by ``ModelConfig.norm``."""

    def __init__(self, dim: int, kind: str, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        if x.dtype in (torch.float16, torch.bfloat16):
            # Normalise in fp32 like the reference Llama implementation, then scale.
            y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
            return y * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotary inverse frequencies ``theta^(-2i/d)``, with optional Llama-3 / linear scaling."""
    # float32 arithmetic, as the reference implementations do, so angles match bit-for-bit.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return torch.where(mid, blended, scaled)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention (and the KV cache) computes in for weights of ``dtype``.

    CPU kernels for fp16/bf16 attention are several times slower than fp32 ones, and the
    q/k/v rows of one token are tiny, so on CPU attention runs in fp32 (more accurate too).
    """
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def rope_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)`` for angles ``(B, T, D/2)``, shaped ``(B, T, 1, D)``.

    ``signed_sin = [-sin, sin]`` folds rotate-half's sign into the table, so applying the
    rotation costs one concatenation and two multiply-adds (:func:`apply_rope`).
    """
    cos, sin = angles.cos(), angles.sin()
    cos_t = torch.cat((cos, cos), dim=-1)[:, :, None]
    sin_t = torch.cat((-sin, sin), dim=-1)[:, :, None]
    return cos_t.to(dtype), sin_t.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by its positions' angles (half-split convention).

    Equals ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Attention(nn.Module):
    """Multi-head / grouped-query causal self-attention with a fused q,k,v projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.hdim
        self.use_rope = cfg.pos == "rope"
        qkv_out = (cfg.num_heads + 2 * cfg.n_kv_heads) * cfg.hdim
        self.wqkv = Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.num_heads * cfg.hdim, cfg.dim, bias=cfg.out_bias)

    def kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        ops: Products | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, Hkv, T, D)`` of the (normed) input ``x`` ``(B, T, D)``."""
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = product(self.wqkv, x, ops)
        qkv = qkv.to(attention_dtype(qkv.dtype, qkv.device)).view(b, t, h + 2 * hkv, d)
        k, v = qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
        if rope is not None:
            k = apply_rope(k, *rope)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        slot: int,
        plan: WritePlan | None,
        mask: torch.Tensor | None,
        ops: Products | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = product(self.wqkv, x, ops)
        adt = attention_dtype(qkv.dtype, qkv.device)
        if qkv.dtype != adt:
            qkv = qkv.to(adt)
        qkv = qkv.view(b, t, h + 2 * hkv, d)  # (B, T, heads, D)
        if rope is not None:
            qk = apply_rope(qkv[:, :, : h + hkv], *rope)  # q and k rotated together
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q, k = qkv[:, :, :h], qkv[:, :, h : h + hkv]
        v = qkv[:, :, h + hkv :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if cache is not None and plan is not None:
            k, v = cache.write(slot, k, v, plan)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=hkv != h
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=hkv != h
            )
        out = out.transpose(1, 2).reshape(b, t, h * d).to(x.dtype)  # (B, T, H*D)
        return product(self.wo, out, ops)


_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """SwiGLU (fused gate+up projection) or a plain two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.hidden = cfg.hidden_dim
        width = 2 * cfg.hidden_dim if self.gated else cfg.hidden_dim
        self.w_in = Linear(cfg.dim, width, bias=cfg.mlp_bias)
        self.w_out = Linear(cfg.hidden_dim, cfg.dim, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor, ops: Products | None = None) -> torch.Tensor:
        y = product(self.w_in, x, ops)
        if self.gated:
            gate, up = y.split(self.hidden, dim=-1)
            return product(self.w_out, self.act(gate) * up, ops)
        return product(self.w_out, self.act(y), ops)


class Block(nn.Module):
    """Pre-norm transformer layer: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = Norm(cfg.dim, cfg.norm, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm_mlp = Norm(cfg.dim, cfg.norm, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        slot: int,
        plan: WritePlan | None,
        mask: torch.Tensor | None,
        ops: Products | None = None,
    ) -> torch.Tensor:
        h = h + self.attn(self.norm_attn(h), rope, cache, slot, plan, mask, ops=ops)
        return h + self.mlp(self.norm_mlp(h), ops=ops)

    def kv(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        ops: Products | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer's attention computes from its input ``h``."""
        return self.attn.kv(self.norm_attn(h), rope, ops)
