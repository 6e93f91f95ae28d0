"""Early-exit heads (EE-LLM Sec. 2 and App. D.1; LayerSkip Sec. 4.2).

An exit head turns the hidden state after layer ``l`` into next-token logits:

    h_l  ->  [block | residual MLP]  ->  [norm]  ->  output embedding  ->  logits

Which parts exist, and whether the norm / output embedding are the exit's own parameters or
shared with the backbone, is :class:`exitlm.config.ExitConfig`. Shared parts are *not* stored
here: :meth:`exitlm.model.transformer.EarlyExitLM.exit_logits` resolves them, so a state dict
holds each tensor once.
"""

from __future__ import annotations

from torch import nn

from exitlm.config import ModelConfig
from exitlm.model.layers import MLP, Block, Linear, Norm


class ExitHead(nn.Module):
    """The parameters an exit owns (possibly none, e.g. LayerSkip-style shared exits)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        ex = cfg.exits
        self.layer = layer
        self.block = Block(cfg) if ex.head == "block" else None
        self.mlp_norm = Norm(cfg.dim, cfg.norm, cfg.norm_eps) if ex.head == "mlp" else None
        self.mlp = MLP(cfg) if ex.head == "mlp" else None
        self.norm = Norm(cfg.dim, cfg.norm, cfg.norm_eps) if ex.norm == "own" else None
        self.proj = Linear(cfg.dim, cfg.vocab_size, bias=False) if ex.output == "own" else None
