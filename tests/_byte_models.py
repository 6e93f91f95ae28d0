"""A random byte-level LayerSkip-style model (every layer exits through the final norm +
head) with large weights, for tests that need text prompts without a tokenizer file: its
distributions are sharp, so greedy ties are rare and confidence exits happen."""

from __future__ import annotations

import torch

from exitlm.config import ExitConfig, ModelConfig
from exitlm.model.transformer import EarlyExitLM


def sharp_byte_model(num_layers: int, max_seq_len: int, *, every_layer: bool = True
                     ) -> EarlyExitLM:
    """Seeded (0): the same weights on every call and in every process."""
    return sharp_model(ModelConfig(vocab_size=256, dim=32, num_layers=num_layers, num_heads=4,
                                   num_kv_heads=2, hidden_dim=64, max_seq_len=max_seq_len,
                                   exits=ExitConfig(every_layer=every_layer, norm="final")))


def sharp_model(cfg: ModelConfig, seed: int = 0) -> EarlyExitLM:
    """A model of ``cfg`` whose matrices are drawn with std 0.4 (seeded): sharp
    next-token distributions, so greedy near-ties are rare."""
    torch.manual_seed(seed)
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
    return model
