"""A pipeline stage inside a training step: build, run, synchronise, clip.

:class:`PipelineEngine` owns what is specific to pipeline (and DP x PP x TP) training around
the executor:

* cutting the model into this process's stage (:mod:`.stage`), sharding the stage over its
  tensor-parallel group (:mod:`exitlm.train.parallel.tensor`) and building the schedule;
* after the actions ran: summing the gradients of parameters replicated on several stages
  (tied embeddings, shared final norm / head; EE-LLM Sec. 3.1.2: compute as if untied,
  then all-reduce) shard by shard, then averaging over data-parallel replicas;
* the global gradient norm for clipping (each parameter and shard counted once).

Every tensor keeps the whole model's parameter name, so the union of the stages' (gathered)
state dicts *is* the single-process state dict (:mod:`exitlm.train.parallel.layout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from exitlm.comm.p2p import P2P
from exitlm.config import ConfigError
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.schedule import build_schedule
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.grads import average_gradients, clip_gradients
from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.pipeline.executor import Microbatch, StageExecutor, StepStats
from exitlm.train.parallel.pipeline.stage import (
    build_stages,
    prune_to_stage,
    shared_parameter_users,
)
from exitlm.train.parallel.tensor import TensorParallel, apply_tensor_parallel, local


class PipelineEngine:
    """This process's stage (and tensor-parallel shard) of a ``dp x pp x tp`` model.

    ``model`` is pruned in place to the stage (:func:`~.stage.prune_to_stage`), then sharded
    when ``dims.tp > 1``. ``slices`` are the resolved token-slice lengths
    (``pcfg.token_slices`` turned into lengths by the caller, which may have run the
    TeraPipe planner for ``auto``). ``groups`` defaults to new groups of ``dims``.
    """

    def __init__(
        self,
        model: EarlyExitLM,
        pcfg: ParallelConfig,
        dims: ParallelDims,
        *,
        microbatches: int,
        slices: Sequence[int],
        device: torch.device,
        ignore_index: int = -100,
        measure_memory: bool = False,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.pcfg = pcfg
        self.dims = dims
        self.model = model
        cfg = model.config
        self.specs = build_stages(model, dims.pp, pcfg.boundaries, pcfg.exit_placement)
        self.spec = self.specs[dims.stage]
        if len(slices) > 1 and pcfg.deferred_exits and cfg.exits.head == "block" \
                and cfg.exits.layers:
            raise ConfigError("exit heads of type 'block' attend over earlier token slices, so "
                              "their forward cannot be deferred to the (reverse-order) "
                              "backward: set parallel.deferred_exits=false or "
                              "parallel.token_slices=1")
        seq_shards = dims.tp if pcfg.sequence_parallel and dims.tp > 1 else 1
        if any(n % seq_shards for n in slices):
            raise ConfigError(f"parallel.sequence_parallel shards every token slice over "
                              f"parallel.tp={dims.tp} ranks, but the slices are {list(slices)}; "
                              "make data.seq_len / parallel.token_slices divisible by tp, or "
                              "set parallel.sequence_parallel=false")
        self.all_names = set(model.state_dict())
        self.shared = shared_parameter_users(model, self.specs)
        if pcfg.bubble_fill != "none" and self.shared:
            raise ConfigError(
                "parallel.bubble_fill needs every parameter on one stage (EE-LLM App. C.2.1: "
                "partial passes over tied weights may hurt training), but "
                f"{sorted(self.shared)} are shared across stages; untie them "
                "(model.overrides.tie_embeddings=false, model.exits.output=own, "
                "model.exits.norm=own) or set parallel.bubble_fill=none")
        self.owned = prune_to_stage(model, self.spec)
        self._own_groups = groups is None
        self.groups = groups if groups is not None else ProcessGroups.for_dims(
            dims, device, pcfg.timeout_s)
        self.tp: TensorParallel | None = None
        if dims.tp > 1:
            self.tp = apply_tensor_parallel(model, self.groups.tp_mesh,
                                            sequence_parallel=pcfg.sequence_parallel)
        exit_stages = [s.index for s in self.specs if s.exits]
        self.schedule = build_schedule(
            pcfg.schedule, dims.pp, microbatches, tuple(slices), fill=pcfg.bubble_fill,
            exit_stages=exit_stages, backward_forward_ratio=pcfg.backward_forward_ratio,
            fill_microbatches=pcfg.fill_microbatches,
        )
        self.microbatches = microbatches
        self.p2p = P2P(pcfg.timeout_s, device)
        self.executor = StageExecutor(
            model, self.spec, self.schedule, self.p2p, dims.pipeline_ranks(),
            deferred_exits=pcfg.deferred_exits, ignore_index=ignore_index,
            measure_memory=measure_memory, seq_shards=seq_shards,
        )
        self.tied_groups: dict[tuple[int, ...], Any] = {}
        if dist.is_initialized():
            self._make_groups()

    def _make_groups(self) -> None:
        """One group per set of stages sharing a parameter, per replica and shard."""
        d = self.dims
        for users in sorted({tuple(u) for u in self.shared.values()}):
            for r in range(d.dp):
                for t in range(d.tp):
                    grp = self.groups.new_group([d.rank_of(s, r, t) for s in users])
                    if (r, t) == (d.replica, d.tp_rank) and d.stage in users:
                        self.tied_groups[users] = grp

    def close(self) -> None:
        """Destroy the process groups this engine created (when building several engines
        in one process, e.g. benchmarks)."""
        for grp in self.tied_groups.values():
            if grp is not None:
                dist.destroy_process_group(grp)
        self.tied_groups = {}
        if self._own_groups:
            self.groups.close()

    # ----- parameters -------------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This stage's parameters (whole-model names), trainable or not."""
        return [(n, p) for n, p in self.model.named_parameters() if n in self.owned]

    @property
    def num_extra_microbatches(self) -> int:
        return self.schedule.num_microbatches - self.microbatches

    # ----- a step -------------------------------------------------------------------------------
    def run(self, batches: Sequence[Microbatch], weights: Mapping[int, float]) -> StepStats:
        """Forward/backward of every microbatch of this step (gradients accumulate into
        ``.grad``, each microbatch's loss scaled by 1 / regular microbatches), then the
        gradient synchronisation."""
        ctx = self.tp.loss_context() if self.tp is not None else contextlib.nullcontext()
        with ctx:
            stats = self.executor.run_step(batches, weights, 1.0 / self.microbatches)
        self.sync_grads()
        return stats

    def sync_grads(self) -> None:
        """Sum replicated parameters' gradients over their stages (each shard with the same
        shard of the other stages), then average over DP."""
        params = dict(self.named_parameters())
        for name, users in sorted(self.shared.items()):  # same order on every rank
            p = params.get(name)
            if p is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grp = self.tied_groups.get(tuple(users))
            if grp is not None:
                dist.all_reduce(local(p.grad), group=grp)
        if self.dims.dp > 1:
            average_gradients([p for _, p in sorted(params.items())], self.groups.dp,
                              self.dims.dp)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so the whole model's L2 norm is at most ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``, replicated parameters and shards counted once).
        Returns the norm before clipping."""
        counted = []
        for name, p in self.named_parameters():
            users = self.shared.get(name)
            if users is None or users[0] == self.dims.stage:
                counted.append(p)
        return clip_gradients(self.named_parameters(), counted, max_norm, self.groups, self.tp)

    def reduce_exit_losses(self, stats: StepStats, layers: Sequence[int]) -> dict[int, float]:
        """Mean per-exit cross-entropy over regular microbatches and DP replicas (every
        shard of a stage computes the same losses)."""
        layers = sorted(layers)
        vals = torch.tensor([stats.exit_ce.get(k, 0.0) for k in layers], dtype=torch.float64)
        vals = self.groups.all_reduce(vals) / (self.dims.dp * self.dims.tp)
        return {k: float(v) / self.microbatches for k, v in zip(layers, vals, strict=True)}
