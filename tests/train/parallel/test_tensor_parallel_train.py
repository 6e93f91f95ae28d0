"""Tensor-parallel training through the Trainer: a checkpoint written at tp=2 x pp=2 resumes
at pp=2 x dp=2, then at dp=2 x tp=2 with sequence parallelism, then in one process, as if
never interrupted; ``torchrun ... -m exitlm train ... parallel.tp=2`` logs the single-process
per-exit losses and writes an ordinary exitlm model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _jobs import job_config, spawn_jobs, torchrun_train
from exitlm.config import ConfigError
from exitlm.io import load_model
from exitlm.train.trainer import Trainer

STEPS = {"steps": 5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tptrain")
    spawn_jobs(4, root, [
        # tp=2 x pp=2, stopped at step 2 (a checkpoint there), as a crash would
        {"out": "resumed", "tag": "tp2pp2", "parallel": {"pp": 2, "tp": 2}, "until": 2,
         "train": STEPS},
        # resumed at tp=1, pp=2, dp=2 (half the rows per replica: the same global batch)
        {"out": "resumed", "tag": "pp2dp2", "parallel": {"pp": 2, "dp": 2}, "resume": True,
         "until": 3, "train": {**STEPS, "batch_size": 1, "checkpoint_every": 1}},
        # resumed into dp=2 x tp=2 with sequence parallelism
        {"out": "resumed", "tag": "dp2tp2", "resume": True, "until": 4,
         "parallel": {"dp": 2, "tp": 2, "sequence_parallel": True},
         "train": {**STEPS, "batch_size": 1, "checkpoint_every": 1}},
    ])
    return root


def test_checkpoint_resumes_across_layouts(runs: Path) -> None:
    """tp=2 x pp=2 to step 2, pp=2 x dp=2 to step 3, dp=2 x tp=2 (sequence parallel) to step
    4, one process to step 5: the losses and weights of an uninterrupted single-process run;
    the tensor-parallel steps also report the same per-exit losses."""
    straight = Trainer(job_config(runs, "straight", train=STEPS))
    ref = straight.train()
    for tag, steps in (("tp2pp2", ref[:2]), ("pp2dp2", ref[2:3]), ("dp2tp2", ref[3:4])):
        got = json.loads((runs / f"{tag}.json").read_text())["records"]
        for g, r in zip(got, steps, strict=True):
            for k in ("loss", "loss_1", "loss_2", "loss_4"):
                assert g[k] == pytest.approx(r[k], rel=1e-5), (tag, g["step"], k)
    single = Trainer(job_config(runs, "resumed", train=STEPS), resume=True)
    assert single.step == 4
    assert [r["loss"] for r in single.train()] == pytest.approx([ref[4]["loss"]], rel=1e-5)
    for name, p in straight.model.named_parameters():
        torch.testing.assert_close(dict(single.model.named_parameters())[name], p,
                                   rtol=1e-4, atol=5e-5)


def test_torchrun_tp2_logs_single_process_exit_losses(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m exitlm train ... parallel.tp=2``: every per-exit
    loss of every step equals one process's within fp32 tolerance; OUT/model is an ordinary
    exitlm model with the single-process weights."""
    train = {"steps": 3, "checkpoint_every": 0}
    log = torchrun_train(tmp_path, job_config(tmp_path, "cli", train=train), ["parallel.tp=2"],
                         timeout=240)
    single = Trainer(job_config(tmp_path, "one", train=train))
    ref = single.train()
    assert [r["step"] for r in log] == [1, 2, 3]
    keys = sorted(k for k in ref[0] if k.startswith("loss_"))
    assert keys == ["loss_1", "loss_2", "loss_4"]
    for got, want in zip(log, ref, strict=True):
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (got["step"], k)
    model = load_model(str(tmp_path / "cli" / "model")).model
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p.detach(),
                                   rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bad_tensor_parallel_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tp=3 does not divide model\.num_heads"):
        from exitlm.plan.sharding import check_even as check_tensor_parallel

        check_tensor_parallel(job_config(tmp_path, "x").model.preset_config(), 3)
    with pytest.raises(ConfigError, match=r"parallel\.pp x parallel\.dp x parallel\.tp"):
        Trainer(job_config(tmp_path, "bad", {"tp": 2, "dp": 1}))  # one process, tp=2
    with pytest.raises(ConfigError, match=r"parallel\.tp"):
        job_config(tmp_path, "bad2", {"tp": 0})
