"""Pipeline-parallel training through the Trainer: the same losses and weights as one
process, checkpoints that resume under another layout, the torchrun CLI, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _jobs import job_config, same_params, spawn_jobs, torchrun_train
from _train_util import tiny_config
from exitlm.config import ConfigError
from exitlm.train.trainer import Trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pptrain")
    spawn_jobs(4, root, [
        {"out": "pp4", "parallel": {"pp": 4}, "until": 2},  # stopped at 2, as a crash would
        {"out": "pp2dp2", "parallel": {"pp": 2, "dp": 2, "token_slices": 2},
         "train": {"steps": 3, "checkpoint_every": 0}},
    ])
    spawn_jobs(2, root, [
        {"out": "pp2", "parallel": {"pp": 2, "schedule": "gpipe", "token_slices": [20, 12],
                                    "deferred_exits": False}},
        {"out": "pp4", "parallel": {"pp": 2}, "resume": True, "until": 3,  # P=4 -> P=2
         "train": {"checkpoint_every": 1}},
    ])
    return root


def test_pipeline_training_matches_single_process(runs: Path) -> None:
    got = json.loads((runs / "pp2.json").read_text())
    single = Trainer(job_config(runs, "single"))
    recs = single.train()
    assert [r["loss"] for r in recs] == pytest.approx(got["losses"], rel=1e-5)
    assert [r["loss_1"] for r in recs] == pytest.approx(got["exit1"], rel=1e-5)
    same_params(got, single.model)
    assert (runs / "pp2" / "model" / "model.safetensors").is_file()
    assert (runs / "pp2" / "loss.png").is_file()


def test_dp_times_pp_matches_single_process_on_the_combined_batch(runs: Path) -> None:
    got = json.loads((runs / "pp2dp2.json").read_text())
    single = Trainer(job_config(runs, "single-b4", train={"batch_size": 4, "steps": 3,
                                                    "checkpoint_every": 0}))
    recs = single.train()
    assert [r["loss"] for r in recs] == pytest.approx(got["losses"], rel=1e-5)
    same_params(got, single.model)


def test_checkpoint_resumes_with_another_layout(runs: Path) -> None:
    """Written by 4 stages at step 2, resumed by 2 stages to step 3, then by one process to
    step 4: the same losses and weights as an uninterrupted single-process run."""
    straight = Trainer(job_config(runs, "straight"))
    ref = straight.train()
    via_pp2 = json.loads((runs / "pp4.json").read_text())
    assert via_pp2["losses"] == pytest.approx([ref[2]["loss"]], rel=1e-5)
    single = Trainer(job_config(runs, "pp4"), resume=True)
    assert single.step == 3
    rest = single.train()
    assert [r["loss"] for r in rest] == pytest.approx([ref[3]["loss"]], rel=1e-5)
    for name, p in straight.model.named_parameters():
        torch.testing.assert_close(dict(single.model.named_parameters())[name], p,
                                   rtol=1e-4, atol=1e-5)


def test_bad_pipeline_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pp x parallel\.dp"):
        Trainer(job_config(tmp_path, "bad1", {"pp": 2, "dp": 1}))  # one process, pp=2
    with pytest.raises(ConfigError, match="token_slices"):
        Trainer(job_config(tmp_path, "bad2", {"token_slices": [10, 10]}))  # sums to 20, not 32
    with pytest.raises(ConfigError, match="dropout"):
        tiny = tiny_config(tmp_path, "bad3", parallel={"token_slices": 2},
                           dropout={"p_max": 0.2})
        Trainer(tiny)
    with pytest.raises(ConfigError, match=r"parallel\.schedule"):
        job_config(tmp_path, "bad4", {"schedule": "interleaved"})


def test_single_process_token_slicing_trains_like_no_slicing(tmp_path: Path) -> None:
    a = Trainer(job_config(tmp_path, "a", train={"steps": 2, "checkpoint_every": 0}))
    b = Trainer(job_config(tmp_path, "b", {"token_slices": "auto"},
                     train={"steps": 2, "checkpoint_every": 0}))
    assert len(b.layout.engine.schedule.slices) >= 1
    assert [r["loss"] for r in a.train()] == pytest.approx([r["loss"] for r in b.train()],
                                                           rel=1e-5)


def test_torchrun_cli(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m exitlm train ... parallel.pp=2``."""
    cfg = job_config(tmp_path, "cli", train={"steps": 2, "checkpoint_every": 0})
    log = torchrun_train(tmp_path, cfg, ["parallel.pp=2", "parallel.schedule=1f1b",
                                         "parallel.token_slices=2"], timeout=180)
    assert [r["step"] for r in log] == [1, 2]
    assert (tmp_path / "cli" / "model" / "model.safetensors").is_file()
