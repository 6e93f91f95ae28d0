"""Tiny models, tokenizers and GGUF files for the checkpoint I/O tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from exitlm.config import ExitConfig, ModelConfig
from exitlm.io.gguf_tokenizer import build_bpe_tokenizer
from exitlm.io.hf_map import exitlm_to_hf
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

VOCAB = 64
MERGES = [("h", "e"), ("l", "l"), ("he", "ll")]


def tiny_config(kind: str = "llama", exits: ExitConfig | None = None, **kw: object) -> ModelConfig:
    """A 3-layer, dim-32 model of the Llama family (``llama``, ``qwen2``) or GPT-2."""
    exits = exits if exits is not None else ExitConfig(layers=(1, 2))
    if kind == "gpt2":
        base = dict(vocab_size=VOCAB, dim=32, num_layers=3, num_heads=4, hidden_dim=64,
                    max_seq_len=64, norm="layernorm", pos="learned", mlp="gelu",
                    activation="gelu_tanh", qkv_bias=True, out_bias=True, mlp_bias=True)
    else:
        base = dict(vocab_size=VOCAB, dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    hidden_dim=48, max_seq_len=64, rope_theta=10000.0,
                    qkv_bias=kind == "qwen2", tie_embeddings=kind != "llama")
    base.update(kw)
    return ModelConfig(exits=exits, name=f"tiny-{kind}", **base)  # type: ignore[arg-type]


def tiny_model(cfg: ModelConfig) -> EarlyExitLM:
    """A model with every parameter random (norms too, so a lost norm weight shows)."""
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def all_logits(model: EarlyExitLM, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Final logits (key L) and every configured exit's logits."""
    with torch.no_grad():
        out = model(tokens)
    return {model.num_layers: out.logits, **out.exit_logits}


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE over a tiny vocabulary, with two special tokens."""
    from exitlm.io.gguf_tokenizer import byte_alphabet

    table = byte_alphabet()
    chars = [table[b] for b in b" \nabcdefghijklmnopqrstuvwxyz0123456789'<>|_.,!"]
    tokens = ["<|endoftext|>", "<|im_end|>", *chars]
    merges = [f"{a} {b}" for a, b in MERGES]
    tokens += [a + b for a, b in MERGES]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    types = [3, 3] + [1] * (len(tokens) - 2)
    tk = build_bpe_tokenizer(tokens, merges, types, "smollm")
    return Tokenizer(tk, bos_token_id=0, eos_token_ids=(1,), pad_token_id=0,
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


def permute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of what the loader undoes)."""
    half = w.shape[0] // n_heads // 2
    x = w.reshape(n_heads, 2, half, *w.shape[1:])
    return np.ascontiguousarray(x.swapaxes(1, 2)).reshape(w.shape)


def write_tiny_gguf(path: Path, model: EarlyExitLM, tokenizer_tokens: list[str] | None = None,
                    arch: str = "llama", kv_heads: int | None = None) -> None:
    """Write ``model``'s backbone as an F32 llama GGUF, q/k rows permuted like llama.cpp
    (``kv_heads``: the key/value head count the metadata claims, default the model's)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.n_kv_heads if kv_heads is None else kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    tok = tiny_tokenizer()
    vocab = tok.tk.get_vocab()
    tokens = tokenizer_tokens or [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages[0]['content'] }}")
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    for hf, t in exitlm_to_hf(model.state_dict().items(), cfg):
        arr = t.detach().float().numpy().copy()
        if hf in names:
            name = names[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            name = f"blk.{i}.{layer[rest]}"
            if name.endswith("attn_q.weight"):
                arr = permute_rotary_rows(arr, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                arr = permute_rotary_rows(arr, cfg.n_kv_heads)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
