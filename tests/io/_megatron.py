"""Synthetic EE-LLM / Megatron-LM checkpoints for the tests, written independently of
``exitlm.io.megatron*`` from the reference code (pan-x-c/EE-LLM): ``megatron/checkpointing.py``
(files), ``model/language_model.py`` / ``early_exit_gpt_model.py`` (nested state dicts),
``model/transformer.py`` (layer and exit modules, the QKV group layout), ``core/tensor_parallel``
(column/row splits). :func:`reference_logits` is Megatron's forward written from those files
(sequence-first tensors, per-group QKV views, ``repeat_interleave`` of key/value groups,
rotate-half rotary embeddings), on the unsharded tensors."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Spec:
    """A tiny EE-LLM configuration (names follow Megatron's arguments)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int | None = 2  # None: no grouped-query attention
    ffn_hidden_size: int = 48
    vocab_size: int = 61  # the tokenizer's; padded to a multiple of 8 * TP
    make_vocab_size_divisible_by: int = 8
    max_position_embeddings: int = 32
    swiglu: bool = True
    normalization: str = "RMSNorm"
    position_embedding_type: str = "rope"
    add_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = False
    exit_layer_nums: list[int] = field(default_factory=lambda: [2, 3])
    pre_exit: bool = True
    use_exit_norm: bool = False
    use_exit_block: bool = False
    untie_exit_output_weights: bool = False
    norm_epsilon: float = 1e-5

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def _layer(spec: Spec, g: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    """One ParallelTransformerLayer's full (TP=1) tensors."""
    h, hd = spec.hidden_size, spec.hidden_size // spec.num_attention_heads
    groups = spec.num_query_groups or spec.num_attention_heads
    qkv_rows = (spec.num_attention_heads + 2 * groups) * hd
    ffn_rows = spec.ffn_hidden_size * (2 if spec.swiglu else 1)

    def r(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t = {
        "input_norm.weight": 1 + r(h, scale=0.1),
        "self_attention.query_key_value.weight": r(qkv_rows, h),
        "self_attention.dense.weight": r(h, spec.num_attention_heads * hd),
        "post_attention_norm.weight": 1 + r(h, scale=0.1),
        "mlp.dense_h_to_4h.weight": r(ffn_rows, h),
        "mlp.dense_4h_to_h.weight": r(h, spec.ffn_hidden_size),
    }
    if spec.normalization == "LayerNorm":
        t["input_norm.bias"] = r(h, scale=0.1)
        t["post_attention_norm.bias"] = r(h, scale=0.1)
    if spec.add_bias_linear:
        t["self_attention.query_key_value.bias"] = r(qkv_rows, scale=0.1)
        t["self_attention.dense.bias"] = r(h, scale=0.1)
        t["mlp.dense_h_to_4h.bias"] = r(ffn_rows, scale=0.1)
        t["mlp.dense_4h_to_h.bias"] = r(h, scale=0.1)
    return {prefix + k: v for k, v in t.items()}


def full_model(spec: Spec, tp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The unsharded tensors, Megatron names (``language_model.`` dropped), global layer
    numbers 0..L-1, vocabulary padded for ``tp`` ranks."""
    g = torch.Generator().manual_seed(seed)
    h, v = spec.hidden_size, spec.padded_vocab(tp)
    t = {"embedding.word_embeddings.weight": torch.randn(v, h, generator=g)}
    if spec.position_embedding_type == "learned_absolute":
        t["embedding.position_embeddings.weight"] = torch.randn(
            spec.max_position_embeddings, h, generator=g) * 0.3
    for i in range(spec.num_layers):
        t.update(_layer(spec, g, f"encoder.layers.{i}."))
        if i + 1 in spec.exit_layer_nums:
            if spec.use_exit_norm:
                t[f"encoder.layers.{i}.exit_norm.weight"] = 1 + torch.randn(h, generator=g) * 0.1
                if spec.normalization == "LayerNorm":
                    t[f"encoder.layers.{i}.exit_norm.bias"] = torch.randn(h, generator=g) * 0.1
            if spec.use_exit_block:
                t.update(_layer(spec, g, f"encoder.layers.{i}.exit_block."))
    t["encoder.final_norm.weight"] = 1 + torch.randn(h, generator=g) * 0.1
    if spec.normalization == "LayerNorm":
        t["encoder.final_norm.bias"] = torch.randn(h, generator=g) * 0.1
    if spec.untie_embeddings_and_output_weights:
        t["output_layer.weight"] = torch.randn(v, h, generator=g) * 0.3
    if spec.untie_exit_output_weights:
        for j, _ in enumerate(sorted(spec.exit_layer_nums)):
            t[f"exit_output_layer.{j}.weight"] = torch.randn(v, h, generator=g) * 0.3
    return t


# ----- tensor-parallel split (megatron/core/tensor_parallel/layers.py) --------------------------

def _tp_part(name: str, full: torch.Tensor, spec: Spec, tp: int, rank: int) -> torch.Tensor:
    module, param = name.rsplit(".", 2)[-2:]
    if module == "dense_h_to_4h" and spec.swiglu:  # each rank: [gate_rank; up_rank]
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp)[rank], up.chunk(tp)[rank])).clone()
    column = module in ("query_key_value", "dense_h_to_4h", "word_embeddings", "output_layer") \
        or name.startswith("exit_output_layer.")
    if column:
        return full.chunk(tp, dim=0)[rank].clone()
    if module in ("dense", "dense_4h_to_h") and param == "weight":
        return full.chunk(tp, dim=1)[rank].clone()
    return full.clone()


def write_checkpoint(root: Path, spec: Spec, full: dict[str, torch.Tensor], tp: int, pp: int,
                     iteration: int = 100) -> Path:
    """Save ``full`` as Megatron's ``save_checkpoint`` would with ``tp`` x ``pp`` ranks."""
    lp = spec.num_layers // pp
    args = argparse.Namespace(
        **{k: getattr(spec, k) for k in spec.__dataclass_fields__ if k != "vocab_size"},
        vocab_size=spec.vocab_size, padded_vocab_size=spec.padded_vocab(tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        group_query_attention=spec.num_query_groups is not None,
        kv_channels=spec.hidden_size // spec.num_attention_heads, seq_length=16,
        params_dtype=torch.float32, exit_layer_weight=[1.0] * len(spec.exit_layer_nums),
        exit_layer_temperature=[1.0] * len(spec.exit_layer_nums), use_exit_mlp=False,
        rotary_percent=1.0, transformer_impl="local", num_experts=None, bias_gelu_fusion=True,
        openai_gelu=False, apply_residual_connection_post_layernorm=False,
    )
    if args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron's default when --group-query-attention is off
    iter_dir = root / f"iter_{iteration:07d}"
    exits = sorted(spec.exit_layer_nums)
    for p in range(pp):
        stage_exits = [n for n in exits if p * lp < n <= (p + 1) * lp]
        for t in range(tp):
            lm: dict[str, dict[str, torch.Tensor]] = {}
            encoder: dict[str, torch.Tensor] = {}
            for name, tensor in full.items():
                part = _tp_part(name, tensor, spec, tp, t)
                if name.startswith("embedding.") and p == 0:
                    kind, _, leaf = name.removeprefix("embedding.").partition(".")
                    lm.setdefault("embedding", {}).setdefault(kind, {})[leaf] = part
                elif name.startswith("encoder.layers."):
                    i = int(name.split(".")[2])
                    if p * lp <= i < (p + 1) * lp:
                        rest = name.split(".", 3)[3]
                        encoder[f"layers.{i - p * lp}.{rest}"] = part
                elif name.startswith("encoder.final_norm") and p == pp - 1:
                    encoder[name.removeprefix("encoder.")] = part
                elif name == "output_layer.weight" and p == pp - 1:
                    lm["output_layer"] = {"weight": part}
                elif name.startswith("exit_output_layer."):
                    j = int(name.split(".")[1])
                    if exits[j] in stage_exits:
                        lm.setdefault("exit_output_layer", {})[
                            f"{stage_exits.index(exits[j])}.weight"] = part
            lm["encoder"] = encoder  # type: ignore[assignment]
            model: dict[str, object] = {"language_model": lm}
            tied_copy = not spec.untie_embeddings_and_output_weights and p > 0 and (
                p == pp - 1 or stage_exits)
            if tied_copy:  # MegatronModule.initialize_word_embeddings' second copy
                emb = _tp_part("embedding.word_embeddings.weight",
                               full["embedding.word_embeddings.weight"], spec, tp, t)
                model["word_embeddings_for_head"] = {"weight": emb}
            sub = f"mp_rank_{t:02d}_{p:03d}" if pp > 1 else f"mp_rank_{t:02d}"
            (iter_dir / sub).mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                        "model": model, "rng_state": [{"torch_rng_state": torch.get_rng_state()}]},
                       iter_dir / sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


# ----- Megatron's forward on the unsharded tensors -------------------------------------------

def _norm(spec: Spec, t: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    w = t[prefix + "weight"]
    if spec.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, t[prefix + "bias"], spec.norm_epsilon)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.norm_epsilon) * w


def _lin(t: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, t[prefix + "weight"], t.get(prefix + "bias"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _layer_forward(spec: Spec, t: dict[str, torch.Tensor], prefix: str, x: torch.Tensor
                   ) -> torch.Tensor:
    """ParallelTransformerLayer on ``x`` ``[s, b, h]`` (TP=1)."""
    s, b, _ = x.shape
    heads = spec.num_attention_heads
    hd = spec.hidden_size // heads
    groups = spec.num_query_groups or heads
    per = heads // groups
    ln = _norm(spec, t, prefix + "input_norm.", x)
    mixed = _lin(t, prefix + "self_attention.query_key_value.", ln)
    mixed = mixed.view(s, b, groups, (per + 2) * hd)  # [sq, b, ng, (np/ng + 2) * hn]
    q, k, v = torch.split(mixed, [per * hd, hd, hd], dim=3)
    q = q.reshape(s, b, heads, hd)
    k = k.repeat_interleave(per, dim=2)
    v = v.repeat_interleave(per, dim=2)
    if spec.position_embedding_type == "rope":
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(s).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        q = q * emb.cos() + _rotate_half(q) * emb.sin()
        k = k * emb.cos() + _rotate_half(k) * emb.sin()
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hd)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, heads * hd)
    x = x + _lin(t, prefix + "self_attention.dense.", ctx)
    ln2 = _norm(spec, t, prefix + "post_attention_norm.", x)
    inter = _lin(t, prefix + "mlp.dense_h_to_4h.", ln2)
    if spec.swiglu:
        a, c = torch.chunk(inter, 2, dim=-1)
        inter = F.silu(a) * c
    elif spec.add_bias_linear:  # bias_gelu_fusion: the tanh approximation
        x3 = 0.79788456 * inter * (1 + 0.044715 * inter * inter)
        inter = inter * 0.5 * (1.0 + torch.tanh(x3))
    else:
        inter = F.gelu(inter)
    return x + _lin(t, prefix + "mlp.dense_4h_to_h.", inter)


def reference_logits(spec: Spec, t: dict[str, torch.Tensor], tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Final logits ``(B, T, vocab)`` and each exit's logits keyed by the exitlm layer it
    reads (``n - 1`` for an exit on Megatron layer ``n`` with ``--pre-exit``), true vocab."""
    emb = t["embedding.word_embeddings.weight"]
    x = F.embedding(tokens, emb)
    if spec.position_embedding_type == "learned_absolute":
        x = x + t["embedding.position_embeddings.weight"][: tokens.shape[1]]
    x = x.transpose(0, 1)  # [s, b, h]
    exits: dict[int, torch.Tensor] = {}
    order = sorted(spec.exit_layer_nums)

    def exit_out(n: int, h: torch.Tensor) -> torch.Tensor:
        pre = f"encoder.layers.{n - 1}."
        if spec.use_exit_block:
            h = _layer_forward(spec, t, pre + "exit_block.", h)
        if spec.use_exit_norm:
            h = _norm(spec, t, pre + "exit_norm.", h)
        w = t[f"exit_output_layer.{order.index(n)}.weight"] if spec.untie_exit_output_weights \
            else emb
        return F.linear(h, w).transpose(0, 1)[..., : spec.vocab_size]

    for i in range(spec.num_layers):
        n = i + 1
        if n in order and spec.pre_exit:
            exits[n - 1] = exit_out(n, x)
        x = _layer_forward(spec, t, f"encoder.layers.{i}.", x)
        if n in order and not spec.pre_exit:
            exits[n] = exit_out(n, x)
    x = _norm(spec, t, "encoder.final_norm.", x)
    w = t["output_layer.weight"] if spec.untie_embeddings_and_output_weights else emb
    return F.linear(x, w).transpose(0, 1)[..., : spec.vocab_size], exits
