"""The training loop: multi-exit loss, layer dropout, AdamW + cosine LR, gradient accumulation
and clipping, checkpoints and logs - on whatever layout ``parallel`` / ``torchrun`` ask for
(:func:`exitlm.train.parallel.layout.parallelize`: one process, DDP, FSDP, pipeline, tensor
parallelism and their combinations behind one interface; the loop never asks which).

One step ``t``:

1. the objective's weights ``w(t)`` (EE-LLM Eq. 1 with App. C.1 schedules, or LayerSkip's
   ``ẽ(t, l)``, Eq. 5-6) and the layer-dropout pattern (LayerSkip Eq. 1-4, same on all ranks);
2. ``grad_accum`` micro-batches of ``batch_size`` rows per replica, each backpropagating
   ``L / grad_accum`` (:meth:`Layout.forward_backward`, gradients averaged over replicas);
3. gradient clipping, AdamW, the LR of step ``t + 1``.

A run is a pure function of its config: data order comes from ``(seed, position)``, dropout
from ``(seed, step)``, so ``--resume`` from a checkpoint continues the same loss curve.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exitlm.config import PRESETS as MODEL_PRESETS
from exitlm.config import ConfigError, check_batch_fits_in_memory, check_fits_in_memory
from exitlm.infer.per_exit import evaluate_exits
from exitlm.io import load_model, save_model
from exitlm.io.bundle import save_bundle
from exitlm.io.loaded import rebuild
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer, check_fits_vocab
from exitlm.train.config import ModelSpec, TrainConfig
from exitlm.train.data import BatchStream, eval_batches, load_tokenizer, open_split, prepare
from exitlm.train.finite import NonFiniteGuard, refuse_non_finite
from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.layout import Microbatch, parallelize
from exitlm.train.plot import plot_log
from exitlm.train.run_dir import RunDir
from exitlm.train.run_state import RunStateMixin
from exitlm.train.schedules import lr_at  # noqa: F401 - re-exported
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

    base = load_model(spec.init)
    if exits is None:
        return BuiltModel(base.model, base.tokenizer, [])
    before = base.config.exits
    same = (before.head, before.norm, before.output) == (exits.head, exits.norm, exits.output)
    torch.manual_seed(seed)
    loaded = rebuild(base, dtype=torch.float32, exits=exits)
    return BuiltModel(loaded.model, loaded.tokenizer,
                      new_exit_layers(before.layers, exits.layers, same))


def check_context(max_seq_len: int, seq_len: int, preset: bool) -> None:
    """Refuse training windows longer than the model's context: positions past
    ``max_seq_len`` have no learned embedding (GPT-2) and are never seen by the saved model
    (RoPE), which refuses longer inputs."""
    if seq_len > max_seq_len:
        fix = ("or raise model.overrides.max_seq_len" if preset
               else "(the model of model.init was built for that context)")
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's context "
                          f"(max_seq_len={max_seq_len}); set data.seq_len <= {max_seq_len} {fix}")


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
        # the job's processes, groups and device (exitlm.train.parallel.groups): validated
        # pp x dp x tp, every collective with parallel.timeout_s
        self.groups = ProcessGroups.create(cfg.parallel, run.device)
        self.dims = self.groups.dims
        self.rank, self.world = self.dims.rank, self.dims.world_size
        self.device = self.groups.device
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
        self.guard = NonFiniteGuard(run.on_nonfinite)
        built = build_model(cfg.model, run.seed)
        model = built.model.to(self.device).train()
        self.tokenizer = built.tokenizer
        mcfg = model.config
        check_context(mcfg.max_seq_len, cfg.data.seq_len, cfg.model.init in MODEL_PRESETS)
        check_batch_fits_in_memory(mcfg, run.batch_size, run.grad_accum, cfg.data.seq_len)
        cfg.loss.validate(mcfg, run.steps)
        self.weights0 = cfg.loss.weights_at(0, mcfg, run.steps)
        if cfg.tune.init_new_heads and built.new_heads:
            init_heads_from_final(model, built.new_heads)
        self.trained_names: set[str] | None = None
        if cfg.tune.freeze_backbone:
            self.trained_names = set(freeze_backbone(model))
        # data: rank 0 tokenizes, the others wait (as long as it takes) and reuse its files
        data_tok = self._data_tokenizer()  # checked before any text is tokenized
        check_fits_vocab(f"data.tokenizer={cfg.data.tokenizer!r}", data_tok.vocab_size,
                         data_tok.max_id, mcfg.vocab_size, "set model.overrides.vocab_size")
        if self.rank == 0:
            self.data_dir = prepare(cfg.data, progress=run.progress, tokenizer=data_tok)
        self.groups.wait_for_rank0("waiting for rank 0 to prepare the data")
        if self.rank != 0:
            self.data_dir = prepare(cfg.data, progress=False, tokenizer=data_tok)
        self.train_data = open_split(self.data_dir, "train", cfg.data.seq_len)
        self.val_data = open_split(self.data_dir, "val", cfg.data.seq_len)
        self.amp_dtype = self._amp_dtype()
        # the layout: this process's part of the model and how it trains (exitlm.train.parallel)
        self.layout = parallelize(
            model, self.groups, cfg.parallel, microbatches=run.grad_accum,
            seq_len=cfg.data.seq_len, data_parallel=run.parallel, amp_dtype=self.amp_dtype,
            layer_dropout=cfg.dropout.enabled, ignore_index=cfg.loss.ignore_index,
            distill=cfg.loss.distill)
        self.model = self.layout.model
        self.replicas = self.dims.dp
        self.stream = BatchStream(self.train_data, run.batch_size, seed=cfg.data.seed,
                                  rank=self.dims.replica, world_size=self.dims.dp)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.layout.optimizer_groups(o.weight_decay), lr=self._lr(0),
            betas=(o.beta1, o.beta2), eps=o.eps,
            **({"fused": True} if o.fused else {"foreach": False}),
        )
        self.step = 0
        self.scaler = None
        if self.amp_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler("cuda")
        if resume:
            self._resume()

    # ----- setup helpers ---------------------------------------------------------------------
    def _amp_dtype(self) -> torch.dtype | None:
        amp = self.cfg.train.amp
        if self.device.type != "cuda":
            # CPU: fp32 unless bf16 is asked for (autocast runs the products in bf16, which
            # CPUs with AVX-512 BF16 or AMX do ~1.8x faster); fp16 autocast is CUDA's only
            if amp == "fp16":
                raise ConfigError("train.amp: fp16 needs a CUDA device; on CPU use bf16 or none")
            return torch.bfloat16 if amp == "bf16" else None
        if amp == "none":
            return None
        return torch.float16 if amp == "fp16" else torch.bfloat16

    def _data_tokenizer(self) -> Any:
        spec = self.cfg.data.tokenizer
        if spec == "default" and self.tokenizer is not None and self.cfg.model.init == "default":
            return self.tokenizer
        return load_tokenizer(spec)

    # ----- the loop --------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its log record (losses averaged over micro-batches and
        replicas)."""
        cfg, run = self.cfg, self.cfg.train
        mcfg = self.model.config
        t = self.step
        lr = self._lr(t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        weights = cfg.loss.weights_at(t, mcfg, run.steps)
        self.optimizer.zero_grad(set_to_none=True)
        batches = []
        for micro in range(self.layout.microbatches):
            tokens, labels = self.stream.next()
            active = cfg.dropout.sample(tokens.shape[0], mcfg.num_layers, t, run.steps,
                                        micro, self.device)
            batches.append(Microbatch(tokens.to(self.device), labels.to(self.device), active))
        scale = self.scaler.scale if self.scaler is not None else None
        res = self.layout.forward_backward(batches, weights, scale)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        gnorm = self.layout.clip_grad_norm(cfg.optim.grad_clip)
        # every rank decides on the same (reduced) numbers; fp16 loss scaling skips steps
        # with overflowing gradients by itself
        apply = self.guard.allows(self.step + 1, res.loss,
                                  0.0 if self.scaler is not None else gnorm)
        if not apply:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.step += 1
        rec: dict[str, Any] = {"step": self.step, "loss": res.loss, "lr": lr, "grad_norm": gnorm}
        if not apply:
            rec["skipped"] = "non-finite"
        for k, v in sorted(res.exit_losses.items()):
            rec[f"loss_{k}"] = v
        rec["weights"] = {str(k): round(w, 6) for k, w in weights.items()}
        return rec

    def evaluate(self, model: EarlyExitLM | None = None) -> dict[str, Any]:
        """Per-exit held-out metrics (all exits the model has plus the final layer)."""

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
                    host = self.layout.host_model()
                    if main and log is not None and host is not None:
                        ev = self.evaluate(host)
                        log.write(json.dumps(ev) + "\n")
                        log.flush()
                        self._tb(writer, ev)
                    self.groups.wait_for_rank0("waiting for rank 0 to evaluate")
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
        host = self.layout.host_model()
        if host is not None:
            refuse_non_finite(host.state_dict(), f"the trained model to {self.out}")

            info = {"data": {"tokenizer": self.cfg.data.tokenizer}, "config": self.cfg.to_dict()}
            if self.cfg.tune.freeze_backbone:
                # exit tuning: only the heads changed; write them as a small bundle

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

            plot_log(self.out / "log.jsonl", self.out / "loss.png")
        self.groups.wait_for_rank0("waiting for rank 0 to save the model")

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
