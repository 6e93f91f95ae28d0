"""Mapping between Hugging Face ``transformers`` checkpoints and exitlm's parameters.

Covers the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``;
SmolLM checkpoints are Llama) and ``GPT2LMHeadModel``. Tensors are converted one at a time
(a layer's q/k/v or gate/up are buffered only until the layer's set is complete), so loading
never holds more than one copy of the weights plus one layer.

exitlm fuses q/k/v into ``attn.wqkv`` and SwiGLU's gate/up into ``mlp.w_in``; GPT-2's
``Conv1D`` weights are stored ``(in, out)`` and are transposed to ``nn.Linear``'s ``(out, in)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from exitlm.config import ModelConfig, RopeScaling
from exitlm.errors import ExitlmError
from exitlm.kernels.quantized import cat_rows
from exitlm.schema import build, convert, field_hints

LLAMA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GPT2_ARCHS = ("GPT2LMHeadModel",)
SUPPORTED_ARCHS = LLAMA_ARCHS + GPT2_ARCHS


class CheckpointError(ExitlmError, ValueError):
    """A checkpoint is corrupt, incomplete or does not match its configuration."""


def architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in SUPPORTED_ARCHS:
            return arch
    by_type = {"llama": LLAMA_ARCHS[0], "mistral": LLAMA_ARCHS[1], "qwen2": LLAMA_ARCHS[2],
               "gpt2": GPT2_ARCHS[0]}
    if isinstance(model_type, str) and model_type in by_type:
        return by_type[model_type]
    raise CheckpointError(
        f"unknown architecture {archs or model_type!r}; exitlm loads {list(SUPPORTED_ARCHS)}"
    )


_REQUIRED = object()


def _get(hf: dict[str, Any], key: str, field: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` checked against the type and range of ``ModelConfig.<field>``; errors name
    the ``config.json`` key."""
    if key not in hf or (hf[key] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    return convert(hf[key], field_hints(ModelConfig)[field], key)


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Translate a ``config.json`` dictionary into a :class:`ModelConfig`; every value is
    checked by type and range (errors name the ``config.json`` key)."""
    arch = architecture_of(hf)
    try:
        common = {
            "bos_token_id": _get(hf, "bos_token_id", "bos_token_id", None),
            "eos_token_ids": _get(hf, "eos_token_id", "eos_token_ids", ()),
            "pad_token_id": _get(hf, "pad_token_id", "pad_token_id", None), "name": name,
        }
        if arch in GPT2_ARCHS:
            act = hf.get("activation_function", "gelu_new")
            act_map = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu": "gelu", "relu": "relu"}
            if not isinstance(act, str) or act not in act_map:
                raise CheckpointError(f"unsupported GPT-2 activation_function {act!r}")
            _gpt2_attention_exact(hf)
            dim = _get(hf, "n_embd", "dim")
            return ModelConfig(
                vocab_size=_get(hf, "vocab_size", "vocab_size"), dim=dim,
                num_layers=_get(hf, "n_layer", "num_layers"),
                num_heads=_get(hf, "n_head", "num_heads"),
                hidden_dim=_get(hf, "n_inner", "hidden_dim", 4 * dim),
                max_seq_len=_get(hf, "n_positions", "max_seq_len"), norm="layernorm",
                norm_eps=_get(hf, "layer_norm_epsilon", "norm_eps", 1e-5), pos="learned",
                mlp="gelu", activation=act_map[act], qkv_bias=True, out_bias=True,
                mlp_bias=True, tie_embeddings=_get(hf, "tie_word_embeddings", "tie_embeddings",
                                                   True),
                **common,
            )
        scaling = None
        rs = hf.get("rope_scaling") or hf.get("rope_parameters")
        theta = _get(hf, "rope_theta", "rope_theta", None)
        if isinstance(rs, dict):
            kind = rs.get("rope_type", rs.get("type", "default"))
            theta = _get(rs, "rope_theta", "rope_theta", theta)
            if kind == "llama3":
                keys = ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")
                scaling = build(RopeScaling, {"kind": "llama3", **{k: _number(rs, k)
                                                                   for k in keys}},
                                "rope_scaling")
            elif kind == "linear":
                scaling = build(RopeScaling, {"kind": "linear", "factor": _number(rs, "factor")},
                                "rope_scaling")
            elif kind != "default":
                raise CheckpointError(
                    f"unsupported rope scaling {kind!r}; exitlm supports default, linear, llama3"
                )
        elif rs is not None:
            raise CheckpointError(f"rope_scaling: expected a mapping or null, got {rs!r}")
        act = hf.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in ("silu", "gelu", "relu", "gelu_pytorch_tanh"):
            raise CheckpointError(f"unsupported hidden_act {act!r}")
        attention_bias = convert(hf.get("attention_bias", False), bool, "attention_bias")
        qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
        max_pos = _get(hf, "max_position_embeddings", "max_seq_len", 2048)
        num_layers = _get(hf, "num_hidden_layers", "num_layers")
        _no_sliding_window(hf, arch, max_pos, num_layers)
        return ModelConfig(
            vocab_size=_get(hf, "vocab_size", "vocab_size"),
            dim=_get(hf, "hidden_size", "dim"),
            num_layers=num_layers,
            num_heads=_get(hf, "num_attention_heads", "num_heads"),
            num_kv_heads=_get(hf, "num_key_value_heads", "num_kv_heads", None),
            head_dim=_get(hf, "head_dim", "head_dim", None),
            hidden_dim=_get(hf, "intermediate_size", "hidden_dim"),
            max_seq_len=max_pos,
            norm="rmsnorm", norm_eps=_get(hf, "rms_norm_eps", "norm_eps", 1e-6), pos="rope",
            rope_theta=10000.0 if theta is None else theta, rope_scaling=scaling,
            mlp="swiglu", activation="gelu_tanh" if act == "gelu_pytorch_tanh" else act,
            qkv_bias=qkv_bias, out_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=convert(hf.get("mlp_bias", False), bool, "mlp_bias"),
            tie_embeddings=_get(hf, "tie_word_embeddings", "tie_embeddings", False),
            **common,
        )
    except KeyError as err:
        raise CheckpointError(f"config.json lacks the key {err.args[0]!r} for {arch}") from None


def _gpt2_attention_exact(hf: dict[str, Any]) -> None:
    """Refuse GPT-2 attention variants exitlm does not compute (it always scales scores by
    ``1/sqrt(head_dim)`` and nothing else). ``reorder_and_upcast_attn`` only changes the
    order of fp32 operations and is accepted."""
    if not convert(hf.get("scale_attn_weights", True), bool, "scale_attn_weights"):
        raise CheckpointError(
            "scale_attn_weights: false is not supported (exitlm always scales attention "
            "scores by 1/sqrt(head_dim)); expected true")
    if convert(hf.get("scale_attn_by_inverse_layer_idx", False), bool,
               "scale_attn_by_inverse_layer_idx"):
        raise CheckpointError(
            "scale_attn_by_inverse_layer_idx: true is not supported (exitlm does not scale "
            "attention by 1/(layer_idx + 1)); expected false")
    convert(hf.get("reorder_and_upcast_attn", False), bool, "reorder_and_upcast_attn")


def _no_sliding_window(hf: dict[str, Any], arch: str, max_pos: int, num_layers: int) -> None:
    """Refuse a sliding attention window shorter than the context: exitlm attends over the
    whole context, which equals sliding-window attention only when the window covers every
    position (``sliding_window >= max_position_embeddings``, or null). Llama ignores the key;
    Qwen2 applies it only with ``use_sliding_window`` and to the layers ``layer_types`` (or
    ``max_window_layers``) mark."""
    if arch == "LlamaForCausalLM":
        return
    window = convert(hf.get("sliding_window"), int | None, "sliding_window")
    if window is None or window >= max_pos:
        return
    if arch == "Qwen2ForCausalLM":
        if not convert(hf.get("use_sliding_window", False), bool, "use_sliding_window"):
            return
        types = hf.get("layer_types")
        if isinstance(types, list):
            if "sliding_attention" not in types:
                return
        else:
            first = convert(hf.get("max_window_layers", 28), int, "max_window_layers")
            if first >= num_layers:
                return
    raise CheckpointError(
        f"sliding_window: {window} is shorter than max_position_embeddings {max_pos}; exitlm "
        "attends over the full context and cannot compute sliding-window attention exactly "
        "(expected sliding_window null or >= max_position_embeddings"
        + (", or use_sliding_window false)" if arch == "Qwen2ForCausalLM" else ")"))


def _number(rs: dict[str, Any], key: str) -> int | float:
    """``rope_scaling[key]``, which must be a JSON number (not a string or a boolean)."""
    value = rs[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"rope_scaling.{key}: expected a number, got {value!r}")
    return value


def check_token_ids_in_vocab(cfg: ModelConfig) -> ModelConfig:
    """Refuse a bos/eos token id outside the vocabulary (errors name the config.json key).
    Applied to checkpoint directories (``transformers``' in-memory default configs, such as a
    tiny GPT-2's eos 50256, are left to the caller)."""
    for key, ids in (("eos_token_id", cfg.eos_token_ids),
                     ("bos_token_id", () if cfg.bos_token_id is None else (cfg.bos_token_id,))):
        bad = [i for i in ids if i >= cfg.vocab_size]
        if bad:
            raise CheckpointError(f"{key}: {bad[0]} is outside the vocabulary (vocab_size "
                                  f"{cfg.vocab_size}); expected ids below {cfg.vocab_size}")
    return cfg


def hf_mismatch(cfg: ModelConfig) -> str | None:
    """Why no ``transformers`` architecture exitlm writes (Llama, Qwen2, GPT-2) computes the
    backbone of ``cfg``, or ``None`` when one does."""
    if cfg.pos == "learned":
        if cfg.norm != "layernorm" or cfg.mlp != "gelu":
            return "learned positions need LayerNorm and a GELU MLP (GPT-2)"
        if not (cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias):
            return "GPT-2 has biases in every linear layer"
        if cfg.n_kv_heads != cfg.num_heads or cfg.hdim * cfg.num_heads != cfg.dim:
            return "GPT-2 has neither grouped-query attention nor a head_dim of its own"
        return None
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu":
        return "rotary positions need RMSNorm and a SwiGLU MLP (Llama)"
    if cfg.out_bias and not cfg.qkv_bias:
        return "an output-projection bias without q/k/v biases"
    return None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for ``transformers`` describing the backbone of ``cfg``
    (:func:`hf_mismatch` says whether one exists)."""
    if cfg.pos == "learned":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_embd": cfg.dim, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_inner": cfg.hidden_dim, "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": {"gelu_tanh": "gelu_new"}.get(cfg.activation,
                                                                  cfg.activation),
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": _eos_out(cfg), "torch_dtype": "float32",
        }
    qwen2 = cfg.qkv_bias and not cfg.out_bias  # Llama's attention_bias covers o_proj too
    d: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.hdim,
        "intermediate_size": cfg.hidden_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.activation, cfg.activation),
        "attention_bias": cfg.out_bias, "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_out(cfg), "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = (
            {"rope_type": "linear", "factor": rs.factor} if rs.kind == "linear" else
            {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
             "high_freq_factor": rs.high_freq_factor,
             "original_max_position_embeddings": rs.original_max_position_embeddings}
        )
    return d


def _eos_out(cfg: ModelConfig) -> int | list[int] | None:
    if not cfg.eos_token_ids:
        return None
    return cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)


# ----- tensors: HF -> exitlm -------------------------------------------------------------------

_LLAMA_SIMPLE = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LLAMA_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LLAMA_LAYER_SIMPLE = {
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.o_proj.bias": "attn.wo.bias",
    "mlp.down_proj.weight": "mlp.w_out.weight",
    "mlp.down_proj.bias": "mlp.w_out.bias",
    "input_layernorm.weight": "norm_attn.weight",
    "post_attention_layernorm.weight": "norm_mlp.weight",
}
_LLAMA_FUSED = {
    # exitlm name -> HF parts in concatenation order
    "attn.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                         "self_attn.v_proj.weight"),
    "attn.wqkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                       "self_attn.v_proj.bias"),
    "mlp.w_in.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.w_in.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}
_LLAMA_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")

_GPT2_SIMPLE = {
    "wte.weight": "embed_tokens.weight", "wpe.weight": "embed_positions.weight",
    "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias",
}
_GPT2_LAYER = re.compile(r"h\.(\d+)\.(.+)")
_GPT2_LAYER_MAP = {
    "ln_1.weight": "norm_attn.weight", "ln_1.bias": "norm_attn.bias",
    "ln_2.weight": "norm_mlp.weight", "ln_2.bias": "norm_mlp.bias",
    "attn.c_attn.weight": "attn.wqkv.weight", "attn.c_attn.bias": "attn.wqkv.bias",
    "attn.c_proj.weight": "attn.wo.weight", "attn.c_proj.bias": "attn.wo.bias",
    "mlp.c_fc.weight": "mlp.w_in.weight", "mlp.c_fc.bias": "mlp.w_in.bias",
    "mlp.c_proj.weight": "mlp.w_out.weight", "mlp.c_proj.bias": "mlp.w_out.bias",
}
_GPT2_IGNORED = re.compile(r"h\.\d+\.attn\.(masked_)?bias$")


def hf_to_exitlm(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, source: str = "checkpoint"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Translate ``(hf_name, tensor)`` pairs into ``(exitlm_name, tensor)`` pairs."""
    if cfg.pos == "learned":
        yield from _gpt2_to_exitlm(tensors, source)
    else:
        yield from _llama_to_exitlm(tensors, source)


def _llama_to_exitlm(
    tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    part_of = {part: fused for fused, parts in _LLAMA_FUSED.items() for part in parts}
    for name, t in tensors:
        if name in _LLAMA_SIMPLE:
            yield _LLAMA_SIMPLE[name], t
            continue
        if _LLAMA_IGNORED.match(name):
            continue
        m = _LLAMA_LAYER.fullmatch(name)
        if not m:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} for a Llama-family model")
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _LLAMA_LAYER_SIMPLE:
            yield f"layers.{layer}.{_LLAMA_LAYER_SIMPLE[rest]}", t
        elif rest in part_of:
            fused = part_of[rest]
            got = pending.setdefault((layer, fused), {})
            got[rest] = t
            if len(got) == len(_LLAMA_FUSED[fused]):
                del pending[(layer, fused)]
                for p in _LLAMA_FUSED[fused]:
                    _check_part(got[p], f"model.layers.{layer}.{p}", source)
                yield f"layers.{layer}.{fused}", cat_rows([got[p] for p in _LLAMA_FUSED[fused]])
        else:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} for a Llama-family model")
    for (layer, fused), got in pending.items():
        missing = sorted(set(_LLAMA_FUSED[fused]) - set(got))
        names = [f"model.layers.{layer}.{p}" for p in missing]
        raise CheckpointError(f"{source}: layer {layer} is missing {names}")


def _check_part(t: Any, name: str, source: str) -> None:
    """A part of a fused tensor (q/k/v, gate/up) must be a float weight exitlm can
    concatenate: integer/bool parts would be silently converted, float8 ones cannot be."""
    if isinstance(t, torch.Tensor):  # else a quantized weight (GGUF): cat_rows handles it
        check_float_weight(t, name, source)


def check_float_weight(t: torch.Tensor, name: str, where: str) -> None:
    """Refuse a tensor that cannot be a float weight: integer, bool, complex, or float8 (one
    byte: exitlm would widen it silently, or cannot fuse it with its q/k/v or gate/up
    siblings), as one line naming the file (``where``), the tensor and its dtype. Quantized
    weights exitlm wrote come as integer buffers of their own names, not through here."""
    if t.dtype.is_floating_point and t.dtype.itemsize > 1:
        return
    raise CheckpointError(f"{where}: tensor {name!r} has dtype "
                          f"{str(t.dtype).removeprefix('torch.')}; expected a float weight "
                          "(float32, float16 or bfloat16)")


def _gpt2_to_exitlm(
    tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        if name == "lm_head.weight":
            yield "lm_head.weight", t
            continue
        short = name.removeprefix("transformer.")
        if _GPT2_IGNORED.match(short):
            continue
        if short in _GPT2_SIMPLE:
            yield _GPT2_SIMPLE[short], t
            continue
        m = _GPT2_LAYER.fullmatch(short)
        if not m or m.group(2) not in _GPT2_LAYER_MAP:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} for a GPT-2 model")
        ours = _GPT2_LAYER_MAP[m.group(2)]
        if ours.endswith(".weight") and t.dim() == 2:
            t = t.t().contiguous()  # Conv1D stores (in, out)
        yield f"layers.{m.group(1)}.{ours}", t


# ----- tensors: exitlm -> HF -------------------------------------------------------------------

def hf_names(name: str, cfg: ModelConfig) -> list[str]:
    """The ``transformers`` tensors that exitlm's tensor ``name`` is made of, in order (q, k,
    v for ``attn.wqkv``; gate, up for ``mlp.w_in``); an exit head's tensor, which
    ``transformers`` cannot represent, is its own name; none for a name of no tensor."""
    gpt2 = cfg.pos == "learned"
    if name.startswith("exits.") or name == "lm_head.weight":
        return [name]
    simple = {v: k for k, v in (_GPT2_SIMPLE if gpt2 else _LLAMA_SIMPLE).items()}
    if name in simple:
        return [("transformer." if gpt2 else "") + simple[name]]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m:
        return []
    layer, rest = int(m.group(1)), m.group(2)
    if gpt2:
        return [f"transformer.h.{layer}.{k}" for k, v in _GPT2_LAYER_MAP.items() if v == rest]
    if rest in _LLAMA_FUSED:
        return [f"model.layers.{layer}.{part}" for part in _LLAMA_FUSED[rest]]
    return [f"model.layers.{layer}.{k}" for k, v in _LLAMA_LAYER_SIMPLE.items() if v == rest]


def exitlm_to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Translate backbone tensors into ``transformers`` names (exit heads are skipped: they
    have no ``transformers`` equivalent and are exported separately)."""
    h, hkv, d = cfg.num_heads, cfg.n_kv_heads, cfg.hdim
    gpt2 = cfg.pos == "learned"
    for name, t in tensors:
        if name.startswith("exits."):
            continue
        names = hf_names(name, cfg)
        if not names:
            raise CheckpointError(f"cannot export tensor {name!r}")
        if len(names) > 1:  # fused q/k/v or gate/up
            sizes = (h * d, hkv * d, hkv * d) if len(names) == 3 else (
                cfg.hidden_dim, cfg.hidden_dim)
            for part, piece in zip(names, t.split(sizes), strict=True):
                yield part, piece.contiguous()
            continue
        if gpt2 and name.startswith("layers.") and name.endswith(".weight") and t.dim() == 2:
            t = t.t()  # Conv1D stores (in, out)
        yield names[0], t.contiguous() if name.startswith("layers.") else t
