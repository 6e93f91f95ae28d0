"""Read a GGUF file (llama.cpp's format): configuration, dequantized tensors and tokenizer.

Tensors are dequantized one at a time with ``gguf.quants.dequantize`` and translated to
Hugging Face names, then to exitlm's through :func:`exitlm.io.hf_map.hf_to_exitlm`, so the
peak memory is one fp32 copy of the weights plus one tensor.

**Rotary row order.** llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of
Llama-architecture models so that the two halves of each head's rotary pairs are interleaved
(``(heads, 2, d/2, in) -> (heads, d/2, 2, in)``); exitlm (like ``transformers``) rotates
halves, so :func:`unpermute_rotary_rows` undoes it. Qwen2 files are not permuted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exitlm.config import ConfigError, ModelConfig, RopeScaling
from exitlm.io.gguf_quant import block_kind, blocks_to_weight
from exitlm.io.gguf_tokenizer import GGUFTokenizerError, build_bpe_tokenizer
from exitlm.io.hf_map import CheckpointError
from exitlm.kernels.quant import QuantizedWeight
from exitlm.tokenizer import Tokenizer

_ARCHS = ("llama", "qwen2")
_PERMUTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass
class GGUFFile:
    """An opened GGUF file: its reader, metadata accessor and derived configuration."""

    path: Path
    reader: Any  # gguf.GGUFReader

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as err:
            raise CheckpointError(f"{self.path}: cannot read GGUF metadata {key!r}: {err}") from err

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped), turning failures into
    :class:`CheckpointError`."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file")
    try:
        reader = GGUFReader(str(p))
    except Exception as err:
        raise CheckpointError(f"{p}: not a readable GGUF file ({err})") from err
    g = GGUFFile(p, reader)
    if g.arch not in _ARCHS:
        raise CheckpointError(
            f"{p}: unsupported GGUF architecture {g.arch!r}; exitlm reads {list(_ARCHS)}"
        )
    return g


def _f32(value: float) -> float:
    """A float32 metadata value, rounded to the decimal it was written from (1e-5, not
    9.99999974e-06)."""
    return float(f"{float(value):.7g}")


def gguf_config(g: GGUFFile, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file's ``{arch}.*`` metadata describes; metadata of
    the wrong type or range is a :class:`CheckpointError` naming the file."""
    try:
        return _gguf_config(g, name)
    except CheckpointError:
        raise
    except (ConfigError, TypeError, ValueError, OverflowError) as err:
        raise CheckpointError(f"{g.path}: invalid GGUF metadata: {err}") from None


def _gguf_config(g: GGUFFile, name: str | None) -> ModelConfig:
    a = g.arch

    def need(key: str) -> Any:
        value = g.get(f"{a}.{key}")
        if value is None:
            raise CheckpointError(f"{g.path}: GGUF metadata lacks {a}.{key}")
        return value

    names = set(g.tensor_names())
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{g.path}: tensor 'rope_freqs.weight' (llama3-style rope scaling stored as "
            "frequency factors) is not supported; convert the original HF checkpoint instead"
        )
    scaling = None
    if g.get(f"{a}.rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(g.get(f"{a}.rope.scaling.factor", 1.0)))
    dim = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    vocab = g.get(f"{a}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{g.path}: GGUF metadata gives no vocabulary size")
    eos = g.get("tokenizer.ggml.eos_token_id")
    default_name = str(g.get("general.basename") or g.path.stem)
    if g.get("general.size_label"):
        default_name += f"-{g.get('general.size_label')}".lower()
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=int(g.get(f"{a}.attention.head_count_kv", heads)),
        head_dim=g.get(f"{a}.attention.key_length"),
        hidden_dim=int(need("feed_forward_length")),
        max_seq_len=int(g.get(f"{a}.context_length", 2048)),
        norm="rmsnorm", norm_eps=_f32(need("attention.layer_norm_rms_epsilon")), pos="rope",
        rope_theta=_f32(g.get(f"{a}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        mlp="swiglu", activation="silu", qkv_bias=a == "qwen2",
        tie_embeddings="output.weight" not in names,
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"),
        name=name or default_name,
    )


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection ``(heads*d, in)``.

    llama.cpp stores, per head, rows ``(d/2, 2)``-interleaved; exitlm wants ``(2, d/2)``
    (first all "real" halves, then all "imaginary" halves). Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    x = w.reshape(n_heads, half, 2, *w.shape[1:])  # (H, d/2, 2, ...)
    return np.ascontiguousarray(x.swapaxes(1, 2)).reshape(w.shape)  # (H, 2, d/2, ...)


def gguf_hf_tensors(
    g: GGUFFile, cfg: ModelConfig, *, keep_quantized: str | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield ``(hf_name, fp32 tensor)`` for every tensor of the file, dequantized lazily.

    With ``keep_quantized="int8"``, 2-D Q8_0 tensors are yielded as
    :class:`~exitlm.kernels.quant.QuantizedWeight` made from their blocks instead
    (:mod:`exitlm.io.gguf_quant`); with ``"int4"``, Q4_0/Q4_1 and Q8_0 tensors (a finer
    format is never made coarser: llama.cpp's own Q4 files keep the embedding in Q8_0)."""
    from gguf import quants

    permute = g.arch in _PERMUTED_ARCHS
    for t in g.reader.tensors:
        name = t.name
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise CheckpointError(f"{g.path}: unexpected GGUF tensor {name!r} for {g.arch}")
            hf = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
        expect = tuple(int(x) for x in reversed(t.shape))  # ggml lists dims innermost first
        kind = block_kind(t.tensor_type.name)
        if keep_quantized and len(expect) == 2 and kind in (keep_quantized, "int8"):
            raw = np.asarray(t.data).reshape(expect[0], -1)
            if permute and ".attn_q." in name:
                raw = unpermute_rotary_rows(raw, cfg.num_heads)
            elif permute and ".attn_k." in name:
                raw = unpermute_rotary_rows(raw, cfg.n_kv_heads)
            yield hf, blocks_to_weight(raw, t.tensor_type.name, (expect[0], expect[1]))
            continue
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except Exception as err:
            raise CheckpointError(
                f"{g.path}: cannot dequantize tensor {name!r} ({t.tensor_type.name}): {err}"
            ) from err
        if tuple(arr.shape) != expect:
            arr = arr.reshape(expect)
        if permute and ".attn_q." in name:
            arr = unpermute_rotary_rows(arr, cfg.num_heads)
        elif permute and ".attn_k." in name:
            arr = unpermute_rotary_rows(arr, cfg.n_kv_heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors are views of the read-only file mapping
            arr = arr.copy()
        yield hf, torch.from_numpy(arr)


def gguf_tokenizer(g: GGUFFile) -> Tokenizer | None:
    """The tokenizer stored in the file's metadata (``None`` when it carries none)."""
    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise CheckpointError(
            f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (exitlm rebuilds "
            "byte-level BPE 'gpt2' tokenizers from GGUF); convert the HF checkpoint instead"
        )
    try:
        tk = build_bpe_tokenizer(
            g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.merges") or [],
            g.get("tokenizer.ggml.token_type"), g.get("tokenizer.ggml.pre"),
        )
    except GGUFTokenizerError as err:
        raise CheckpointError(f"{g.path}: {err}") from err
    eos = g.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        tk, bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(g.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=g.get("tokenizer.chat_template"),
    )
