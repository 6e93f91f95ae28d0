"""``torch.distributed.pipelining``'s Schedule1F1B as a second gradient oracle (no exits).

Two gloo processes build the same seeded model. Each cuts its stage the way exitlm does
(:func:`~exitlm.train.parallel.pipeline.stage.build_stages`: layers ``[0, 2)`` and ``[2, 4)``),
wraps it as an ``nn.Module`` (stage 0: embedding + layers; stage 1: layers + final norm and
LM head) for ``torch.distributed.pipelining.PipelineStage`` and runs ``Schedule1F1B`` over
three microbatches. Then exitlm's :class:`~exitlm.train.parallel.pipeline.engine.PipelineEngine`
(1F1B, final loss only) runs on a second copy of the model with the same microbatches.

Loss scaling: exitlm multiplies each microbatch's mean cross-entropy by ``1 / M``; torch's
schedules with ``scale_grads=True`` (the default) divide every gradient by ``M`` after the
step instead, so the torch loss function is the plain per-microbatch mean cross-entropy.

Both gradients must equal each other and a single-process autograd reference of
``sum_m CE_m / M``.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from _dist import free_port, run_processes
from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.pipeline.engine import PipelineEngine
from exitlm.train.parallel.pipeline.executor import Microbatch
from exitlm.train.parallel.pipeline.stage import StageModule, build_stages, prune_to_stage

PP = 2
M = 3  # microbatches
BATCH = 2  # rows per microbatch
SEQ = 12


def _model() -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(layers=()), dim=32, num_heads=2, num_kv_heads=2,
                 hidden_dim=64, vocab_size=64, tie_embeddings=False)
    torch.manual_seed(1234)
    return EarlyExitLM(cfg)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 64, (M * BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]  # tokens, labels: (M*B, T)


def _mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _grads(model: EarlyExitLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _worker(rank: int, world: int, port: int, root: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        tokens, labels = _data()
        # --- torch.distributed.pipelining ------------------------------------------------
        ref_model = _model()
        spec = build_stages(ref_model, PP)[rank]
        prune_to_stage(ref_model, spec)
        stage = PipelineStage(StageModule(ref_model, spec), rank, PP, torch.device("cpu"))
        sched = Schedule1F1B(stage, n_microbatches=M, loss_fn=_mean_ce, scale_grads=True)
        if spec.first:
            sched.step(tokens)
        else:
            sched.step(target=labels)
        dist.barrier()
        # --- exitlm ----------------------------------------------------------------------
        model = _model()
        grid = ParallelDims.build(world, rank, PP, 1)
        eng = PipelineEngine(model, ParallelConfig(pp=PP, dp=1, schedule="1f1b"), grid,
                             microbatches=M, slices=(SEQ,), device=torch.device("cpu"))
        batches = [Microbatch(t, y) for t, y in zip(tokens.chunk(M), labels.chunk(M),
                                                     strict=True)]
        eng.run(batches, {model.num_layers: 1.0})
        save_file(_grads(ref_model), str(Path(root) / f"torch{rank}.safetensors"))
        save_file(_grads(model), str(Path(root) / f"ours{rank}.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(root: Path, timeout: float = 120.0) -> None:
    run_processes(_worker, (PP, free_port(), str(root)), PP, timeout, "pipelining workers")


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    tokens, labels = _data()
    for t, y in zip(tokens.chunk(M), labels.chunk(M), strict=True):
        (_mean_ce(model(t).logits, y) / M).backward()
    return _grads(model)


def test_torch_schedule_1f1b_matches_engine(tmp_path: Path) -> None:
    _spawn(tmp_path)
    ref = _reference()
    seen: set[str] = set()
    for rank in range(PP):
        theirs = load_file(str(tmp_path / f"torch{rank}.safetensors"))
        ours = load_file(str(tmp_path / f"ours{rank}.safetensors"))
        assert theirs.keys() == ours.keys(), (rank, sorted(theirs), sorted(ours))
        assert theirs, f"rank {rank} holds no gradient"
        for name, g in ours.items():
            torch.testing.assert_close(g, theirs[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"ours vs torch {n}: {m}")
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"ours vs reference {n}: {m}")
            torch.testing.assert_close(theirs[name], ref[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"torch vs reference {n}: {m}")
            seen.add(name)
    assert seen == set(ref), sorted(set(ref) ^ seen)
