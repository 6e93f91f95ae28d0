"""Layouts: how one training process holds and trains its part of the model, behind one
interface (torchtitan's "parallelize after build"; the trainer never asks which it runs).

:func:`parallelize` takes a built :class:`~exitlm.model.transformer.EarlyExitLM` and the
:class:`~exitlm.train.parallel.groups.ProcessGroups` of the job and returns a :class:`Layout`:

* :class:`Layout` - one process, or tensor parallelism (``parallel.tp``, :mod:`.tensor`)
  with data parallelism by one flat gradient all-reduce over the replicas;
* :class:`DDPLayout` - ``DistributedDataParallel`` (``train.parallel=ddp``);
* :class:`FSDPLayout` - ``fully_shard`` per layer (``train.parallel=fsdp``);
* :class:`PipelineLayout` - EE-LLM's pipeline (``parallel.pp``, token slices), with tensor
  and data parallelism inside (:mod:`.pipeline`).

Every layout answers the same questions: its parameters (whole-model names), one step's
forward/backward over a list of microbatches (EE-LLM Eq. 1 losses, reduced over replicas),
gradient clipping over the whole model, and checkpoint state that does not depend on the
layout: full tensors under the single-process names and optimizer state keyed by name, on
global rank 0, loadable by any other layout. Every collective runs under
``parallel.timeout_s`` and :meth:`ProcessGroups.guard`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exitlm.config import ConfigError
from exitlm.errors import ExitlmError
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.sharding import check_even
from exitlm.train.checkpoint import load_optimizer_state, optimizer_state_by_name
from exitlm.train.losses import LossModule
from exitlm.train.parallel.dims import ParallelConfig
from exitlm.train.parallel.grads import average_gradients, clip_gradients
from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.pipeline.engine import PipelineEngine
from exitlm.train.parallel.pipeline.executor import Microbatch
from exitlm.train.parallel.pipeline.slices import plan_token_slices
from exitlm.train.parallel.tensor import (
    TensorParallel,
    apply_tensor_parallel,
    local,
)

State = tuple[dict[str, torch.Tensor], dict[str, Any]]
__all__ = ["DDPLayout", "FSDPLayout", "Layout", "Microbatch", "PipelineLayout", "StepResult",
           "parallelize"]


@dataclass
class StepResult:
    """One step's losses, averaged over its microbatches and the data-parallel replicas."""

    loss: float
    """The objective ``sum_i w_i L_i`` (EE-LLM Eq. 1)."""
    exit_losses: dict[int, float]
    """Mean cross-entropy of every computed exit (1-based layer; ``L`` is the final one)."""


class Layout:
    """One process, or tensor parallelism (with data parallelism by gradient averaging).

    ``model`` is this process's part; ``microbatches`` the batches a step consumes.
    """

    kind = "single"

    def __init__(self, model: EarlyExitLM, groups: ProcessGroups, *, microbatches: int,
                 tp: TensorParallel | None = None, amp_dtype: torch.dtype | None = None,
                 ignore_index: int = -100, distill: float = 0.0) -> None:
        self.model = model
        self.config = model.config
        self.groups = groups
        self.dims = groups.dims
        self.device = groups.device
        self.microbatches = microbatches
        self.tp = tp
        self.amp_dtype = amp_dtype
        self.ignore_index = ignore_index
        self.module: nn.Module = LossModule(model, distill)
        self._idle: nn.Parameter | None = None

    # ----- parameters -------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This process's parameters under the whole model's names, trainable or not."""
        return list(self.model.named_parameters())

    def holds(self) -> set[str]:
        """Names of the state-dict tensors this process holds (a part of each when sharded)."""
        return set(self.model.state_dict())

    def known(self) -> set[str]:
        """Names of every state-dict tensor of the whole model."""
        return self.holds()

    def optimizer_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW parameter groups: weight decay on matrices, none on norms and biases. A
        process with nothing to train (a pipeline stage of a frozen backbone) gets an empty
        placeholder so the optimizer can be built."""
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not groups:
            self._idle = nn.Parameter(torch.zeros(0, device=self.device))
            groups = [{"params": [self._idle], "weight_decay": 0.0}]
        return groups

    def parameter_names(self) -> dict[int, str]:
        """``id(parameter)`` -> name, for optimizer state keyed by name."""
        names = {id(p): n for n, p in self.named_parameters()}
        if self._idle is not None:
            names[id(self._idle)] = "_idle_stage"
        return names

    # ----- a step -------------------------------------------------------------------------
    def forward_backward(self, batches: Sequence[Microbatch], weights: Mapping[int, float],
                         scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> StepResult:
        """Accumulate the gradient of ``sum_m sum_i w_i L_i(m) / M`` over ``batches`` into
        ``.grad`` (synchronised over replicas) and return the step's losses.
        ``scale_loss`` multiplies the loss before ``backward`` (fp16 loss scaling)."""
        with self.groups.guard("training step"):
            n = len(batches)
            total, sums = 0.0, {}
            for i, mb in enumerate(batches):
                with self._sync(i == n - 1), self.loss_context():
                    with self._autocast():
                        loss, per_exit = self.module(mb.tokens, mb.labels, weights, mb.active)
                    scaled = loss / n
                    (scale_loss(scaled) if scale_loss is not None else scaled).backward()
                total += float(loss.detach()) / n
                for k, v in per_exit.items():
                    sums[k] = sums.get(k, 0.0) + float(v) / n
            self._after_backward()
            keys = sorted(sums)
            vals = torch.tensor([total, *(sums[k] for k in keys)], dtype=torch.float64)
            vals = self.groups.all_reduce(vals) / self.dims.world_size
        return StepResult(float(vals[0]), {k: float(vals[i + 1]) for i, k in enumerate(keys)})

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """Where losses on this layout's logits are computed and back-propagated
        (``loss_parallel`` under tensor parallelism)."""
        return self.tp.loss_context() if self.tp is not None else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _after_backward(self) -> None:
        if self.dims.dp > 1:
            average_gradients([p for _, p in self.named_parameters()], self.groups.dp,
                              self.dims.dp)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients to an L2 norm of at most ``max_norm`` (0: no clipping); returns
        the norm before clipping."""
        if self.tp is None and self.dims.world_size == 1:
            params = [p for _, p in self.named_parameters() if p.requires_grad]
            limit = max_norm if max_norm > 0 else float("inf")
            return float(torch.nn.utils.clip_grad_norm_(params, limit))
        with self.groups.guard("clipping gradients"):
            params = self.named_parameters()
            return clip_gradients(params, [p for _, p in params], max_norm, self.groups, self.tp)

    # ----- state --------------------------------------------------------------------------
    def state(self, optimizer: torch.optim.Optimizer) -> State | None:
        """The whole model's tensors and the optimizer state by name, on global rank 0
        (``None`` elsewhere). Collective."""
        with self.groups.guard("gathering a checkpoint"):
            parts = self._gather(optimizer)
        return None if parts is None else _merge(parts)

    def host_model(self) -> EarlyExitLM | None:
        """The whole model on global rank 0 (``None`` elsewhere). Collective."""
        if self.tp is None and self.dims.pp == 1:
            return self.model if self.dims.rank == 0 else None
        with self.groups.guard("gathering the model"):
            parts = self._gather(None)
        if parts is None:
            return None
        host = EarlyExitLM(self.config).to(self.device)
        host.load_state_dict(_union([w for w, _ in parts]))
        return host

    def _gather(self, optimizer: torch.optim.Optimizer | None) -> list[State] | None:
        """Every stage's full tensors (and optimizer state) of replica 0, on global rank 0."""
        if self.dims.replica != 0:
            return None
        own = self.holds()
        weights = {n: self._full(n, t) for n, t in self.model.state_dict().items() if n in own}
        optim: dict[str, Any] = {"state": {}, "param_groups": []}
        if optimizer is not None:
            optim = optimizer_state_by_name(optimizer, self.parameter_names())
            optim["state"] = {name: {k: self._full(name, v) if isinstance(v, torch.Tensor)
                                     else v for k, v in st.items()}
                              for name, st in sorted(optim["state"].items())}
        if self.dims.tp_rank != 0:
            return None
        pipe = self.dims.pipeline_ranks(0, 0)
        return self.groups.gather_object((weights, optim), pipe, self.groups.pipe)

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.full(name, t)
        return t.detach().cpu()

    def load(self, weights: Mapping[str, torch.Tensor], optim: dict[str, Any],
             optimizer: torch.optim.Optimizer, *, strict: bool = True) -> None:
        """Take this process's part of checkpoint ``weights`` and optimizer state (full
        tensors by name, from any layout). Shapes are checked against the whole model's."""

        held = self.holds()
        own = {n: t for n, t in self.model.state_dict().items() if n in held}
        with torch.no_grad():
            for name, t in weights.items():
                if name not in own:
                    continue
                if own[name].shape != t.shape:
                    raise ExitlmError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, "
                                      f"the model {tuple(own[name].shape)}")
                local(own[name]).copy_(local(self._shard(name, t, own[name])))
        params = dict(self.named_parameters())
        state = {}
        for name, st in optim.get("state", {}).items():
            p = params.get(name)
            state[name] = {k: self._shard(name, v, p) if p is not None
                           and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                           for k, v in st.items()}
        load_optimizer_state(optimizer, {**optim, "state": state}, self.parameter_names())

    def _shard(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.shard_like(name, full, like)
        return full

    def barrier(self) -> None:
        self.groups.barrier()

    def close(self) -> None:
        """Release what the layout created (process groups of a pipeline)."""


class DDPLayout(Layout):
    """``DistributedDataParallel``: gradients all-reduced during the last microbatch's
    backward (``no_sync`` before it)."""

    kind = "ddp"

    def __init__(self, model: EarlyExitLM, groups: ProcessGroups, **kw: Any) -> None:
        super().__init__(model, groups, **kw)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.module = DDP(self.module, device_ids=ids, process_group=groups.dp,
                          find_unused_parameters=True)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.module, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def _after_backward(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0
                                                    else float("inf")))


class FSDPLayout(Layout):
    """``fully_shard`` over the data-parallel group, one unit per transformer layer;
    checkpoints gather full tensors (written by rank 0) and re-shard on load."""

    kind = "fsdp"

    def __init__(self, model: EarlyExitLM, groups: ProcessGroups, **kw: Any) -> None:
        super().__init__(model, groups, **kw)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(groups.dp, self.device.type, mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.module, mesh=mesh)

    def _after_backward(self) -> None:
        pass

    def clip_grad_norm(self, max_norm: float) -> float:
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        with self.groups.guard("clipping gradients"):
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0
                                                  else float("inf"))
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def state(self, optimizer: torch.optim.Optimizer) -> State | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        with self.groups.guard("gathering a checkpoint"):
            model_state, optim_state = get_state_dict(
                self.model, optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return (model_state, optim_state) if self.dims.rank == 0 else None

    def host_model(self) -> EarlyExitLM | None:
        from torch.distributed.tensor import DTensor

        with self.groups.guard("gathering the model"):
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                    for k, v in self.model.state_dict().items()}
        if self.dims.rank != 0:
            return None
        host = EarlyExitLM(self.config)
        host.load_state_dict(full)
        return host

    def load(self, weights: Mapping[str, torch.Tensor], optim: dict[str, Any],
             optimizer: torch.optim.Optimizer, *, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        with self.groups.guard("loading a checkpoint"):
            set_state_dict(self.model, optimizer, model_state_dict=dict(weights),
                           optim_state_dict=optim,
                           options=StateDictOptions(full_state_dict=True, strict=strict))


class PipelineLayout(Layout):
    """EE-LLM's pipeline (:class:`~exitlm.train.parallel.pipeline.engine.PipelineEngine`): this
    process holds one stage (one tensor-parallel shard of it)."""

    kind = "pipeline"

    def __init__(self, model: EarlyExitLM, groups: ProcessGroups, pcfg: ParallelConfig,
                 slices: Sequence[int], *, microbatches: int, **kw: Any) -> None:
        engine = PipelineEngine(model, pcfg, groups.dims, microbatches=microbatches,
                                slices=slices, device=groups.device,
                                ignore_index=kw.get("ignore_index", -100), groups=groups)
        super().__init__(model, groups, microbatches=engine.schedule.num_microbatches,
                         tp=engine.tp, **kw)
        self.engine = engine

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.engine.named_parameters()

    def holds(self) -> set[str]:
        return {n for n in self.model.state_dict() if n in self.engine.owned}

    def known(self) -> set[str]:
        return self.engine.all_names

    def forward_backward(self, batches: Sequence[Microbatch], weights: Mapping[int, float],
                         scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> StepResult:
        if scale_loss is not None:
            raise ConfigError("pipeline training has no fp16 loss scaling; set train.amp=bf16")
        with self.groups.guard("pipeline step"):
            with self._autocast():
                stats = self.engine.run(batches, weights)
            active = {k: float(w) for k, w in weights.items() if w != 0.0}
            losses = self.engine.reduce_exit_losses(stats, sorted(active))
        return StepResult(sum(active[k] * v for k, v in losses.items()), losses)

    def clip_grad_norm(self, max_norm: float) -> float:
        with self.groups.guard("clipping gradients"):
            return self.engine.clip_grad_norm(max_norm)

    def close(self) -> None:
        self.engine.close()


def parallelize(model: EarlyExitLM, groups: ProcessGroups, pcfg: ParallelConfig, *,
                microbatches: int, seq_len: int, data_parallel: str = "ddp",
                amp_dtype: torch.dtype | None = None, layer_dropout: bool = False,
                ignore_index: int = -100, distill: float = 0.0) -> Layout:
    """The layout of ``model`` (built, on its device) for this process of the job
    ``groups`` describes: pipeline stages and token slices (``parallel.pp``,
    ``parallel.token_slices``), tensor parallelism (``parallel.tp``) and data parallelism
    (``train.parallel`` = ``data_parallel`` for pure data parallelism). ``model`` is changed
    in place (pruned to a stage, sharded)."""

    dims = groups.dims
    check_even(model.config, dims.tp)
    # (TrainConfig refuses distill > 0 with pipeline or tensor parallelism)
    kw: dict[str, Any] = {"amp_dtype": amp_dtype, "ignore_index": ignore_index,
                          "distill": distill}
    if pcfg.pipelined:
        if amp_dtype == torch.float16:
            raise ConfigError("pipeline training has no fp16 loss scaling; set train.amp=bf16")
        slices = _token_slices(model, groups, pcfg, seq_len)
        if len(slices) > 1 and layer_dropout:
            raise ConfigError("layer dropout skips rows of whole sequences, token slicing cuts "
                              "them: set dropout.p_max=0 or parallel.token_slices=1")
        return PipelineLayout(model, groups, pcfg, slices, microbatches=microbatches, **kw)
    if data_parallel == "fsdp" and dims.world_size > 1:
        if dims.tp > 1:
            raise ConfigError("train.parallel=fsdp shards over every process and does not "
                              "combine with parallel.tp > 1; use train.parallel=ddp (replicas "
                              "then average gradients) or parallel.tp=1")
        return FSDPLayout(model, groups, microbatches=microbatches, **kw)
    if dims.tp > 1:
        if pcfg.sequence_parallel and seq_len % dims.tp:
            raise ConfigError(f"parallel.sequence_parallel shards sequences of data.seq_len="
                              f"{seq_len} over parallel.tp={dims.tp} ranks; make seq_len "
                              "divisible by tp or set parallel.sequence_parallel=false")
        tp = apply_tensor_parallel(model, groups.tp_mesh,
                                   sequence_parallel=pcfg.sequence_parallel)
        return Layout(model, groups, microbatches=microbatches, tp=tp, **kw)
    if dims.world_size > 1:
        return DDPLayout(model, groups, microbatches=microbatches, **kw)
    return Layout(model, groups, microbatches=microbatches, **kw)


def _token_slices(model: EarlyExitLM, groups: ProcessGroups, pcfg: ParallelConfig,
                  seq_len: int) -> tuple[int, ...]:
    """``parallel.token_slices`` as lengths; ``auto`` is TeraPipe's plan, computed on rank 0
    and shared."""
    if pcfg.token_slices != "auto":
        return pcfg.slice_lengths(seq_len)

    plan = None
    if groups.dims.rank == 0:
        plan = tuple(plan_token_slices(model.config, seq_len, groups.dims.pp))
        print(f"token slices: {list(plan)}", flush=True)
    return tuple(groups.broadcast_object(plan))


def _merge(parts: list[State]) -> State:
    """Union of the stages' ``(model tensors, optimizer state by name)``; a parameter
    replicated on several stages (tied weights) is identical everywhere, the first is kept."""
    groups: list[dict[str, Any]] = []
    for _, optim in parts:
        for i, g in enumerate(optim["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += [p for p in g["params"] if p not in groups[i]["params"]]
    model = _union([weights for weights, _ in parts])
    state = _union([optim["state"] for _, optim in parts])
    return model, {"state": state, "param_groups": groups}


def _union(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Name -> value maps as one; a name several parts hold keeps the first part's value."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out
