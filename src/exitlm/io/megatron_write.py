"""Write a model as a Megatron-LM / EE-LLM checkpoint with a chosen tensor x pipeline split
(``exitlm convert SRC DST --to megatron --tp T --pp P``): what EE-LLM users resharding the
released checkpoints need (EE-LLM issues 5, 20).

The layout is the one :mod:`exitlm.io.megatron_layout` reads: ``latest_checkpointed_iteration.txt``
= ``release``, ``release/mp_rank_*/model_optim_rng.pt`` holding ``args``, ``checkpoint_version``
3.0 and the nested model dict of EE-LLM's ``state_dict_for_save_checkpoint`` (later stages
holding a tied head or an exit carry ``word_embeddings_for_head``). Exits are written with
``--pre-exit`` (as EE-LLM's releases), so exitlm's exit ``l`` sits on Megatron layer ``l + 1``.
The vocabulary is padded with zero rows to a multiple of ``128 * T`` (Megatron's rule), and
``args.vocab_size`` keeps the true size, which the reader cuts back to.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exitlm.config import ModelConfig
from exitlm.io.hf_map import CheckpointError
from exitlm.io.megatron import qkv_to_megatron
from exitlm.io.megatron_layout import SHARD_FILE, TRACKER, split, split_kind
from exitlm.io.st import atomic_dir
from exitlm.model.transformer import EarlyExitLM

if TYPE_CHECKING:
    from exitlm.io.loaded import LoadedModel

_LAYER_MAP = {"norm_attn": "input_norm", "attn.wqkv": "self_attention.query_key_value",
              "attn.wo": "self_attention.dense", "norm_mlp": "post_attention_norm",
              "mlp.w_in": "mlp.dense_h_to_4h", "mlp.w_out": "mlp.dense_4h_to_h"}
DIVISIBLE_BY = 128


def megatron_args(cfg: ModelConfig, tp: int, pp: int) -> argparse.Namespace:
    """The Megatron / EE-LLM arguments describing ``cfg``; refuses what they cannot say."""
    ex = cfg.exits

    def no(what: str, setting: str) -> CheckpointError:
        return CheckpointError(f"{cfg.name}: EE-LLM/Megatron cannot express {what}",
                               hint=f"change {setting} or write another format")

    if cfg.rope_theta != 10000.0 and cfg.pos == "rope":
        raise no(f"rope_theta {cfg.rope_theta} (its rotary base is 10000)", "rope_theta")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind != "linear":
        raise no(f"{cfg.rope_scaling.kind} rope scaling", "rope_scaling")
    if len({cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias}) != 1:
        raise no("biases on some linear layers only (--add-bias-linear is all or none)",
                 "qkv_bias / out_bias / mlp_bias")
    if cfg.activation not in (("silu",) if cfg.mlp == "swiglu" else ("gelu", "gelu_tanh")):
        raise no(f"a {cfg.mlp} MLP with {cfg.activation}", "activation")
    if ex.every_layer or ex.head == "mlp" or (ex.layers and ex.norm == "final"):
        raise no("exits through the final norm, every-layer exits or exit MLPs "
                 "(EE-LLM heads: block, own norm or none, own or tied output)", "exits")
    if ex.layers and ex.output != "own" and not cfg.tie_embeddings:
        raise no("exits sharing an untied output layer", "exits.output")
    for what, n in (("num_layers", cfg.num_layers), ):
        if n % pp:
            raise CheckpointError(f"--pp {pp} does not divide {what} {n}")
    for what, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.n_kv_heads),
                    ("hidden_dim", cfg.hidden_dim)):
        if n % tp:
            raise CheckpointError(f"--tp {tp} does not divide {what} {n}")
    multiple = DIVISIBLE_BY * tp
    bias = cfg.qkv_bias
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.dim, num_attention_heads=cfg.num_heads,
        group_query_attention=cfg.n_kv_heads != cfg.num_heads, num_query_groups=cfg.n_kv_heads,
        kv_channels=cfg.hdim, ffn_hidden_size=cfg.hidden_dim, swiglu=cfg.mlp == "swiglu",
        normalization="RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.norm_eps, apply_layernorm_1p=False,
        position_embedding_type="rope" if cfg.pos == "rope" else "learned_absolute",
        max_position_embeddings=cfg.max_seq_len, seq_length=cfg.max_seq_len,
        rotary_percent=1.0, rotary_seq_len_interpolation_factor=(
            cfg.rope_scaling.factor if cfg.rope_scaling is not None else None),
        add_bias_linear=bias, bias_gelu_fusion=bias and cfg.activation == "gelu_tanh",
        openai_gelu=not bias and cfg.activation == "gelu_tanh",
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=DIVISIBLE_BY,
        padded_vocab_size=-(-cfg.vocab_size // multiple) * multiple,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        exit_layer_nums=[layer + 1 for layer in ex.layers], pre_exit=True,
        exit_layer_weight=[1.0] * len(ex.layers), exit_layer_temperature=[1.0] * len(ex.layers),
        use_exit_norm=ex.norm == "own", use_exit_block=ex.head == "block", use_exit_mlp=False,
        untie_exit_output_weights=bool(ex.layers) and ex.output == "own",
        transformer_impl="local", params_dtype=torch.float32,
    )


def _full_tensors(model: EarlyExitLM, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Unsharded tensors in canonical Megatron names, global layer numbers 0..L-1."""
    cfg = model.config
    pad = args.padded_vocab_size - cfg.vocab_size

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t.new_zeros(pad, t.shape[1]))) if pad else t

    out: dict[str, torch.Tensor] = {}
    exit_order = sorted(cfg.exits.layers)
    for name, t in model.state_dict().items():
        t = t.detach()
        if name == "embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = padded(t)
        elif name == "embed_positions.weight":
            out["embedding.position_embeddings.weight"] = t
        elif name.startswith("norm."):
            out["encoder.final_" + name] = t
        elif name == "lm_head.weight":
            out["output_layer.weight"] = padded(t)
        else:
            parts = name.split(".")
            if parts[0] == "exits":
                layer, kind = int(parts[1]), parts[2]
                if kind == "proj":
                    out[f"exit_output_layer.{exit_order.index(layer)}.weight"] = padded(t)
                    continue
                prefix = f"encoder.layers.{layer}."  # Megatron layer l + 1 (--pre-exit)
                if kind == "norm":
                    out[prefix + "exit_norm." + parts[-1]] = t
                    continue
                prefix, rest = prefix + "exit_block.", ".".join(parts[3:])
            else:
                prefix, rest = f"encoder.layers.{parts[1]}.", ".".join(parts[2:])
            module, _, leaf = rest.rpartition(".")
            if module == "attn.wqkv":
                t = qkv_to_megatron(t, cfg.num_heads, cfg.n_kv_heads, cfg.hdim)
            out[f"{prefix}{_LAYER_MAP[module]}.{leaf}"] = t
    return out


def save_megatron(loaded: LoadedModel | EarlyExitLM, path: str | Path, *, tp: int = 1,
                  pp: int = 1, overwrite: bool = False) -> Path:
    """Write ``loaded`` as a Megatron / EE-LLM checkpoint split ``tp`` x ``pp`` (atomic:
    the directory appears complete or not at all)."""
    model = loaded if isinstance(loaded, EarlyExitLM) else loaded.model
    cfg = model.config
    if tp < 1 or pp < 1:
        raise CheckpointError(f"--tp and --pp must be positive, got {tp} and {pp}")
    args = megatron_args(cfg, tp, pp)
    full = _full_tensors(model, args)
    lp = cfg.num_layers // pp
    exits = sorted(args.exit_layer_nums)
    target = Path(path)
    with atomic_dir(target, overwrite=overwrite) as tmp:
        for p in range(pp):
            stage_exits = [n for n in exits if p * lp < n <= (p + 1) * lp]
            stage = _stage(full, p, lp, pp, exits, stage_exits)
            head_copy = cfg.tie_embeddings and p > 0 and (p == pp - 1 or bool(stage_exits))
            if head_copy:
                stage["word_embeddings_for_head.weight"] = full["embedding.word_embeddings.weight"]
            parts = {k: split(split_kind(k, args.swiglu), v, tp) for k, v in stage.items()}
            for t in range(tp):
                sub = f"mp_rank_{t:02d}_{p:03d}" if pp > 1 else f"mp_rank_{t:02d}"
                (tmp / "release" / sub).mkdir(parents=True)
                nested = _nest({k: v[t].clone() for k, v in parts.items()})
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0,
                            "model": nested}, tmp / "release" / sub / SHARD_FILE)
        (tmp / TRACKER).write_text("release\n", encoding="utf-8")
    return target


def _stage(full: dict[str, torch.Tensor], p: int, lp: int, pp: int, exits: list[int],
           stage_exits: list[int]) -> dict[str, torch.Tensor]:
    """The canonical tensors pipeline stage ``p`` holds (its layers renumbered from 0)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in full.items():
        if key.startswith("embedding."):
            keep = p == 0
        elif key.startswith("encoder.layers."):
            i = int(key.split(".")[2])
            keep = p * lp <= i < (p + 1) * lp
            if keep:
                key = f"encoder.layers.{i - p * lp}.{key.split('.', 3)[3]}"
        elif key.startswith("exit_output_layer."):
            n = exits[int(key.split(".")[1])]
            keep = n in stage_exits
            if keep:
                key = f"exit_output_layer.{stage_exits.index(n)}.weight"
        else:  # final norm, output layer
            keep = p == pp - 1
        if keep:
            out[key] = t
    return out


def _nest(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """EE-LLM's nesting: ``{"language_model": {"embedding": {"word_embeddings": {...}},
    "encoder": {flat layer names}, "output_layer": {...}, "exit_output_layer": {...}},
    "word_embeddings_for_head": {...}}``."""
    lm: dict[str, Any] = {}
    top: dict[str, Any] = {"language_model": lm}
    for key, t in flat.items():
        if key.startswith("word_embeddings_for_head."):
            top.setdefault("word_embeddings_for_head", {})["weight"] = t
        elif key.startswith("embedding."):
            kind, _, leaf = key.removeprefix("embedding.").partition(".")
            lm.setdefault("embedding", {}).setdefault(kind, {})[leaf] = t
        else:
            group, _, rest = key.partition(".")
            lm.setdefault(group, {})[rest] = t
    return top
