"""Logit parity with ``transformers`` for tiny random Llama / Qwen2 / GPT-2 models."""

from __future__ import annotations

import pytest
import torch

from exitlm.io.hf_map import config_from_hf, hf_to_exitlm
from exitlm.io.materialize import model_from_tensors

transformers = pytest.importorskip("transformers")


def _tiny_hf(kind: str) -> torch.nn.Module:
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=10000.0, tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    if kind == "llama3-scaled":
        cfg = transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            rope_theta=500000.0,
        )
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=True,
        )
        return transformers.Qwen2ForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _convert(hf_model: torch.nn.Module):
    cfg = config_from_hf(hf_model.config.to_dict())
    sd = hf_model.state_dict()
    if cfg.tie_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    return model_from_tensors(cfg, hf_to_exitlm(sd.items(), cfg), source="test")


KINDS = ["llama", "llama3-scaled", "qwen2", "gpt2"]


@pytest.mark.parametrize("kind", KINDS)
def test_full_forward_logits_match(kind: str) -> None:
    hf = _tiny_hf(kind).eval()
    ours = _convert(hf)
    tokens = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_matches_full_forward(kind: str) -> None:
    hf = _tiny_hf(kind).eval()
    ours = _convert(hf)
    tokens = torch.randint(0, 97, (1, 24))
    cache = ours.new_cache(1, 64)
    with torch.no_grad():
        ref = hf(tokens).logits
        pieces = [ours(tokens[:, :10], cache=cache).logits]
        for p in range(10, 24):
            pieces.append(ours(tokens[:, p : p + 1], torch.tensor([[p]]), cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_ragged_batch_matches_single_sequences(kind: str) -> None:
    """Right-padded prompts of different lengths, then per-sequence decode positions."""
    hf = _tiny_hf(kind).eval()
    ours = _convert(hf)
    lens = [7, 12, 3]
    seqs = [torch.randint(0, 97, (n + 5,)) for n in lens]
    batch = torch.zeros(3, max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        batch[i, :n] = seqs[i][:n]
    cache = ours.new_cache(3, 64)
    with torch.no_grad():
        out = ours(batch, cache=cache).logits
        for i, n in enumerate(lens):
            ref = hf(seqs[i][None]).logits[0]
            torch.testing.assert_close(out[i, :n], ref[:n], atol=1e-5, rtol=1e-4)
        for step in range(5):
            pos = torch.tensor([[n + step] for n in lens])
            tok = torch.stack([seqs[i][n + step] for i, n in enumerate(lens)])[:, None]
            logits = ours(tok, pos, cache=cache).logits
            for i, n in enumerate(lens):
                ref = hf(seqs[i][None, : n + step + 1]).logits[0, -1]
                torch.testing.assert_close(logits[i, 0], ref, atol=1e-5, rtol=1e-4)
