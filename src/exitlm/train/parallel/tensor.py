"""Tensor parallelism on a built model with ``torch.distributed.tensor`` (DTensor).

Megatron-LM's layout, which EE-LLM trains under (EE-LLM Sec. 3.1: "existing functionalities
... for data and tensor/sequence parallelism are directly applicable"), applied to an
:class:`~exitlm.model.transformer.EarlyExitLM` after it is built (the model never imports
``torch.distributed``):

* attention: the fused ``wqkv`` projection column-wise, each rank holding ``H / T`` query
  heads and ``Hkv / T`` key/value heads (GQA groups stay whole), ``wo`` row-wise;
* MLP: the fused gate/up projection ``w_in`` column-wise, ``w_out`` row-wise;
* the token (and learned position) embedding vocabulary-parallel: rows of ``(V, D)``
  sharded, each rank looks up its own vocabulary range;
* every output embedding - the LM head, an exit's own matrix, or the input embedding when
  tied - sharded by vocabulary rows (EE-LLM Sec. 2: each exit holds an ``h x V`` matrix), so
  logits are ``Shard(-1)`` DTensors and exit losses run under ``loss_parallel``, which never
  gathers full-vocabulary logits;
* exit heads sharded like layers: an MLP head like a layer's MLP, a block head like a layer;
* optionally sequence parallelism (Korthikanti et al. 2022): norms and residual stream are
  sharded along the sequence, all-gathered before attention / MLP, reduce-scattered after.

Which rows and columns each rank holds is the sharding plan decoding follows too
(:mod:`exitlm.plan.sharding`). A column-wise split of a *fused* weight must give rank ``r`` its
part of each section (its query, key and value heads; its gate and up rows). Before sharding,
the rows of such a weight are permuted to rank-major order
``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, and the attention / MLP
modules are told their local head count and width (plain attributes they already have). The
permutation is undone when tensors leave the layout (:meth:`TensorParallel.full`), so
checkpoints hold the ordinary model's tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from exitlm.model.layers import MLP, Attention, Block, Norm
from exitlm.model.transformer import EarlyExitLM, OutputLayout
from exitlm.plan.sharding import attention_shard, check_even, mlp_shard, rank_major_order


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place changes reach the DTensor), or
    ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class TensorParallel(OutputLayout):
    """The tensor-parallel form of one model (or pipeline stage) on a 1-D ``tp`` mesh; as
    the model's :attr:`~exitlm.model.transformer.EarlyExitLM.output_layout` it computes the
    vocabulary-parallel logits (:meth:`project`)."""

    mesh: DeviceMesh
    sequence_parallel: bool
    permutations: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> row order (:func:`~exitlm.plan.sharding.rank_major_order`) of fused,
    permuted weights."""

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    # ----- tensors in and out -----------------------------------------------------------
    def full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``name`` (a parameter or an optimizer state of one) in the
        ordinary model's layout, on the CPU. Collective over the ``tp`` group for DTensors:
        every rank of it calls this for the same names in the same order."""
        if isinstance(t, DTensor):
            t = t.full_tensor()
        t = t.detach()
        perm = self.permutations.get(name)
        if perm is not None and t.dim() > 0:
            t = t[torch.argsort(perm).to(t.device)]
        return t.cpu()

    def shard_like(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``full`` (ordinary layout) as this rank holds parameter ``like``: the same
        placements (no communication: every rank has ``full``)."""
        if not isinstance(like, DTensor):
            return full
        perm = self.permutations.get(name)
        if perm is not None:
            full = full[perm.to(full.device)]
        return distribute_tensor(full.to(like.device, like.dtype), self.mesh,
                                 like.placements, src_data_rank=None)

    def loss_context(self) -> contextlib.AbstractContextManager[None]:
        """``loss_parallel``: cross-entropy on vocabulary-sharded logits, forward and
        backward (both must run inside it)."""
        return loss_parallel()

    def counted_once(self, t: torch.Tensor) -> bool:
        """Whether this rank's part of ``t`` is unique to it (a shard) rather than a copy
        every rank of the group holds (for norms of gradients)."""
        if isinstance(t, DTensor) and any(p.is_shard() for p in t.placements):
            return True
        return self.rank == 0

    # ----- the output projection ----------------------------------------------------------
    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel logits ``h @ weight.T``: ``h`` whole on every rank (gathered
        along the sequence under sequence parallelism), ``weight`` sharded by vocabulary
        rows; the result is a ``Shard(-1)`` DTensor (no full-vocabulary logits exist)."""
        if not isinstance(h, DTensor):
            seq = [Shard(1)] if self.sequence_parallel else [Replicate()]
            h = DTensor.from_local(h, self.mesh, seq, run_check=False)
        if h.placements != (Replicate(),):
            h = h.redistribute(self.mesh, [Replicate()])
        if not isinstance(weight, DTensor):
            weight = DTensor.from_local(weight, self.mesh, [Replicate()], run_check=False)
        return F.linear(h, weight)


def apply_tensor_parallel(model: EarlyExitLM, mesh: DeviceMesh, *,
                          sequence_parallel: bool = False) -> TensorParallel:
    """Shard ``model`` (whole, or a pruned pipeline stage) over ``mesh`` in place and route
    its logits through :meth:`TensorParallel.project`. Layers and shared tensors a stage
    does not hold (placeholders, emptied parameters) are left alone."""
    tp = mesh.size()
    check_even(model.config, tp)
    plan = TensorParallel(mesh, sequence_parallel)
    seq = Shard(1) if sequence_parallel else Replicate()
    for i, block in enumerate(model.layers):
        if isinstance(block, Block):
            _shard_block(block, f"layers.{i}", plan, seq)
    for key, head in model.exits.items():
        prefix = f"exits.{key}"
        if head.block is not None:
            _shard_block(head.block, f"{prefix}.block", plan, seq)
        if head.mlp is not None:
            assert head.mlp_norm is not None
            _shard_norm(head.mlp_norm, plan)
            _shard_mlp(head.mlp, f"{prefix}.mlp", plan, seq)
        if head.norm is not None:
            _shard_norm(head.norm, plan)
        if head.proj is not None:
            _shard_rows(head.proj, mesh)
    for emb in (model.embed_tokens, model.embed_positions):
        if emb is not None and emb.weight.numel() > 0:
            parallelize_module(emb, mesh, _local_data(RowwiseParallel(
                input_layouts=Replicate(), output_layouts=seq)))
    if model.norm.weight.numel() > 0:
        _shard_norm(model.norm, plan)
    if model.lm_head is not None and model.lm_head.weight.numel() > 0:
        _shard_rows(model.lm_head, mesh)
    model.set_output_layout(plan)
    return plan


def _shard_block(block: Block, prefix: str, plan: TensorParallel, seq: Any) -> None:
    _shard_norm(block.norm_attn, plan)
    _shard_norm(block.norm_mlp, plan)
    _shard_attention(block.attn, f"{prefix}.attn", plan, seq)
    _shard_mlp(block.mlp, f"{prefix}.mlp", plan, seq)


def _shard_attention(attn: Attention, prefix: str, plan: TensorParallel, seq: Any) -> None:
    tp = plan.size
    shards = [attention_shard(attn.num_heads, attn.num_kv_heads, attn.head_dim, r, tp)
              for r in range(tp)]
    _permute_rows(attn.wqkv, f"{prefix}.wqkv", rank_major_order([s.rows for s in shards]),
                  plan)
    # the local head counts the module reshapes its projections by (even: every rank's)
    attn.num_heads, attn.num_kv_heads = shards[0].heads, shards[0].kv_heads
    parallelize_module(attn, plan.mesh, {
        "wqkv": _local_data(ColwiseParallel()),
        "wo": _local_data(RowwiseParallel(output_layouts=seq)),
    })
    if plan.sequence_parallel:  # (x, rope, cache, slot, plan, mask): gather x's sequence
        parallelize_module(attn, plan.mesh, PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None, None),
            use_local_output=True))


def _shard_mlp(mlp: MLP, prefix: str, plan: TensorParallel, seq: Any) -> None:
    shards = [mlp_shard(mlp.hidden, r, plan.size, gated=mlp.gated) for r in range(plan.size)]
    if mlp.gated:
        _permute_rows(mlp.w_in, f"{prefix}.w_in", rank_major_order([s.rows for s in shards]),
                      plan)
    mlp.hidden = shards[0].hidden
    parallelize_module(mlp, plan.mesh, {
        "w_in": _local_data(ColwiseParallel()),
        "w_out": _local_data(RowwiseParallel(output_layouts=seq)),
    })
    if plan.sequence_parallel:
        parallelize_module(mlp, plan.mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_output=True))


def _shard_norm(norm: Norm, plan: TensorParallel) -> None:
    """Norms are replicated; under sequence parallelism they run on sequence shards and
    their parameters' gradients are summed over the group."""
    if plan.sequence_parallel:
        parallelize_module(norm, plan.mesh, _local_data(SequenceParallel()))


def _shard_rows(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """An output embedding used through :meth:`EarlyExitLM.project`: vocabulary rows."""
    linear.weight = nn.Parameter(
        distribute_tensor(linear.weight.detach(), mesh, [Shard(0)], src_data_rank=None),
        requires_grad=linear.weight.requires_grad)


def _permute_rows(linear: nn.Linear, name: str, perm: torch.Tensor,
                  plan: TensorParallel) -> None:
    """Put the rows of a fused weight (and bias) in rank-major order ``perm``, so that
    DTensor's even split gives every rank the plan's rows (undone by :meth:`TensorParallel.
    full`)."""
    with torch.no_grad():
        linear.weight.copy_(linear.weight[perm.to(linear.weight.device)])
        plan.permutations[f"{name}.weight"] = perm
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[perm.to(linear.bias.device)])
            plan.permutations[f"{name}.bias"] = perm


def _local_data(style: Any) -> Any:
    """``style`` sharding the tensors every rank already holds (identical models from the
    same seed or checkpoint) without a broadcast from rank 0."""
    style.src_data_rank = None
    return style
