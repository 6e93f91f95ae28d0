"""Tiny models for generation tests (imported by the tests of this folder): random
transformers models converted to exitlm, and a byte-level tokenizer for text-level tests."""

from __future__ import annotations

import pytest
import torch

from exitlm.config import ModelConfig
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.io.hf_map import config_from_hf, hf_to_exitlm
from exitlm.io.materialize import model_from_tensors
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

VOCAB = 97


def tiny_hf(kind: str, vocab: int = VOCAB) -> torch.nn.Module:
    """A random tiny transformers model with well-separated logits (greedy ties are rare)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
            bos_token_id=1, eos_token_id=None, pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
            bos_token_id=1, eos_token_id=None, pad_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    return model.eval()


def convert(hf_model: torch.nn.Module) -> EarlyExitLM:
    """The exitlm twin of a transformers model (same weights)."""
    d = hf_model.config.to_dict()
    cfg = config_from_hf(d)
    sd = hf_model.state_dict()
    if cfg.tie_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    model = model_from_tensors(cfg, hf_to_exitlm(sd.items(), cfg), source="test")
    return model


def byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0..255) plus ``<eos>`` = 256."""
    tok = byte_level_tokenizer()
    tok.tk.add_special_tokens(["<eos>"])
    tok.eos_token_ids = (256,)
    return tok


def tiny_text_model(seed: int = 0, eos: tuple[int, ...] = (256,)) -> EarlyExitLM:
    """A random Llama-style model over the byte tokenizer's 257 ids."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=257, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=64,
        max_seq_len=256, eos_token_ids=eos, name="tiny-text",
    )
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():  # larger weights: sharper, more varied next-token distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model
