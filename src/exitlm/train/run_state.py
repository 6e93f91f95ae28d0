"""Checkpoints of a training run: save and resume.

The same checkpoint format serves every layout (one process, DDP, FSDP, any ``pp x dp x
tp``): model tensors under the whole model's parameter names and optimizer state keyed by
parameter name (:mod:`exitlm.train.checkpoint`). The layout gathers them on rank 0
(:meth:`exitlm.train.parallel.layout.Layout.state`) and, on resume, every process takes its part
(:meth:`~exitlm.train.parallel.layout.Layout.load`), so a checkpoint written by one layout resumes
under any other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from exitlm.errors import ExitlmError, warn
from exitlm.io.hf_map import CheckpointError
from exitlm.model.transformer import EarlyExitLM
from exitlm.paths import write_text_atomic
from exitlm.train.checkpoint import (
    TrainState,
    checkpoints,
    latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from exitlm.train.finite import refuse_non_finite
from exitlm.train.parallel.layout import Layout
from exitlm.train.run_dir import RUN_FILE, RunDir, dir_step
from exitlm.train.schedules import lr_at


class RunStateMixin:
    """Checkpoint methods of :class:`exitlm.train.trainer.Trainer` (which sets the
    attributes annotated here)."""

    cfg: Any
    rank: int
    world: int
    out: Path
    run_dir: RunDir
    model: EarlyExitLM
    optimizer: torch.optim.Optimizer
    layout: Layout
    trained_names: set[str] | None
    step: int
    stream: Any
    resuming: bool
    overwrite: bool
    allow_changes: bool
    init_missing: bool
    run_id: str | None
    events: list[dict[str, Any]]
    stale_checkpoints: list[Path]
    started: bool

    def _lr(self, step: int) -> float:
        """The learning rate of ``step`` (:func:`~exitlm.train.schedules.lr_at`)."""
        o = self.cfg.optim
        return lr_at(step, o.lr, o.warmup_steps, self.cfg.train.steps, o.min_lr_ratio)

    def _resume(self) -> None:
        """Load the newest readable checkpoint of the run in ``out``; damaged ones are
        skipped with a warning (and removed when the run starts writing)."""
        recorded = self.run_dir.read_run()
        self.run_id = recorded["run_id"] if recorded else None
        found = checkpoints(self.out)
        if not found:
            if self.rank == 0:
                print(f"no checkpoint under {self.out}; starting from step 0", flush=True)
            return
        for ckpt in found:
            try:
                weights, optim, state = read_checkpoint(ckpt)
                break
            except CheckpointError as err:
                if self.rank == 0:
                    warn(f"{err}; falling back to the previous checkpoint")
                self.stale_checkpoints.append(ckpt)
        else:
            raise ExitlmError(f"none of the {len(found)} checkpoint(s) under {self.out} is "
                              "readable", hint="start a new run (--overwrite) instead")
        if state.step > self.cfg.train.steps:
            raise ExitlmError(
                f"--resume: train.steps={self.cfg.train.steps} is below the step of the run's "
                f"newest checkpoint ({ckpt}, step {state.step}); a run cannot go back",
                hint=f"set train.steps to {state.step} or more to continue the run")
        self._check_identity(ckpt, state.extra, recorded)
        self._check_tensors(ckpt, weights)
        unknown = sorted(set(weights) - self.layout.known())
        if unknown:
            raise ExitlmError(f"{ckpt}: checkpoint has tensors {unknown[:5]} this model lacks - "
                              "was it written for another model configuration?")
        strict = self.trained_names is None and not self.init_missing
        try:
            self.layout.load(weights, optim, self.optimizer, strict=strict)
        except ExitlmError as err:
            raise ExitlmError(f"{ckpt}: {err}", hint=err.hint) from err
        self.step = state.step
        self.stream.position = state.data_position
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step}", flush=True)

    def _check_identity(self, ckpt: Path, extra: dict[str, Any],
                        recorded: dict[str, Any] | None) -> None:
        """The checkpoint belongs to the run recorded in ``run.json``, and the ``model`` /
        ``data`` settings are the ones it was trained with (or ``allow_changes``)."""
        ours = extra.get("run_id")
        if ours and recorded and recorded["run_id"] != ours:
            raise ExitlmError(
                f"{ckpt} belongs to run {ours}, but {self.out / RUN_FILE} records run "
                f"{recorded['run_id']}: the directory mixes two runs",
                hint="move the other run's checkpoints away, or delete run.json to adopt them")
        self.run_id = self.run_id or ours
        changes = config_changes(extra.get("config"), self.cfg.to_dict())
        if not changes:
            return
        text = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:6])
        if len(changes) > 6:
            text += f"; and {len(changes) - 6} more"
        if not self.allow_changes:
            raise ExitlmError(
                f"--resume: the config differs from the one {ckpt} was trained with: {text}",
                hint="resume with the run's own settings, or pass --allow-changes to continue "
                     "with the new ones")
        if self.rank == 0:
            warn(f"resuming with changed settings (--allow-changes): {text}")
        self.events.append({"event": "resume", "changed": {k: [a, b] for k, a, b in changes}})

    def _check_tensors(self, ckpt: Path, weights: dict[str, torch.Tensor]) -> None:
        """Tensors of this model (this stage) the checkpoint lacks are an error unless
        ``init_missing``, which keeps their fresh initialisation and logs them."""
        names = self.layout.holds()
        if self.trained_names is not None:
            names &= self.trained_names
        missing = sorted(names - set(weights))
        if not missing:
            return
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        if not self.init_missing:
            raise ExitlmError(
                f"{ckpt}: lacks {len(missing)} tensor(s) of this model ({shown}); the model "
                "configuration differs from the checkpoint's (more layers or new exit heads?)",
                hint="resume with the run's own model settings, or pass --init-missing to "
                     "start the missing tensors from scratch (logged)")
        if self.rank == 0:
            warn(f"--init-missing: {len(missing)} tensor(s) absent from {ckpt} start from "
                 f"scratch: {shown}")
        self.events.append({"event": "init_missing", "tensors": missing})

    def _begin_writing(self) -> None:
        """Rank 0, before the first write: lock the directory, confirm nothing changed since
        the checks, remove leftovers of killed runs, record the run's identity, cut the log
        back to the resumed step."""
        rd = self.run_dir
        rd.lock()
        try:
            if self.started:  # a later train() call of the same run
                return
            if self.overwrite:
                rd.remove_outputs()
            elif not self.resuming and rd.outputs():
                raise ExitlmError(f"train.out_dir {self.out} received another run's outputs "
                                  f"({', '.join(rd.outputs())}) while this one was starting")
            rd.clean_leftovers()
            for stale in self.stale_checkpoints:
                shutil.rmtree(stale, ignore_errors=True)
            newest = latest_checkpoint(self.out)
            if self.resuming and newest is not None and dir_step(newest.name) > self.step:
                raise ExitlmError(f"{newest} appeared while this run was starting; another "
                                  "process writes to train.out_dir")
            self.run_id = rd.start(self.run_id)
            if self.resuming:
                self._truncate_log(self.step)
            write_text_atomic(self.out / "train_config.json",
                              json.dumps(self.cfg.to_dict(), indent=2) + "\n")
            if self.events:
                with open(self.out / "log.jsonl", "a", encoding="utf-8") as log:
                    for event in self.events:
                        log.write(json.dumps({"step": self.step, **event}) + "\n")
            self.started = True
        except BaseException:
            rd.unlock()
            raise

    def save(self) -> Path | None:
        """Write a checkpoint of the current state (rank 0 writes, every rank waits)."""
        path = None
        parts = self.layout.state(self.optimizer)  # collective: full tensors on rank 0
        if parts is not None:
            model_state, optim_state = parts
            refuse_non_finite(model_state, f"checkpoint step {self.step}")
            state = TrainState(self.step, self.stream.position,
                               {"kind": "cosine", "step": self.step,
                                "lr": self._lr(self.step)},
                               {"config": self.cfg.to_dict(), "world_size": self.world,
                                "run_id": self.run_id})
            path = save_checkpoint(self.out, model=model_state, optimizer=optim_state,
                                   state=state, names=self.trained_names,
                                   keep=self.cfg.train.keep_checkpoints)
        self.layout.groups.wait_for_rank0("waiting for rank 0 to write a checkpoint")
        return path

    def _truncate_log(self, step: int) -> None:
        """Keep the log's records up to ``step``. A torn last line (power loss while it was
        written) is dropped silently, other unreadable lines with a warning."""
        log = self.out / "log.jsonl"
        if not log.is_file():
            return
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        keep = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                if i < len(lines) - 1:
                    warn(f"{log}:{i + 1}: dropped a line that is not JSON")
                continue
            at = rec.get("step", 0) if isinstance(rec, dict) else None
            if isinstance(at, int) and at <= step:
                keep.append(line)
        write_text_atomic(log, "".join(line + "\n" for line in keep))

IDENTITY_SECTIONS = ("model", "data")
_IGNORED_KEYS = frozenset({"data.cache_dir"})  # where data is cached, not what it is


def config_changes(old: Any, new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every setting of the ``model`` and ``data`` sections
    that differs between a checkpoint's recorded config and the current one."""
    if not isinstance(old, dict):
        return []  # written before configs were recorded
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif a != b and key not in _IGNORED_KEYS:
            out.append((key, a, b))

    for section in IDENTITY_SECTIONS:
        walk(old.get(section), new.get(section), section)
    return out
