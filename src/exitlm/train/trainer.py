"""The training loop: multi-exit loss, layer dropout, AdamW + cosine LR, gradient accumulation
and clipping, data parallelism over ``torchrun`` processes, checkpoints and logs.

One step ``t``:

1. the objective's weights ``w(t)`` (EE-LLM Eq. 1 with App. C.1 schedules, or LayerSkip's
   ``ẽ(t, l)``, Eq. 5-6) and the layer-dropout pattern (LayerSkip Eq. 1-4, same on all ranks);
2. ``grad_accum`` micro-batches of ``batch_size`` rows per rank, each backpropagating
   ``L / grad_accum``; DDP averages gradients over ranks on the last one;
3. gradient clipping, AdamW, the LR of step ``t + 1``.

A run is a pure function of its config: data order comes from ``(seed, position)``, dropout
from ``(seed, step)``, so ``--resume`` from a checkpoint continues the same loss curve.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from exitlm.config import PRESETS as MODEL_PRESETS
from exitlm.config import ConfigError, check_fits_in_memory
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.config import ModelSpec, TrainConfig
from exitlm.train.data import BatchStream, eval_batches, load_tokenizer, open_split, prepare
from exitlm.train.finite import NonFiniteGuard, refuse_non_finite
from exitlm.train.losses import LossModule
from exitlm.train.run_dir import RunDir
from exitlm.train.run_state import RunStateMixin
from exitlm.train.tuning import freeze_backbone, init_heads_from_final, new_exit_layers


@dataclass
class BuiltModel:
    model: EarlyExitLM
    tokenizer: Any
    new_heads: list[int]


def build_model(spec: ModelSpec, seed: int = 0) -> BuiltModel:
    """A preset with random weights, or a checkpoint (with the requested exits attached)."""
    exits = spec.exit_config()
    if spec.init in MODEL_PRESETS:
        cfg = spec.preset_config()
        check_fits_in_memory(cfg, "model (model.init / model.overrides)")
        torch.manual_seed(seed)
        return BuiltModel(EarlyExitLM(cfg), None, [])
    from exitlm.io import load_model
    from exitlm.io.loader import rebuild

    base = load_model(spec.init)
    if exits is None:
        return BuiltModel(base.model, base.tokenizer, [])
    before = base.config.exits
    same = (before.head, before.norm, before.output) == (exits.head, exits.norm, exits.output)
    torch.manual_seed(seed)
    loaded = rebuild(base, dtype=torch.float32, exits=exits)
    return BuiltModel(loaded.model, loaded.tokenizer,
                      new_exit_layers(before.layers, exits.layers, same))


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``min_ratio * base_lr``."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(total - warmup, 1)
    s = min(max(step - warmup, 0) / span, 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * s)))


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer(RunStateMixin):
    """Build everything a run needs from a :class:`TrainConfig`; :meth:`train` runs it.

    ``resume``: continue the run in ``train.out_dir`` from its newest readable checkpoint;
    ``overwrite``: replace the outputs of a previous run there; ``allow_changes``: resume
    although the ``model`` / ``data`` settings differ from the run's; ``init_missing``:
    resume although the checkpoint lacks tensors of this model (they keep their fresh
    initialisation; implies ``allow_changes``). See :mod:`exitlm.train.run_dir`.
    """

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 allow_changes: bool = False, init_missing: bool = False) -> None:
        self.cfg = cfg
        run = cfg.train
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and run.device != "cpu" else "gloo"
            dist.init_process_group(backend)
        self.rank, self.world = _dist_info()
        self.out = Path(run.out_dir).expanduser()
        self.run_dir = RunDir(self.out)
        self.resuming, self.overwrite = resume, overwrite
        self.allow_changes, self.init_missing = allow_changes or init_missing, init_missing
        self.run_id: str | None = None
        self.events: list[dict[str, Any]] = []  # logged in log.jsonl when the run starts
        self.stale_checkpoints: list[Path] = []  # unreadable, newer than the resumed one
        self.started = False
        if self.rank == 0:
            self.run_dir.check(resume=resume, overwrite=overwrite)
        self.device = self._device(run.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL object collectives use the current device
        self.guard = NonFiniteGuard(run.on_nonfinite)
        built = build_model(cfg.model, run.seed)
        self.model = built.model.to(self.device).train()
        self.tokenizer = built.tokenizer
        mcfg = self.model.config
        cfg.loss.validate(mcfg, run.steps)
        self.weights0 = cfg.loss.weights_at(0, mcfg, run.steps)
        if cfg.tune.init_new_heads and built.new_heads:
            init_heads_from_final(self.model, built.new_heads)
        self.trained_names: set[str] | None = None
        if cfg.tune.freeze_backbone:
            self.trained_names = set(freeze_backbone(self.model))
        # data: rank 0 tokenizes, the others wait and reuse its files
        if self.rank == 0:
            self.data_dir = prepare(cfg.data, progress=run.progress,
                                    tokenizer=self._data_tokenizer())
        self._barrier()
        if self.rank != 0:
            self.data_dir = prepare(cfg.data, progress=False, tokenizer=self._data_tokenizer())
        meta = json.loads((self.data_dir / "meta.json").read_text(encoding="utf-8"))
        if meta["vocab_size"] > mcfg.vocab_size:
            raise ConfigError(
                f"data.tokenizer={cfg.data.tokenizer!r} has {meta['vocab_size']} tokens but the "
                f"model's vocab_size is {mcfg.vocab_size}; set model.overrides.vocab_size"
            )
        self.train_data = open_split(self.data_dir, "train", cfg.data.seq_len)
        self.val_data = open_split(self.data_dir, "val", cfg.data.seq_len)
        self.pipeline = self._pipeline() if cfg.parallel.pipelined else None
        replica, replicas = self.rank, self.world
        if self.pipeline is not None:
            replica, replicas = self.pipeline.grid.replica, self.pipeline.grid.dp
        self.replicas = replicas
        self.stream = BatchStream(self.train_data, run.batch_size, seed=cfg.data.seed,
                                  rank=replica, world_size=replicas)
        # optimizer over trainable parameters; no weight decay on norms and biases
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.module = LossModule(self.model)
        self.fsdp = False
        if self.pipeline is not None:
            params = [(n, p) for n, p in self.pipeline.named_parameters() if p.requires_grad]
        elif self.world > 1:
            if cfg.parallel.dp not in (0, self.world):
                raise ConfigError(f"parallel.dp={cfg.parallel.dp} but {self.world} processes "
                                  "run data parallel (parallel.pp=1); make them equal")
            self.module = self._wrap_parallel(self.module)
            params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        o = cfg.optim
        groups = [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.param_names = {id(p): n for n, p in self.model.named_parameters()}
        if not groups:  # a pipeline stage with nothing to train (frozen backbone, no exit)
            idle = torch.nn.Parameter(torch.zeros(0, device=self.device))
            self.param_names[id(idle)] = "_idle_stage"
            groups = [{"params": [idle], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            groups, lr=self._lr(0), betas=(o.beta1, o.beta2), eps=o.eps, foreach=False,
        )
        self.params = [p for _, p in params]
        self.step = 0
        self.scaler = None
        self.amp_dtype = self._amp_dtype()
        if self.amp_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler("cuda")
        if resume:
            self._resume()

    # ----- setup helpers ---------------------------------------------------------------------
    def _device(self, spec: str) -> torch.device:
        if spec == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            return torch.device("cpu")
        dev = torch.device(spec)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"train.device={spec!r} but no CUDA device is available here",
                              hint="use train.device=auto or train.device=cpu")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.type == "cuda" and dev.index is not None \
                and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={spec!r} but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        return dev

    def _amp_dtype(self) -> torch.dtype | None:
        amp = self.cfg.train.amp
        if self.device.type != "cuda" or amp == "none":
            return None  # fp32 on CPU
        return torch.float16 if amp == "fp16" else torch.bfloat16

    def _data_tokenizer(self) -> Any:
        spec = self.cfg.data.tokenizer
        if spec == "default" and self.tokenizer is not None and self.cfg.model.init == "default":
            return self.tokenizer
        return load_tokenizer(spec)

    def _wrap_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.cfg.train.parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            for block in self.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
            self.fsdp = True
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(module, device_ids=ids, find_unused_parameters=True)

    def _pipeline(self) -> Any:
        """This process's pipeline stage (``parallel.pp`` > 1 or token slices)."""
        from exitlm.parallel.dims import ProcessGrid
        from exitlm.parallel.pipeline.engine import PipelineEngine

        cfg, pc = self.cfg, self.cfg.parallel
        grid = ProcessGrid.build(self.world, self.rank, pc.pp, pc.dp)
        auto = pc.token_slices == "auto"
        slices = self._auto_slices(grid) if auto else pc.slice_lengths(cfg.data.seq_len)
        if len(slices) > 1 and cfg.dropout.enabled:
            raise ConfigError("layer dropout skips rows of whole sequences, token slicing cuts "
                              "them: set dropout.p_max=0 or parallel.token_slices=1")
        if self._amp_dtype() == torch.float16:
            raise ConfigError("pipeline training has no fp16 loss scaling; set train.amp=bf16")
        if self.rank == 0 and len(slices) > 1:
            print(f"token slices: {list(slices)}", flush=True)
        return PipelineEngine(self.model, pc, grid, microbatches=cfg.train.grad_accum,
                              slices=slices, device=self.device,
                              ignore_index=cfg.loss.ignore_index)

    def _auto_slices(self, grid: Any) -> tuple[int, ...]:
        """TeraPipe's DP plan, computed on rank 0 and shared (``token_slices=auto``)."""
        from exitlm.parallel.pipeline.slices import plan_token_slices

        box: list[Any] = [None]
        if self.rank == 0:
            box[0] = plan_token_slices(self.model.config, self.cfg.data.seq_len, grid.pp)
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return tuple(box[0])

    def _lr(self, step: int) -> float:
        o = self.cfg.optim
        return lr_at(step, o.lr, o.warmup_steps, self.cfg.train.steps, o.min_lr_ratio)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # ----- the loop --------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its log record (losses averaged over micro-batches and
        ranks)."""
        cfg, run = self.cfg, self.cfg.train
        mcfg = self.model.config
        t = self.step
        lr = self._lr(t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        weights = cfg.loss.weights_at(t, mcfg, run.steps)
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            return self._pipeline_step(weights, lr)
        sums: dict[int, float] = {}
        total = 0.0
        for micro in range(run.grad_accum):
            tokens, labels = self.stream.next()
            tokens, labels = tokens.to(self.device), labels.to(self.device)
            active = cfg.dropout.sample(tokens.shape[0], mcfg.num_layers, t, run.steps,
                                        micro, self.device)
            sync = micro == run.grad_accum - 1
            ctx = (self.module.no_sync() if self.world > 1 and not sync
                   and hasattr(self.module, "no_sync") else contextlib.nullcontext())
            amp = (torch.autocast(self.device.type, dtype=self.amp_dtype)
                   if self.amp_dtype is not None else contextlib.nullcontext())
            with ctx:
                with amp:
                    loss, per_exit = self.module(tokens, labels, weights, active)
                scaled = loss / run.grad_accum
                if self.scaler is not None:
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            total += float(loss.detach()) / run.grad_accum
            for k, v in per_exit.items():
                sums[k] = sums.get(k, 0.0) + float(v) / run.grad_accum
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        keys = sorted(sums)
        vals = torch.tensor([total, *[sums[k] for k in keys]], dtype=torch.float64)
        if self.world > 1:  # before the update: every rank decides on the same numbers
            vals = vals.to(self.device)
            dist.all_reduce(vals)
            vals = vals.cpu() / self.world
            total = float(vals[0])
        # fp16 loss scaling skips steps with overflowing gradients by itself
        apply = self.guard.allows(self.step + 1, total,
                                  0.0 if self.scaler is not None else gnorm)
        if not apply:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.step += 1
        rec: dict[str, Any] = {"step": self.step, "loss": total, "lr": lr, "grad_norm": gnorm}
        if not apply:
            rec["skipped"] = "non-finite"
        for i, k in enumerate(keys):
            rec[f"loss_{k}"] = float(vals[i + 1])
        rec["weights"] = {str(k): round(w, 6) for k, w in weights.items()}
        return rec

    def _pipeline_step(self, weights: dict[int, float], lr: float) -> dict[str, Any]:
        """One optimizer step through the pipeline (:mod:`exitlm.parallel.pipeline`)."""
        from exitlm.parallel.pipeline.executor import Microbatch

        cfg, run = self.cfg, self.cfg.train
        eng = self.pipeline
        mcfg = self.model.config
        batches = []
        for micro in range(eng.schedule.num_microbatches):
            tokens, labels = self.stream.next()
            active = cfg.dropout.sample(tokens.shape[0], mcfg.num_layers, self.step, run.steps,
                                        micro, self.device)
            batches.append(Microbatch(tokens.to(self.device), labels.to(self.device), active))
        amp = (torch.autocast(self.device.type, dtype=self.amp_dtype)
               if self.amp_dtype is not None else contextlib.nullcontext())
        with amp:
            stats = eng.run(batches, weights)
        gnorm = eng.clip_grad_norm(cfg.optim.grad_clip)
        active_w = {k: w for k, w in weights.items() if w != 0.0}
        losses = eng.reduce_exit_losses(stats, sorted(active_w))
        loss = sum(active_w[k] * v for k, v in losses.items())
        apply = self.guard.allows(self.step + 1, loss, gnorm)
        if apply:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        rec: dict[str, Any] = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": gnorm}
        if not apply:
            rec["skipped"] = "non-finite"
        for k, v in losses.items():
            rec[f"loss_{k}"] = v
        rec["weights"] = {str(k): round(w, 6) for k, w in weights.items()}
        return rec

    def evaluate(self, model: EarlyExitLM | None = None) -> dict[str, Any]:
        """Per-exit held-out metrics (all exits the model has plus the final layer)."""
        from exitlm.eval.per_exit import evaluate_exits

        batches = eval_batches(self.val_data, self.cfg.train.batch_size,
                               self.cfg.train.eval_samples)
        metrics = evaluate_exits(model if model is not None else self.model, batches)
        rec: dict[str, Any] = {"step": self.step, "split": "val"}
        for m in metrics:
            rec[f"val_loss_{m.layer}"] = m.loss
            rec[f"val_ppl_{m.layer}"] = m.ppl
            rec[f"val_agree_{m.layer}"] = m.agree_top1
        return rec

    def train(self, until_step: int | None = None) -> list[dict[str, Any]]:
        """Run to ``train.steps`` (or stop after ``until_step``, as a crash would, without a
        final checkpoint). Returns the step records of this call. The output directory is
        locked meanwhile (:mod:`exitlm.train.run_dir`)."""
        if self.rank == 0:
            self._begin_writing()
        try:
            return self._run(until_step)
        finally:
            if self.rank == 0:
                self.run_dir.unlock()

    def _run(self, until_step: int | None) -> list[dict[str, Any]]:
        run = self.cfg.train
        stop = run.steps if until_step is None else min(until_step, run.steps)
        main = self.rank == 0
        log = open(self.out / "log.jsonl", "a", encoding="utf-8") if main else None  # noqa: SIM115
        writer = self._tensorboard() if main else None
        bar = None
        if main and run.progress:
            from tqdm import tqdm

            bar = tqdm(total=run.steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True)
        tokens_per_step = run.batch_size * run.grad_accum * self.replicas * self.cfg.data.seq_len
        records: list[dict[str, Any]] = []
        try:
            while self.step < stop:
                t0 = time.perf_counter()
                rec = self.train_step()
                dt = time.perf_counter() - t0
                rec["tokens_per_s"] = tokens_per_step / dt
                rec["time"] = time.time()
                records.append(rec)
                log_now = self.step % max(run.log_every, 1) == 0 or self.step == run.steps
                if main and log is not None and log_now:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    self._tb(writer, rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}")
                if run.eval_every and (self.step % run.eval_every == 0 or self.step == run.steps):
                    host = self._host_model()
                    if main and log is not None and host is not None:
                        ev = self.evaluate(host)
                        log.write(json.dumps(ev) + "\n")
                        log.flush()
                        self._tb(writer, ev)
                    self._barrier()
                if run.checkpoint_every and self.step % run.checkpoint_every == 0:
                    self.save()
            if self.step >= run.steps and until_step is None:
                self.finish()
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
            if writer is not None:
                writer.close()
        return records

    def finish(self) -> None:
        """Save the trained model to ``OUT/model`` and plot the loss curves."""
        host = self._host_model()
        if host is not None:
            refuse_non_finite(host.state_dict(), f"the trained model to {self.out}")
            from exitlm.io import save_model
            from exitlm.tokenizer import Tokenizer

            info = {"data": {"tokenizer": self.cfg.data.tokenizer}, "config": self.cfg.to_dict()}
            if self.cfg.tune.freeze_backbone:
                # exit tuning: only the heads changed; write them as a small bundle
                from exitlm.train.default_ee import save_bundle

                save_bundle(host, self.out / "exits", self.cfg.model.init,
                            {"steps": self.step, "data": info["data"]})
            else:
                tok = self.tokenizer if isinstance(self.tokenizer, Tokenizer) else None
                if tok is None and self.cfg.data.tokenizer != "bytes":
                    loaded = load_tokenizer(self.cfg.data.tokenizer)
                    tok = loaded if isinstance(loaded, Tokenizer) else None
                path = save_model(host, self.out / "model", tokenizer=tok)
                (path / "exitlm_train.json").write_text(json.dumps(info, indent=2) + "\n",
                                                        encoding="utf-8")
            from exitlm.train.plot import plot_log

            plot_log(self.out / "log.jsonl", self.out / "loss.png")
        self._barrier()

    def _tensorboard(self) -> Any:
        if not self.cfg.train.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard not installed
            return None
        return SummaryWriter(str(self.out / "tb"))

    @staticmethod
    def _tb(writer: Any, rec: dict[str, Any]) -> None:
        if writer is None:
            return
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("step", "time"):
                writer.add_scalar(k, v, rec["step"])


def train(cfg: TrainConfig, *, resume: bool = False, **options: bool) -> Trainer:
    """Build a :class:`Trainer` (``options``: its keyword flags) and run it to the end."""
    trainer = Trainer(cfg, resume=resume, **options)
    trainer.train()
    return trainer
