"""Tensor-parallel decoding: Megatron-LM's layout (EE-LLM Sec. 3.1, "tensor parallelism ...
directly applicable") on plain tensors with explicit gloo collectives.

:func:`shard_model` turns a normally loaded model into rank ``r``'s shard of ``T``:

* attention: the fused ``wqkv`` keeps rank ``r``'s ``Hkv/T`` key/value heads and their query
  heads (contiguous blocks, so every query head's GQA group stays on its rank), and its
  cache holds only those key/value heads; ``wo`` keeps the matching input columns and
  all-reduces its output (its bias is added once, after the sum). ``T`` need not divide the
  heads (Megatron-LM asks it to): SmolLM2-135M's 3 key/value heads go 1 + 2 over 2 ranks
  (:func:`split`), any ``T`` up to ``Hkv`` works;
* MLP: the fused gate/up ``w_in`` keeps rank ``r``'s rows of each half, ``w_out`` the matching
  columns with an all-reduce;
* exit heads like layers (an MLP head like an MLP, a block head like a block);
* every output embedding (the LM head, an exit's own matrix, the tied input embedding) is
  vocabulary-parallel: each rank multiplies its ``ceil(V/T)`` rows and the logits are
  all-gathered, so confidence checks and token choice see the full vocabulary on every rank
  (as EE-LLM gathers logits for its exits at inference);
* norms, embeddings and the residual stream are replicated;
* int8/int4 weights (:mod:`exitlm.kernels.quantized`, groups of 32 along the input) are split
  as they are, never quantized again: output rows are rows of ``q``, ``scales`` and ``mins``;
  input columns can only be cut between groups, so the MLP width is split in whole groups and
  a head split that would cut a group is refused (:func:`check_quantized`). A shard then holds
  exactly its slices of the one-process weights and computes their partial products on the
  same quantized kernels (the native block included). Caveat: the native blocks' int8
  activations (on by default, :func:`~exitlm.kernels.native.int8_activations`) round every
  product input to a step of ``absmax / 127``, so the last-bit difference of a two-part sum
  (below) can cross a rounding step and move logits by ~1e-3 relative: greedy tokens then
  part at near-ties (``default-ee`` int8, TP=2: at token 25 of 64, where one process's top
  two logits lie 0.03 apart). With ``EXITLM_INT8_ACTIVATIONS=0`` they are one process's.

The ordinary decoders (autoregressive, early exit with KV recomputation, self-speculative)
then run unchanged on every rank with identical inputs: the collectives give every rank the
same bits, so every rank takes the same exit decisions and, with the same seed, samples the
same tokens. Against one process the only difference is fp32 summation order (a sum of ``T``
partial products instead of one product), ~1e-6 relative: greedy tokens are identical unless
two logits (or a confidence and its threshold) lie that close.

The sums and gathers of ranks on one machine go through shared memory
(:mod:`exitlm.comm.native_reduce`, ``reduce.c``; rank-order sums, so still the same bits
on every rank): a few microseconds where gloo took ~1 ms each, which made tensor-parallel
decoding tens of times slower than one process. With the native kernels a shard's block is
still one native call that runs both sums itself. Ranks on several machines use gloo.

The processes and their engines are :class:`~exitlm.infer.executors.tp.TPExecutor`'s.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exitlm.comm.launch import DEFAULT_TIMEOUT_S
from exitlm.comm.native_reduce import ShmReducer
from exitlm.comm.shm import shm_reducer
from exitlm.config import ConfigError, ModelConfig
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.kernels.layout import pack
from exitlm.kernels.linear import linear
from exitlm.kernels.quant import GROUP, QuantizedWeight
from exitlm.kernels.quantized import QuantizedLinear, cat_rows
from exitlm.model.layers import MLP, Attention, Block
from exitlm.model.transformer import EarlyExitLM, OutputLayout
from exitlm.plan.sharding import attention_shard, check_whole_heads, mlp_shard, share, vocab_rows

TP_STRATEGIES = ("ar", "early-exit", "self-spec")


class RowParallelLinear(nn.Linear):
    """Rank ``r``'s input columns of a linear layer; the outputs are summed over the group
    (the bias, kept whole, is added once after the sum). Its product runs on the CPU
    kernels (:func:`~exitlm.kernels.linear.linear`, with a oneDNN-packed copy of a bf16
    weight); the sum goes through the shared-memory reducer of the group's ranks when they
    have one (``native_reducer``, which the native block then calls itself), else through
    gloo."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                 reducer: ShmReducer | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.pack = pack(self.weight)
        self.full_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.native_reducer = reducer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _sum_over_group(linear(x, self.weight, None, self.pack).contiguous(),
                            self.native_reducer, self.group)
        return y if self.full_bias is None else y + self.full_bias


class QuantizedRowParallelLinear(QuantizedLinear):
    """:class:`RowParallelLinear` of an int8/int4 layer: rank ``r``'s whole groups of input
    columns (:meth:`~exitlm.kernels.quant.QuantizedWeight.columns`), multiplied on the
    quantized kernels (:func:`~exitlm.kernels.quant.qlinear`, as
    :class:`~exitlm.kernels.quantized.QuantizedLinear` does) and summed over the group like
    the float layer. It holds the weight as the same ``q`` / ``scales`` / ``mins`` buffers,
    so the native block (``block.c``) takes it and runs the sum itself."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, group: Any,
                 reducer: ShmReducer | None = None) -> None:
        super().__init__(weight)
        self.full_bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                                requires_grad=False)
        self.group = group
        self.native_reducer = reducer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _sum_over_group(super().forward(x).contiguous(), self.native_reducer, self.group)
        return y if self.full_bias is None else y + self.full_bias


def _sum_over_group(y: torch.Tensor, reducer: ShmReducer | None, group: Any) -> torch.Tensor:
    """``y`` summed in place over the ranks of ``group``: through the shared-memory reducer
    when the ranks have one (CPU tensors; fp16/bf16 partial sums are added in fp32 and
    rounded once), else gloo's all-reduce."""
    if reducer is not None and y.is_cpu and y.dtype in _SHM_DTYPES:
        if y.dtype == torch.float32:
            reducer.sum_(y)
        else:
            y.copy_(reducer.sum_(y.float()))
    else:
        dist.all_reduce(y, group=group)
    return y


def _gather_over_group(local: torch.Tensor, tp: int, reducer: ShmReducer | None,
                       group: Any) -> list[torch.Tensor]:
    """Every rank's ``local`` in rank order (fp16/bf16 travel as fp32: exact)."""
    if reducer is not None and local.is_cpu and local.dtype in _SHM_DTYPES:
        return [t.to(local.dtype) for t in reducer.gather(local.float()).unbind(0)]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=group)
    return parts


_SHM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows(t: torch.Tensor | None, blocks: list[tuple[int, int]]) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.cat([t.detach()[a:b] for a, b in blocks]).contiguous()


def _column_split(lin: nn.Linear | QuantizedLinear, blocks: list[tuple[int, int]]) -> None:
    """Keep the output rows ``blocks`` of ``lin`` (a column-parallel layer); a quantized
    layer keeps those rows of ``q``, ``scales`` and ``mins`` (every row is quantized on its
    own, so any rows can be cut)."""
    if isinstance(lin, QuantizedLinear):
        w = lin.weight
        lin.hold(cat_rows([w[a:b] for a, b in blocks]))  # type: ignore[arg-type]
    else:
        lin.weight = nn.Parameter(_rows(lin.weight, blocks), requires_grad=False)  # type: ignore[arg-type]
        lin.out_features = lin.weight.shape[0]
    if lin.bias is not None:
        lin.bias = nn.Parameter(_rows(lin.bias, blocks), requires_grad=False)  # type: ignore[arg-type]


def _row_split(lin: nn.Linear | QuantizedLinear, a: int, b: int, group: Any,
               reducer: ShmReducer | None) -> RowParallelLinear | QuantizedRowParallelLinear:
    """Input columns ``[a, b)`` of ``lin`` (a row-parallel layer); those of a quantized layer
    must cut whole groups of 32 (:func:`check_quantized` makes sure before sharding)."""
    bias = None if lin.bias is None else lin.bias.detach().clone()
    if isinstance(lin, QuantizedLinear):
        return QuantizedRowParallelLinear(lin.weight.columns(a, b), bias, group, reducer)
    w = lin.weight.detach()[:, a:b].contiguous()
    return RowParallelLinear(w, bias, group, reducer)


def _shard_attention(attn: Attention, rank: int, tp: int, group: Any,
                     reducer: ShmReducer | None) -> None:
    """The plan's rows of ``wqkv`` and columns of ``wo`` (:func:`~exitlm.plan.sharding.
    attention_shard`): this rank's key/value heads and their query groups."""
    s = attention_shard(attn.num_heads, attn.num_kv_heads, attn.head_dim, rank, tp)
    _column_split(attn.wqkv, s.rows)
    attn.wo = _row_split(attn.wo, s.q[0], s.q[1], group, reducer)
    attn.num_heads, attn.num_kv_heads = s.heads, s.kv_heads


def _shard_mlp(mlp: MLP, rank: int, tp: int, group: Any, reducer: ShmReducer | None) -> None:
    """The plan's rows of ``w_in`` and columns of ``w_out`` (:func:`~exitlm.plan.sharding.
    mlp_shard`; whole groups of 32 of a quantized ``w_out``'s input)."""
    grouped = isinstance(mlp.w_out, QuantizedLinear)
    s = mlp_shard(mlp.hidden, rank, tp, gated=mlp.gated, group=GROUP if grouped else 1)
    _column_split(mlp.w_in, s.rows)
    mlp.w_out = _row_split(mlp.w_out, s.own[0], s.own[1], group, reducer)
    mlp.hidden = s.hidden


class VocabParallel(OutputLayout):
    """The output products of rank ``rank``'s shard: its rows of every output embedding, the
    logits all-gathered (a vocabulary not divisible by ``tp`` is padded with zero rows). A
    quantized output embedding keeps its rows of ``q``, ``scales`` and ``mins`` and multiplies
    on the quantized kernels, as one process's output product does; every logit is then
    computed exactly as there. ``reducer``: the ranks' shared-memory collectives (aborted
    when a rank fails, so the others fail at once)."""

    def __init__(self, rank: int, tp: int, group: Any, reducer: ShmReducer | None) -> None:
        self.rank, self.tp, self.group, self.reducer = rank, tp, group, reducer
        self.shards: dict[int, tuple[weakref.ref[torch.Tensor],
                                     torch.Tensor | QuantizedWeight]] = {}

    def project(self, h: torch.Tensor, weight: torch.Tensor | QuantizedWeight  # type: ignore[override]
                ) -> torch.Tensor:
        rank, tp, shards = self.rank, self.tp, self.shards
        vocab = weight.shape[0]
        # a quantized module builds a new QuantizedWeight on every access: key on its q
        key = weight.q if isinstance(weight, QuantizedWeight) else weight
        entry = shards.get(id(key))
        if entry is None or entry[0]() is not key:
            a, b, n = vocab_rows(vocab, rank, tp)
            part: torch.Tensor | QuantizedWeight
            if isinstance(weight, QuantizedWeight):
                part = weight[a:b].padded(n)
            else:
                part = weight.detach()[a:b]
                if part.shape[0] < n:
                    part = torch.cat([part, part.new_zeros(n - part.shape[0], part.shape[1])])
                part = part.contiguous()
            entry = (weakref.ref(key), part)
            shards[id(key)] = entry
        w = entry[1]
        local = (w.linear(h) if isinstance(w, QuantizedWeight)
                 else linear(h, w)).contiguous()  # (..., ceil(V/T))
        parts = _gather_over_group(local, tp, self.reducer, self.group)
        return torch.cat(parts, dim=-1)[..., :vocab]


def check_quantized(model: nn.Module, tp: int) -> None:
    """Raise a one-line :class:`ConfigError` naming ``--tp`` where ``tp`` ranks cannot split
    a quantized row-parallel layer as it is: a rank's input columns of the attention output
    (its query heads' columns) must start on a group boundary (multiples of 32), and the MLP
    width, split in whole groups, must give every rank at least one. SmolLM2's 64-wide heads
    always fall on boundaries. Re-quantizing the cut groups would change the weights, and with
    them the tokens, against one process."""
    if tp < 2:
        return
    for name, mod in model.named_modules():
        if isinstance(mod, Attention) and isinstance(mod.wo, QuantizedLinear):
            group = (mod.num_heads // mod.num_kv_heads) * mod.head_dim  # columns per kv head
            cuts = [share(mod.num_kv_heads, r, tp)[0] * group for r in range(1, tp)]
            bad = next((c for c in cuts if c % GROUP), None)
            if bad is not None:
                raise ConfigError(
                    f"--tp {tp}: {name}.wo is quantized in groups of {GROUP} along its input "
                    f"width {mod.wo.in_features} ({mod.num_heads} heads x {mod.head_dim}), "
                    f"which {tp} ranks would cut at column {bad}; choose another --tp or "
                    "load the model with --dtype float32")
        if isinstance(mod, MLP) and isinstance(mod.w_out, QuantizedLinear) and (
                mod.hidden // GROUP < tp):
            raise ConfigError(
                f"--tp {tp}: {name}.w_out is quantized in groups of {GROUP} along its input "
                f"width {mod.hidden}, {mod.hidden // GROUP} group(s) for {tp} ranks; choose "
                f"--tp {max(1, mod.hidden // GROUP)} or less or load the model with --dtype "
                "float32")


def shard_model(model: EarlyExitLM, rank: int, tp: int, group: Any = None, *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> EarlyExitLM:
    """A copy of ``model`` holding rank ``rank``'s tensor-parallel shard of ``tp`` (see the
    module docstring); ``model`` itself is left as it is (unsharded tensors are shared).

    Every rank of the group calls it (it is collective when ``tp > 1``): with every rank on
    this machine the sums and gathers go through shared memory
    (:func:`~exitlm.comm.shm.shm_reducer`; ``EXITLM_SHM=0`` turns it off),
    else through gloo."""
    check_whole_heads(model.config, tp)
    return _shard(rebuild_model(model.config, model_tensors(model), "tensor-parallel shard"),
                  rank, tp, group, timeout_s)


def rank_shard(cfg: ModelConfig, tensors: dict[str, torch.Tensor], rank: int, tp: int,
               timeout_s: float) -> EarlyExitLM:
    """:func:`shard_model` in a spawned rank, from the model's
    :func:`~exitlm.io.materialize.model_tensors` (rebuilt once, then sharded in place)."""
    return _shard(rebuild_model(cfg, tensors, f"tensor-parallel rank {rank}"), rank, tp, None,
                  timeout_s)


def _shard(shard: EarlyExitLM, rank: int, tp: int, group: Any,
           timeout_s: float) -> EarlyExitLM:
    """Turn ``shard`` (a private copy) into rank ``rank``'s shard, in place."""
    shard.eval().requires_grad_(False)
    if tp == 1:
        return shard
    check_quantized(shard, tp)
    reducer = shm_reducer(rank, tp, group, timeout_s=timeout_s)
    for mod in shard.modules():
        if isinstance(mod, Block):
            _shard_attention(mod.attn, rank, tp, group, reducer)
        if isinstance(mod, MLP):
            _shard_mlp(mod, rank, tp, group, reducer)
    shard.set_output_layout(VocabParallel(rank, tp, group, reducer))
    return shard


def broadcast_weights(model: EarlyExitLM, group: Any = None) -> None:
    """Give every rank rank 0's parameters and buffers (a preset's random weights differ
    per process; checkpoints are equal anyway, and this checks nothing else)."""
    for t in model_tensors(model).values():
        dist.broadcast(t, src=0, group=group)


def check_strategy(strategy: str, options: dict[str, Any]) -> None:
    """``--tp`` decodes with ``ar``, ``early-exit`` (KV recomputation) and ``self-spec``."""
    if strategy not in TP_STRATEGIES:
        raise ConfigError(f"--tp runs --strategy {' / '.join(TP_STRATEGIES)}, not {strategy}")
    if options.get("kv", "recompute") != "recompute":
        raise ConfigError(f"--tp decodes early exits with --kv recompute, not --kv "
                          f"{options['kv']}")
