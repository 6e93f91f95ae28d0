"""A pipeline stage inside a training step: build, run, synchronise, clip, gather state.

:class:`PipelineEngine` owns what is specific to pipeline (and DP x PP) training around the
executor:

* cutting the model into this process's stage (:mod:`.stage`) and building the schedule;
* after the actions ran: summing the gradients of parameters replicated on several stages
  (tied embeddings, shared final norm / head; EE-LLM Sec. 3.1.2: compute as if untied,
  then all-reduce), then averaging over data-parallel replicas;
* the global gradient norm for clipping (each parameter counted once);
* layout-independent state: every tensor keeps the whole model's parameter name, so the
  union of the stages' state dicts *is* the single-process state dict, and a checkpoint
  written with one ``pp`` loads with another.

Process groups are created here, in the same order on every rank (``new_group`` is
collective).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from exitlm.config import ConfigError
from exitlm.model.transformer import EarlyExitLM
from exitlm.parallel.dims import ParallelConfig, ProcessGrid
from exitlm.parallel.pipeline.executor import Microbatch, StageExecutor, StepStats
from exitlm.parallel.pipeline.p2p import P2P
from exitlm.parallel.pipeline.schedule import build_schedule
from exitlm.parallel.pipeline.stage import (
    build_stages,
    prune_to_stage,
    shared_parameter_users,
)


class PipelineEngine:
    """This process's stage of a ``dp x pp`` pipeline-parallel model.

    ``model`` is pruned in place to the stage (:func:`~.stage.prune_to_stage`). ``slices``
    are the resolved token-slice lengths (``pcfg.token_slices`` turned into lengths by the
    caller, which may have run the TeraPipe planner for ``auto``).
    """

    def __init__(
        self,
        model: EarlyExitLM,
        pcfg: ParallelConfig,
        grid: ProcessGrid,
        *,
        microbatches: int,
        slices: Sequence[int],
        device: torch.device,
        ignore_index: int = -100,
        measure_memory: bool = False,
    ) -> None:
        self.pcfg = pcfg
        self.grid = grid
        self.model = model
        cfg = model.config
        self.specs = build_stages(model, grid.pp, pcfg.boundaries, pcfg.exit_placement)
        self.spec = self.specs[grid.stage]
        if len(slices) > 1 and pcfg.deferred_exits and cfg.exits.head == "block" \
                and cfg.exits.layers:
            raise ConfigError("exit heads of type 'block' attend over earlier token slices, so "
                              "their forward cannot be deferred to the (reverse-order) "
                              "backward: set parallel.deferred_exits=false or "
                              "parallel.token_slices=1")
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
        exit_stages = [s.index for s in self.specs if s.exits]
        self.schedule = build_schedule(
            pcfg.schedule, grid.pp, microbatches, tuple(slices), fill=pcfg.bubble_fill,
            exit_stages=exit_stages, backward_forward_ratio=pcfg.backward_forward_ratio,
            fill_microbatches=pcfg.fill_microbatches,
        )
        self.microbatches = microbatches
        self.p2p = P2P(pcfg.timeout_s, device)
        self.executor = StageExecutor(
            model, self.spec, self.schedule, self.p2p, grid.pipeline_ranks(),
            deferred_exits=pcfg.deferred_exits, ignore_index=ignore_index,
            measure_memory=measure_memory,
        )
        self.pipe_group: Any = None
        self.dp_group: Any = None
        self.tied_groups: dict[tuple[int, ...], Any] = {}
        if dist.is_initialized():
            self._make_groups()

    def _make_groups(self) -> None:
        g = self.grid
        for r in range(g.dp):
            grp = dist.new_group(g.pipeline_ranks(r))
            if r == g.replica:
                self.pipe_group = grp
        for s in range(g.pp):
            grp = dist.new_group(g.dp_ranks(s))
            if s == g.stage:
                self.dp_group = grp
        for users in sorted({tuple(u) for u in self.shared.values()}):
            for r in range(g.dp):
                grp = dist.new_group([g.rank_of(s, r) for s in users])
                if r == g.replica and g.stage in users:
                    self.tied_groups[users] = grp

    def close(self) -> None:
        """Destroy the process groups this engine created (when building several engines
        in one process, e.g. benchmarks)."""
        groups = [self.pipe_group, self.dp_group, *self.tied_groups.values()]
        for grp in groups:
            if grp is not None:
                dist.destroy_process_group(grp)
        self.pipe_group = self.dp_group = None
        self.tied_groups = {}

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
        stats = self.executor.run_step(batches, weights, 1.0 / self.microbatches)
        self.sync_grads()
        return stats

    def sync_grads(self) -> None:
        """Sum replicated parameters' gradients over their stages, then average over DP."""
        params = dict(self.named_parameters())
        for name, users in sorted(self.shared.items()):  # same order on every rank
            p = params.get(name)
            if p is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.tied_groups[tuple(users)])
        if self.grid.dp > 1:
            grads = []
            for _, p in sorted(params.items()):
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            if grads:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.grid.dp
                off = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[off : off + n].view_as(g))
                    off += n

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so the whole model's L2 norm is at most ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``, replicated parameters counted once). Returns the
        norm before clipping."""
        sq = torch.zeros((), dtype=torch.float64)
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            users = self.shared.get(name)
            if users is not None and users[0] != self.grid.stage:
                continue
            sq += p.grad.detach().double().pow(2).sum().cpu()
        if self.pipe_group is not None:
            sq = sq.to(self.p2p.device)
            dist.all_reduce(sq, group=self.pipe_group)
        norm = float(sq.sqrt())
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for _, p in self.named_parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm

    def reduce_exit_losses(self, stats: StepStats, layers: Sequence[int]) -> dict[int, float]:
        """Mean per-exit cross-entropy over regular microbatches and DP replicas."""
        layers = sorted(layers)
        vals = torch.tensor([stats.exit_ce.get(k, 0.0) for k in layers], dtype=torch.float64)
        if dist.is_initialized():
            vals = vals.to(self.p2p.device)
            dist.all_reduce(vals)
            vals = vals.cpu() / self.grid.dp
        return {k: float(v) / self.microbatches for k, v in zip(layers, vals, strict=True)}

    # ----- state ----------------------------------------------------------------------------------
    def gather(self, payload: Any) -> list[Any] | None:
        """Collect one object per stage of replica 0 on global rank 0 (others get None).
        Tensors inside ``payload`` travel as CPU copies."""
        payload = _to_cpu(payload)
        if not dist.is_initialized():
            return [payload]
        if self.grid.replica != 0:
            return None
        out: list[Any] | None = [None] * self.grid.pp if self.grid.rank == 0 else None
        dist.gather_object(payload, out, dst=self.grid.rank_of(0, 0), group=self.pipe_group)
        return out


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor (in dicts, lists, tuples) replaced by a detached CPU copy."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
