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
from exitlm.io.gguf_scan import scan_gguf_header
from exitlm.io.gguf_tokenizer import GGUFTokenizerError, build_bpe_tokenizer
from exitlm.io.hf_map import CheckpointError
from exitlm.kernels.quant import QuantizedWeight
from exitlm.tokenizer import Tokenizer

_ARCHS = ("llama", "qwen2")
# GGUFValueType codes.
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_FLOAT_TYPES = (6, 12)
_BOOL = 7
_STRING = 8
_ROPE_SCALING = ("none", "linear")  # what exitlm implements of llama.cpp's rope scaling types
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

    def _kind(self, key: str) -> str:
        """What the field ``key`` holds, in words (for error messages)."""
        from gguf import GGUFValueType

        types = self.reader.fields[key].types
        names = []
        for t in types:
            try:
                names.append(GGUFValueType(int(t)).name.lower())
            except ValueError:
                names.append(f"type {int(t)}")
        if types and types[0] == GGUFValueType.ARRAY:
            return f"an array of {names[-1]}" if len(names) > 1 else "an array"
        return f"a {names[0]}" if names else "an empty field"

    def _typed(self, key: str, allowed: tuple[int, ...], expected: str, array: bool) -> Any:
        from gguf import GGUFValueType

        types = self.reader.fields[key].types
        if array:
            ok = len(types) == 2 and types[0] == GGUFValueType.ARRAY and types[1] in allowed
        else:
            ok = len(types) == 1 and types[0] in allowed
        if not ok:
            raise CheckpointError(
                f"{self.path}: GGUF metadata {key!r} must be {expected}, got {self._kind(key)}")
        return self.get(key)

    def get_int(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """An integer metadata value (any GGUF integer type, not bool, float or string)."""
        if key not in self.reader.fields:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return int(self._typed(key, _INT_TYPES, "an integer", False))

    def get_float(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """A number (GGUF float or integer type) as a Python float."""
        if key not in self.reader.fields:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return float(self._typed(key, (*_INT_TYPES, *_FLOAT_TYPES), "a number", False))

    def get_str(self, key: str, default: Any = None) -> Any:
        if key not in self.reader.fields:
            return default
        return str(self._typed(key, (_STRING,), "a string", False))

    def get_bool(self, key: str, default: Any = None) -> Any:
        if key not in self.reader.fields:
            return default
        return bool(self._typed(key, (_BOOL,), "a bool", False))

    def get_array(self, key: str, kind: str, *, required: bool = False) -> Any:
        """An array of strings (``kind="str"``) or integers (``kind="int"``)."""
        plural = "strings" if kind == "str" else "integers"
        if key not in self.reader.fields:
            if required:
                raise CheckpointError(
                    f"{self.path}: GGUF metadata lacks {key!r} (an array of {plural})")
            return None
        if kind == "str":
            return self._typed(key, (_STRING,), "an array of strings", True)
        return self._typed(key, _INT_TYPES, "an array of integers", True)

    @property
    def arch(self) -> str:
        return str(self.get_str("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped), turning failures into
    :class:`CheckpointError`."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: no such GGUF file")
    scan_gguf_header(p)  # bounded: GGUFReader loops per item an array header claims
    try:
        reader = GGUFReader(str(p))
    except Exception as err:
        raise CheckpointError(f"{p}: not a readable GGUF file ({err})") from err
    g = GGUFFile(p, reader)
    _check_tensor_layout(g)
    if g.arch not in _ARCHS:
        raise CheckpointError(
            f"{p}: unsupported GGUF architecture {g.arch!r}; exitlm reads {list(_ARCHS)}"
        )
    return g


def _check_tensor_layout(g: GGUFFile) -> None:
    """Every tensor's data starts at a multiple of ``general.alignment`` and overlaps no
    other tensor's data."""
    align = int(g.reader.alignment)
    spans = []
    for t in g.reader.tensors:
        rel = int(t.data_offset) - int(g.reader.data_offset)
        if rel % align:
            raise CheckpointError(
                f"{g.path}: GGUF tensor {t.name!r}: data offset {rel:,} is not a multiple of "
                f"general.alignment ({align})")
        spans.append((rel, rel + int(t.n_bytes), t.name))
    spans.sort()
    end, prev = 0, ""
    for start, stop, name in spans:
        if start < end:
            raise CheckpointError(
                f"{g.path}: GGUF tensor {name!r}: data at offset {start:,} overlaps tensor "
                f"{prev!r} (which ends at {end:,}); expected each tensor's data to be separate")
        if stop > end:
            end, prev = stop, name


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

    def need(key: str) -> int:
        return g.get_int(f"{a}.{key}", required=True)

    names = set(g.tensor_names())
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{g.path}: tensor 'rope_freqs.weight' (llama3-style rope scaling stored as "
            "frequency factors) is not supported; convert the original HF checkpoint instead"
        )
    scaling = None
    kind_key = f"{a}.rope.scaling.type"
    kind = g.get_str(kind_key)
    if kind is not None and kind not in _ROPE_SCALING:
        raise CheckpointError(
            f"{g.path}: GGUF metadata {kind_key!r} is {kind!r}; exitlm implements "
            f"{list(_ROPE_SCALING)} (convert the original HF checkpoint instead)")
    if kind == "linear":
        factor_key = f"{a}.rope.scaling.factor"
        factor = g.get_float(factor_key, 1.0)
        if not factor > 0 or factor == float("inf"):
            raise CheckpointError(
                f"{g.path}: GGUF metadata {factor_key!r} must be a finite number > 0, "
                f"got {factor}")
        scaling = RopeScaling(kind="linear", factor=factor)
    dim = need("embedding_length")
    heads = need("attention.head_count")
    head_dim = g.get_int(f"{a}.attention.key_length")
    rope_key = f"{a}.rope.dimension_count"
    rope_dims = g.get_int(rope_key)
    if rope_dims is not None and heads > 0:
        hdim = head_dim if head_dim is not None else dim // heads
        if rope_dims != hdim:
            raise CheckpointError(
                f"{g.path}: GGUF metadata {rope_key!r} is {rope_dims} but the head dimension is "
                f"{hdim}; exitlm rotates whole heads (partial rotary embeddings are not "
                "supported)")
    vocab_key = f"{a}.vocab_size"
    vocab = g.get_int(vocab_key)
    if not vocab:
        tokens = g.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise CheckpointError(f"{g.path}: GGUF metadata gives no vocabulary size")
    bos, eos, pad = _special_ids(g, vocab)
    default_name = str(g.get_str("general.basename") or g.path.stem)
    size_label = g.get_str("general.size_label")
    if size_label:
        default_name += f"-{size_label}".lower()
    return ModelConfig(
        vocab_size=vocab, dim=dim, num_layers=need("block_count"), num_heads=heads,
        num_kv_heads=g.get_int(f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        hidden_dim=need("feed_forward_length"),
        max_seq_len=g.get_int(f"{a}.context_length", 2048),
        norm="rmsnorm",
        norm_eps=_f32(g.get_float(f"{a}.attention.layer_norm_rms_epsilon", required=True)),
        pos="rope",
        rope_theta=_f32(g.get_float(f"{a}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        mlp="swiglu", activation="silu", qkv_bias=a == "qwen2",
        tie_embeddings="output.weight" not in names,
        bos_token_id=bos,
        eos_token_ids=() if eos is None else (eos,),
        pad_token_id=pad,
        name=name or default_name,
    )


def _special_ids(g: GGUFFile, vocab: int) -> tuple[int | None, int | None, int | None]:
    """``tokenizer.ggml.{bos,eos,padding}_token_id``: integers in ``[0, vocab)``."""
    out: list[int | None] = []
    for what in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{what}_token_id"
        value = g.get_int(key)
        if value is not None and not 0 <= value < vocab:
            raise CheckpointError(
                f"{g.path}: GGUF metadata {key!r} is {value}; expected a token id in "
                f"[0, {vocab}) (the vocabulary size)")
        out.append(value)
    return out[0], out[1], out[2]


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection ``(heads*d, in)``.

    llama.cpp stores, per head, rows ``(d/2, 2)``-interleaved; exitlm wants ``(2, d/2)``
    (first all "real" halves, then all "imaginary" halves). Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    x = w.reshape(n_heads, half, 2, *w.shape[1:])  # (H, d/2, 2, ...)
    return np.ascontiguousarray(x.swapaxes(1, 2)).reshape(w.shape)  # (H, 2, d/2, ...)


def gguf_name(hf: str) -> str:
    """The GGUF name of the tensor that :func:`gguf_hf_tensors` yields as ``hf`` (for
    messages; a name of no GGUF tensor is returned as it is)."""
    for ours, theirs in _GLOBAL_NAMES.items():
        if theirs == hf:
            return ours
    head, _, rest = hf.removeprefix("model.layers.").partition(".")
    ours = next((k for k, v in _LAYER_NAMES.items() if v == rest), None)
    return f"blk.{head}.{ours}" if hf.startswith("model.layers.") and ours else hf


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
            if not (parts[1].isascii() and parts[1].isdigit()):
                raise CheckpointError(
                    f"{g.path}: GGUF tensor {name!r}: expected 'blk.N.<name>' with a layer "
                    f"number N, got {parts[1]!r}")
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
    kind = g.get_str("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise CheckpointError(
            f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (exitlm rebuilds "
            "byte-level BPE 'gpt2' tokenizers from GGUF); convert the HF checkpoint instead"
        )
    tokens = g.get_array("tokenizer.ggml.tokens", "str", required=True)
    merges = g.get_array("tokenizer.ggml.merges", "str") or []
    types = g.get_array("tokenizer.ggml.token_type", "int")
    pre = g.get_str("tokenizer.ggml.pre")
    try:
        tk = build_bpe_tokenizer(tokens, merges, types, pre)
    except GGUFTokenizerError as err:
        raise CheckpointError(f"{g.path}: {err}") from err
    bos, eos, pad = _special_ids(g, len(tokens))
    return Tokenizer(
        tk, bos_token_id=bos,
        eos_token_ids=() if eos is None else (eos,),
        pad_token_id=pad,
        add_bos=bool(g.get_bool("tokenizer.ggml.add_bos_token", False)),
        chat_template=g.get_str("tokenizer.chat_template"),
    )
