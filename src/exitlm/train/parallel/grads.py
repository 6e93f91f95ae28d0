"""Gradient synchronisation and clipping shared by every layout of :mod:`exitlm.train.parallel`.

Gradients may be DTensors (tensor parallelism); both functions work on each process's local
shard, so the data-parallel all-reduce moves shards, never whole tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.tensor import TensorParallel, local


def average_gradients(params: Sequence[torch.nn.Parameter], group: Any, replicas: int) -> None:
    """Average the (local shards of the) gradients of trainable ``params`` over the
    data-parallel ``group`` in one flat all-reduce; missing gradients count as zeros."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))
    if not grads or group is None:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n


def clip_gradients(params: Sequence[tuple[str, torch.nn.Parameter]],
                   counted: Sequence[torch.nn.Parameter], max_norm: float,
                   groups: ProcessGroups, tp: TensorParallel | None) -> float:
    """The L2 norm of the whole model's gradient over every process - ``counted`` are this
    process's parameters no other stage counts; of a tensor-parallel copy only one shard
    counts - and gradients of ``params`` scaled to ``max_norm`` when above it. Replicas
    hold equal gradients (after averaging), so the sum over all processes is divided by dp."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in counted:
        if p.grad is None or (tp is not None and not tp.counted_once(p.grad)):
            continue
        sq += local(p.grad).detach().double().pow(2).sum().cpu()
    sq = groups.all_reduce(sq) / groups.dims.dp
    norm = float(sq.sqrt())
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for _, p in params:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
    return norm
