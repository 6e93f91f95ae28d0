"""Load EE-LLM / Megatron-LM GPT checkpoints (any tensor x pipeline split) as one exitlm model.

The architecture comes from the ``args`` Namespace every shard carries (Megatron's defaults
where an argument is absent, and the tensors' own names and shapes where they settle it);
the files and the tensor-parallel merge are :mod:`exitlm.io.megatron_layout`.

EE-LLM's exits (``megatron/model/transformer.py:EarlyExitTransformerLayer``) map to
:class:`~exitlm.config.ExitConfig`:

* ``--exit-layer-nums n ...``: a head on Megatron layer ``n`` (1-based). It reads that layer's
  output, i.e. exitlm's exit ``n``; with ``--pre-exit`` it reads the layer's *input*: exit
  ``n - 1`` (the released 1.3B/7B models: ``--exit-layer-nums 7 13`` / ``9 17 --pre-exit``,
  exits after layers 6/12 and 8/16).
* ``--use-exit-block``: a transformer layer first (``head="block"``);
* ``--use-exit-norm``: a norm of its own (``norm="own"``), else none (``norm="none"``);
* ``--untie-exit-output-weights``: its own output matrix (``output="own"``), else the word
  embedding (``output="tied_embedding"``).
* ``--exit-layer-weight``, ``--exit-layer-temperature``, ``--use-dynamic-exit-layer-weight``
  shape the training loss only (inference logits do not use the temperature) and are not kept.
* ``--use-exit-mlp`` is refused: EE-LLM's exit MLP runs *beside* the layer's MLP on its
  attention output, which no exitlm head computes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exitlm.config import ConfigError, ExitConfig, ModelConfig, RopeScaling
from exitlm.io.hf_map import CheckpointError
from exitlm.io.loaded import LoadedModel, keep_matching_exits
from exitlm.io.materialize import model_from_tensors
from exitlm.io.megatron_layout import Shard, Shards, find_shards, merge, read_shard, split_kind
from exitlm.model.transformer import EarlyExitLM

_LAYER_MAP = {  # Megatron layer module -> exitlm Block module
    "input_norm": "norm_attn", "self_attention.query_key_value": "attn.wqkv",
    "self_attention.dense": "attn.wo", "post_attention_norm": "norm_mlp",
    "mlp.dense_h_to_4h": "mlp.w_in", "mlp.dense_4h_to_h": "mlp.w_out",
}
_FILLED_BIASES = (".attn.wqkv.bias", ".attn.wo.bias", ".mlp.w_in.bias", ".mlp.w_out.bias")


@dataclass(frozen=True)
class MegatronArch:
    """What reading the shards needs beyond the :class:`ModelConfig`."""

    cfg: ModelConfig
    swiglu: bool
    groups: int  # query groups (key/value heads)
    layers_per_stage: int
    exit_nums: tuple[int, ...]  # Megatron layer numbers (1-based) that hold exit heads
    pre_exit: bool
    layernorm_1p: bool
    fill_biases: bool  # GPT-2-style model saved without biases: zeros make it HF-expressible

    def exit_layer(self, n: int) -> int:
        """exitlm's exit layer for the head on Megatron layer ``n``."""
        return n - 1 if self.pre_exit else n


def _arg(args: argparse.Namespace | None, name: str, default: Any) -> Any:
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def _refuse(where: Path, option: str, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: EE-LLM/Megatron option {option} is not supported: {why}")


def megatron_arch(shards: Shards, stages: list[list[Shard]], name: str = "megatron"
                  ) -> MegatronArch:
    """The architecture of a checkpoint from its arguments and tensors (``stages[p][t]``)."""
    first = stages[0][0]
    args, where = first.args, first.file
    probe = {k: v.shape for stage in stages for k, v in stage[0].tensors.items()}
    tp, pp = shards.tp, shards.pp
    version = first.version
    if version is not None and version < 2.0:
        raise _refuse(where, f"checkpoint_version {version}", "QKV rows before version 2.0 "
                      "are ordered differently; re-save with a current Megatron")
    for flag, why in (
        ("apply_residual_connection_post_layernorm", "residuals taken after the norm"),
        ("use_exit_mlp", "EE-LLM's exit MLP runs beside layer n's MLP on its attention "
                         "output; exitlm's exit MLP follows the layer"),
        ("squared_relu", "no squared-ReLU MLP in exitlm"),
        ("retro_add_retriever", "RETRO"), ("standalone_embedding_stage", "embedding stage"),
    ):
        if _arg(args, flag, False):
            raise _refuse(where, "--" + flag.replace("_", "-"), why)
    if _arg(args, "transformer_impl", "local") != "local":
        raise _refuse(where, "--transformer-impl " + str(args.transformer_impl),  # type: ignore
                      "Transformer Engine layers use other tensor names; save with 'local'")
    if _arg(args, "num_experts", None) is not None:
        raise _refuse(where, "--num-experts", "mixture-of-experts MLPs")
    if any(".mlp.branch." in k or ".mlp.trunk." in k for k in probe):
        raise _refuse(where, "--use-exit-mlp", "exit MLP tensors (mlp.branch) present")
    if _arg(args, "rotary_percent", 1.0) != 1.0:
        raise _refuse(where, f"--rotary-percent {args.rotary_percent}",  # type: ignore
                      "partial rotary embeddings")

    per_stage = {len({k.split(".")[2] for k in (st[0].tensors) if k.startswith("encoder.layers.")})
                 for st in stages}
    if len(per_stage) != 1 or 0 in per_stage:
        raise CheckpointError(f"{shards.root}: pipeline stages hold different numbers of layers "
                              f"({sorted(per_stage)}); Megatron splits layers evenly")
    lp = per_stage.pop()
    num_layers = lp * pp
    if _arg(args, "num_layers", num_layers) != num_layers:
        raise CheckpointError(f"{where}: args.num_layers is {args.num_layers} but the "  # type: ignore
                              f"{pp} stage(s) hold {num_layers} layers")
    emb = probe.get("embedding.word_embeddings.weight")
    if emb is None:
        raise CheckpointError(f"{where}: lacks language_model.embedding.word_embeddings.weight")
    padded, dim = emb[0] * tp, emb[1]
    heads = _arg(args, "num_attention_heads", None)
    if heads is None:
        raise CheckpointError(f"{where}: args.num_attention_heads is missing")
    head_dim = _arg(args, "kv_channels", dim // heads)
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention",
                                                           False) else heads
    w_out = probe.get("encoder.layers.0.mlp.dense_4h_to_h.weight")
    ffn = _arg(args, "ffn_hidden_size", w_out[1] * tp if w_out is not None else 4 * dim)
    swiglu = bool(_arg(args, "swiglu", False))
    w_in = probe.get("encoder.layers.0.mlp.dense_h_to_4h.weight")
    if w_in is not None and w_in[0] * tp != (2 if swiglu else 1) * ffn:
        raise CheckpointError(f"{where}: dense_h_to_4h has {w_in[0] * tp} rows, args imply "
                              f"{(2 if swiglu else 1) * ffn} (ffn_hidden_size {ffn}, swiglu "
                              f"{swiglu})")
    vocab = _arg(args, "vocab_size", padded)
    if not isinstance(vocab, int) or not 0 < vocab <= padded:
        vocab = padded
    bias = _arg(args, "add_bias_linear", "encoder.layers.0.self_attention.query_key_value.bias"
                in probe)
    norm_kind = _arg(args, "normalization",
                     "LayerNorm" if "encoder.layers.0.input_norm.bias" in probe else "RMSNorm")
    if norm_kind not in ("LayerNorm", "RMSNorm"):
        raise _refuse(where, f"--normalization {norm_kind}", "LayerNorm or RMSNorm expected")
    pos_kind = _arg(args, "position_embedding_type", None)
    if pos_kind is None:
        rope = _arg(args, "use_rotary_position_embeddings", False)
        pos_kind = "rope" if rope or "embedding.position_embeddings.weight" not in probe \
            else "learned_absolute"
    if pos_kind not in ("rope", "learned_absolute"):
        raise _refuse(where, f"--position-embedding-type {pos_kind}", "rope or learned_absolute")
    pos_table = probe.get("embedding.position_embeddings.weight")
    max_seq = pos_table[0] if pos_kind == "learned_absolute" and pos_table is not None else \
        _arg(args, "max_position_embeddings", _arg(args, "seq_length", 2048))
    interp = _arg(args, "rotary_seq_len_interpolation_factor", None)
    if swiglu:
        act = "silu"
    elif _arg(args, "openai_gelu", False) or (bias and _arg(args, "bias_gelu_fusion", True)):
        act = "gelu_tanh"  # Megatron's fused bias-GELU is the tanh approximation
    else:
        act = "gelu"
    tied = not _arg(args, "untie_embeddings_and_output_weights", "output_layer.weight" in probe)
    gpt2_like = pos_kind == "learned_absolute" and norm_kind == "LayerNorm" and not swiglu
    fill = gpt2_like and not bias

    exit_nums = tuple(sorted(int(n) for n in _arg(args, "exit_layer_nums", [])))
    has_exit_tensors = any(k.startswith("exit_output_layer.") or ".exit_" in k for k in probe)
    if has_exit_tensors and not exit_nums:
        raise CheckpointError(f"{where}: has exit heads but args.exit_layer_nums is missing")
    pre_exit = bool(_arg(args, "pre_exit", False))
    block = bool(_arg(args, "use_exit_block", any(".exit_block." in k for k in probe)))
    own_norm = bool(_arg(args, "use_exit_norm", any(".exit_norm." in k for k in probe)))
    untie_exit = bool(_arg(args, "untie_exit_output_weights",
                           any(k.startswith("exit_output_layer.") for k in probe)))
    if exit_nums and not untie_exit and not tied:
        raise _refuse(where, "--untie-embeddings-and-output-weights without "
                      "--untie-exit-output-weights", "EE-LLM itself rejects this combination")
    layers = []
    for n in exit_nums:
        layer = n - 1 if pre_exit else n
        if not 1 <= layer < num_layers:
            opt = f"--exit-layer-nums {n}" + (" with --pre-exit" if pre_exit else "")
            raise _refuse(where, opt, f"it reads the hidden state after layer {layer}; exitlm "
                          f"exits lie after layers 1..{num_layers - 1}")
        layers.append(layer)
    exits = ExitConfig(layers=tuple(layers), head="block" if block else "linear",
                       norm="own" if own_norm else "none",
                       output="own" if untie_exit else "tied_embedding") if layers else \
        ExitConfig()
    try:
        cfg = ModelConfig(
            vocab_size=vocab, dim=dim, num_layers=num_layers, num_heads=heads,
            num_kv_heads=groups, head_dim=head_dim, hidden_dim=ffn, max_seq_len=max_seq,
            norm="rmsnorm" if norm_kind == "RMSNorm" else "layernorm",
            norm_eps=float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))),
            pos="rope" if pos_kind == "rope" else "learned", rope_theta=10000.0,
            rope_scaling=RopeScaling(kind="linear", factor=float(interp)) if interp else None,
            mlp="swiglu" if swiglu else "gelu", activation=act, qkv_bias=bias or fill,
            out_bias=bias or fill, mlp_bias=bias or fill, tie_embeddings=tied, exits=exits,
            name=name,
        )
    except ConfigError as err:
        raise CheckpointError(f"{where}: the saved arguments describe no valid model: {err}"
                              ) from None
    return MegatronArch(cfg, swiglu, groups, lp, exit_nums, pre_exit,
                        bool(_arg(args, "apply_layernorm_1p", False)) and norm_kind == "LayerNorm",
                        fill)


# ----- tensors ---------------------------------------------------------------------------------

def qkv_from_megatron(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's fused QKV rows (per query group: its ``heads/groups`` query heads, one key
    head, one value head) -> exitlm's ``[all q; all k; all v]``."""
    per = heads // groups
    g = t.reshape(groups, per + 2, head_dim, *t.shape[1:])  # (G, per+2, hd, ...)
    q = g[:, :per].reshape(heads * head_dim, *t.shape[1:])
    k = g[:, per].reshape(groups * head_dim, *t.shape[1:])
    v = g[:, per + 1].reshape(groups * head_dim, *t.shape[1:])
    return torch.cat((q, k, v), dim=0)


def qkv_to_megatron(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`qkv_from_megatron`."""
    per, rest = heads // groups, t.shape[1:]
    q, k, v = t.split((heads * head_dim, groups * head_dim, groups * head_dim))
    g = torch.cat((q.reshape(groups, per, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                   v.reshape(groups, 1, head_dim, *rest)), dim=1)  # (G, per+2, hd, ...)
    return g.reshape(-1, *rest)


def _exitlm_name(key: str, p: int, arch: MegatronArch, stage_exits: list[int], where: Path
                 ) -> str | None:
    """exitlm's name for the canonical Megatron tensor ``key`` of stage ``p`` (``None``:
    a tensor exitlm does not keep)."""
    simple = {"embedding.word_embeddings.weight": "embed_tokens.weight",
              "embedding.position_embeddings.weight": "embed_positions.weight",
              "encoder.final_norm.weight": "norm.weight", "encoder.final_norm.bias": "norm.bias",
              "output_layer.weight": "lm_head.weight"}
    if key in simple:
        return simple[key]
    if key.startswith("word_embeddings_for_head."):
        return None  # a later stage's copy of the word embedding (tied exits / head)
    parts = key.split(".")
    if parts[0] == "exit_output_layer" and len(parts) == 3 and parts[1].isdigit():
        j = int(parts[1])
        if j < len(stage_exits):
            return f"exits.{arch.exit_layer(stage_exits[j])}.proj.{parts[2]}"
    if parts[:2] == ["encoder", "layers"] and len(parts) >= 5 and parts[2].isdigit():
        n = p * arch.layers_per_stage + int(parts[2]) + 1  # Megatron's 1-based layer number
        rest = ".".join(parts[3:])
        target = f"layers.{n - 1}"
        if rest.startswith(("exit_norm.", "exit_block.")) and n in arch.exit_nums:
            head = f"exits.{arch.exit_layer(n)}"
            if rest.startswith("exit_norm."):
                return f"{head}.norm.{rest.removeprefix('exit_norm.')}"
            target, rest = f"{head}.block", rest.removeprefix("exit_block.")
        module, _, leaf = rest.rpartition(".")
        if module in _LAYER_MAP:
            return f"{target}.{_LAYER_MAP[module]}.{leaf}"
    raise CheckpointError(f"{where}: unexpected tensor {key!r} for a Megatron GPT model with "
                          f"exits at Megatron layers {list(arch.exit_nums)}")


def megatron_tensors(shards: Shards, stages: list[list[Shard]], arch: MegatronArch
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(exitlm_name, tensor)`` pairs of the whole model, merged one tensor at a time."""
    cfg = arch.cfg
    for p, stage in enumerate(stages):
        lo, hi = p * arch.layers_per_stage, (p + 1) * arch.layers_per_stage
        stage_exits = [n for n in arch.exit_nums if lo < n <= hi]
        keys = list(stage[0].tensors)
        for shard in stage[1:]:
            if set(shard.tensors) != set(keys):
                odd = sorted(set(shard.tensors) ^ set(keys))[0]
                raise CheckpointError(f"{shard.file}: tensor {odd!r} differs from "
                                      f"{stage[0].file}'s tensors (same stage, other rank)")
        for key in keys:
            name = _exitlm_name(key, p, arch, stage_exits, stage[0].file)
            if name is None:
                continue
            t = merge(split_kind(key, arch.swiglu), [s.tensors[key] for s in stage])
            if name.endswith("attn.wqkv.weight") or name.endswith("attn.wqkv.bias"):
                t = qkv_from_megatron(t, cfg.num_heads, arch.groups, cfg.hdim)
            elif name in ("embed_tokens.weight", "lm_head.weight") or name.endswith(".proj.weight"):
                t = t[: cfg.vocab_size]
            elif arch.layernorm_1p and "norm" in name.rsplit(".", 2)[-2] and \
                    name.endswith(".weight"):
                t = t + 1  # --apply-layernorm-1p stores weight - 1
            yield name, t
    if arch.fill_biases:
        with torch.device("meta"):
            meta = EarlyExitLM(cfg)
        for name, param in meta.named_parameters():
            if name.endswith(_FILLED_BIASES):
                yield name, torch.zeros(param.shape)


def read_megatron(path: Path, name: str | None = None
                  ) -> tuple[MegatronArch, Iterator[tuple[str, torch.Tensor]]]:
    """The architecture of the checkpoint at ``path`` and its tensors in exitlm names."""
    shards = find_shards(path)
    stages = [[read_shard(shards.file(t, p)) for t in range(shards.tp)] for p in range(shards.pp)]
    arch = megatron_arch(shards, stages, name or path.name or "megatron")
    return arch, megatron_tensors(shards, stages, arch)


def load_megatron(path: Path, *, dtype: torch.dtype = torch.float32,
                  exits: ExitConfig | None = None) -> LoadedModel:
    """Load a Megatron-LM / EE-LLM checkpoint directory as one model (no tokenizer: Megatron
    keeps it outside the checkpoint)."""
    arch, tensors = read_megatron(path)
    ckpt = arch.cfg
    cfg = ckpt if exits is None else ckpt.replace(exits=exits)
    model = model_from_tensors(cfg, keep_matching_exits(tensors, ckpt, cfg), source=str(path),
                               dtype=dtype, allow_missing_exits=exits is not None)
    return LoadedModel(model, None, cfg, str(path))
