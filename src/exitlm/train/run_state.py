"""Checkpoints of a training run: save, resume, and the whole model on rank 0.

The same checkpoint format serves every layout (one process, DDP, FSDP, any pipeline
``pp x dp``): model tensors under the whole model's parameter names and optimizer state keyed
by parameter name (:mod:`exitlm.train.checkpoint`). FSDP gathers full tensors; a pipeline
gathers its stages' parts on rank 0 (:meth:`exitlm.parallel.pipeline.engine.PipelineEngine.
gather`); on resume every process takes the tensors it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from exitlm.model.transformer import EarlyExitLM
from exitlm.train.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_optimizer_state,
    optimizer_state_by_name,
    read_checkpoint,
    save_checkpoint,
)


class RunStateMixin:
    """Checkpoint methods of :class:`exitlm.train.trainer.Trainer` (which sets the
    attributes annotated here)."""

    cfg: Any
    rank: int
    world: int
    out: Path
    model: EarlyExitLM
    optimizer: torch.optim.Optimizer
    fsdp: bool
    pipeline: Any
    trained_names: set[str] | None
    param_names: dict[int, str]
    step: int
    stream: Any

    def _lr(self, step: int) -> float:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            if self.rank == 0:
                print(f"no checkpoint under {self.out}; starting from step 0", flush=True)
            return
        weights, optim, state = read_checkpoint(ckpt)
        if self.fsdp:
            # Every rank reads the full tensors and keeps its own shards of them.
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=weights,
                           optim_state_dict=optim,
                           options=StateDictOptions(full_state_dict=True,
                                                    strict=self.trained_names is None))
        else:
            self._load_weights(ckpt, weights)
            load_optimizer_state(self.optimizer, optim, self.param_names)
        self.step = state.step
        self.stream.position = state.data_position
        if self.rank == 0:
            self._truncate_log(self.step)
            print(f"resumed from {ckpt} at step {self.step}", flush=True)

    def _load_weights(self, ckpt: Path, weights: dict[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors into this process's parameters (a pipeline stage takes
        the ones it holds; checkpoints do not depend on the layout that wrote them)."""
        own = self._own_state()
        known = set(own) if self.pipeline is None else self.pipeline.all_names
        unknown = sorted(set(weights) - known)
        if unknown:
            raise ValueError(f"{ckpt}: checkpoint has tensors {unknown[:5]} this model lacks - "
                             "was it written for another model configuration?")
        with torch.no_grad():
            for name, t in weights.items():
                if name not in own:
                    continue
                if own[name].shape != t.shape:
                    raise ValueError(f"{ckpt}: {name} has shape {tuple(t.shape)}, the model "
                                     f"{tuple(own[name].shape)}")
                own[name].copy_(t)

    def save(self) -> Path | None:
        """Write a checkpoint of the current state (rank 0 writes, every rank waits)."""
        path = None
        model_state: Any = self.model
        optim_state: Any = self.optimizer
        if not self.fsdp:
            model_state = self._own_state()
            optim_state = optimizer_state_by_name(self.optimizer, self.param_names)
        if self.pipeline is not None:  # collect every stage's part on rank 0
            parts = self.pipeline.gather((model_state, optim_state))
            if parts is not None:
                model_state, optim_state = _merge_parts(parts)
        if self.fsdp:  # gather full tensors (collective: every rank takes part)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            model_state, optim_state = get_state_dict(
                self.model, self.optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True),
            )
        if self.rank == 0:
            state = TrainState(self.step, self.stream.position,
                               {"kind": "cosine", "step": self.step,
                                "lr": self._lr(self.step)},
                               {"config": self.cfg.to_dict(), "world_size": self.world})
            path = save_checkpoint(self.out, model=model_state, optimizer=optim_state,
                                   state=state, names=self.trained_names,
                                   keep=self.cfg.train.keep_checkpoints)
        self._barrier()
        return path

    def _own_state(self) -> dict[str, torch.Tensor]:
        """The tensors this process holds (all of them unless it is a pipeline stage)."""
        sd = self.model.state_dict()
        if self.pipeline is None:
            return sd
        return {n: t for n, t in sd.items() if n in self.pipeline.owned}

    def _truncate_log(self, step: int) -> None:
        log = self.out / "log.jsonl"
        if not log.is_file():
            return
        keep = [ln for ln in log.read_text(encoding="utf-8").splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        tmp = log.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
        os.replace(tmp, log)

    def _host_model(self) -> EarlyExitLM | None:
        """The whole model on rank 0, ``None`` elsewhere. Under FSDP this gathers the shards
        and must be called on every rank."""
        if self.pipeline is not None:
            parts = self.pipeline.gather(self._own_state())
            if parts is None:
                return None
            host = EarlyExitLM(self.model.config)
            host.load_state_dict(_union(parts))
            return host
        if not self.fsdp:
            return self.model if self.rank == 0 else None
        from torch.distributed.tensor import DTensor

        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                for k, v in self.model.state_dict().items()}
        if self.rank != 0:
            return None
        host = EarlyExitLM(self.model.config)
        host.load_state_dict(full)
        return host


def _merge_parts(parts: list[Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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
    """The stages' name -> value maps as one; a name several stages hold (a replicated,
    tied parameter, equal everywhere) keeps the first stage's value."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out
