"""Training runs never mix: one writer per output directory, a run identity checked on
resume, explicit opt-ins for changed models, and no non-finite weights ever saved."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _robust_util import ROOT, assert_clean_error, cli, leftovers, run_config
from safetensors.torch import load_file

from exitlm.errors import ExitlmError, ExitlmWarning
from exitlm.train.checkpoint import checkpoints
from exitlm.train.trainer import Trainer

SHORT: dict[str, Any] = {"train": {"steps": 4, "checkpoint_every": 2}}


def _yaml(root: Path, cfg: Any) -> Path:
    file = root / f"{Path(cfg.train.out_dir).name}.yaml"
    file.write_text(yaml.safe_dump(cfg.to_dict()))
    return file


def _log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_new_run_into_an_old_run_is_refused_then_overwritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, **SHORT)
    file = _yaml(tmp_path, cfg)
    assert cli(["train", "--config", file], capsys).rc == 0
    out = tmp_path / "run"
    (out / "notes.txt").write_text("mine")
    log_before = (out / "log.jsonl").read_text()
    res = cli(["train", "--config", file, "optim.lr=0.002"], capsys)
    assert_clean_error(res, str(out), "already holds a training run", "checkpoints")
    assert "--resume" in res.err and "--overwrite" in res.err
    assert (out / "log.jsonl").read_text() == log_before
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert cli(["train", "--config", file, "optim.lr=0.002", "--overwrite"], capsys).rc == 0
    assert json.loads((out / "run.json").read_text())["run_id"] != run_id
    assert (out / "notes.txt").read_text() == "mine"  # not exitlm's: untouched
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]  # one run's records only
    assert not leftovers(out)


def test_two_runs_at_once_the_second_fails(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A second run into a directory a live run writes to fails at once; killing the first
    with -9 releases the directory (the lock dies with the process)."""
    cfg = run_config(tmp_path, train={"steps": 100000, "checkpoint_every": 2})
    file = _yaml(tmp_path, cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "exitlm", "train", "--config", str(file)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        while not checkpoints(out):
            assert first.poll() is None, first.stderr.read().decode() if first.stderr else ""
            assert time.monotonic() < deadline, "the first run never checkpointed"
            time.sleep(0.2)
        for extra in ([], ["--resume"], ["--overwrite"]):
            res = cli(["train", "--config", file, *extra], capsys)
            assert_clean_error(res, "in use by another exitlm run", f"process {first.pid}")
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait()
    resumed = Trainer(run_config(tmp_path, train={"steps": 100000, "checkpoint_every": 2}),
                      resume=True, allow_changes=True)
    assert resumed.step >= 2
    assert cli(["train", "--config", file, "--overwrite", "train.steps=2"], capsys).rc == 0


def test_resume_refuses_another_runs_checkpoints(tmp_path: Path) -> None:
    cfg = run_config(tmp_path, **SHORT)
    Trainer(cfg).train(until_step=3)
    run_file = tmp_path / "run" / "run.json"
    info = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({**info, "run_id": "someone-else"}))
    with pytest.raises(ExitlmError, match=r"belongs to run .* records run someone-else"):
        Trainer(cfg, resume=True)
    run_file.unlink()  # adopting the checkpoints is the documented way out
    assert Trainer(cfg, resume=True).step == 2


def test_resume_with_changed_settings(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, **SHORT)
    Trainer(cfg).train(until_step=3)
    file = _yaml(tmp_path, cfg)
    res = cli(["train", "--config", file, "--resume", "data.val_fraction=0.3"], capsys)
    assert_clean_error(res, "--resume", "data.val_fraction: 0.2 -> 0.3")
    assert "--allow-changes" in res.err
    # settings outside model/data (steps, lr, logging...) may change freely
    assert cli(["train", "--config", file, "--resume", "train.steps=5"], capsys).rc == 0
    assert [r["step"] for r in _log(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_resume_with_more_layers_needs_an_explicit_opt_in(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, **SHORT)
    Trainer(cfg).train(until_step=3)
    file = _yaml(tmp_path, cfg)
    deeper = "model.overrides.num_layers=5"
    res = cli(["train", "--config", file, "--resume", deeper], capsys)
    assert_clean_error(res, "model.overrides.num_layers: None -> 5")
    res = cli(["train", "--config", file, "--resume", deeper, "--allow-changes"], capsys)
    assert_clean_error(res, "step-00000002", "lacks", "layers.4.")
    assert "--init-missing" in res.err
    res = cli(["train", "--config", file, "--resume", deeper, "--init-missing"], capsys)
    assert res.rc == 0, res.err
    assert "exitlm: warning: --init-missing" in res.err and "layers.4.attn" in res.err
    events = [r for r in _log(tmp_path / "run") if r.get("event") == "init_missing"]
    assert events and any(t.startswith("layers.4.") for t in events[0]["tensors"])
    assert cli(["train", "--config", file, "--init-missing"], capsys).rc == 2


def test_non_finite_loss_stops_the_run_and_nothing_non_finite_is_saved(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, optim={"lr": 1e30, "warmup_steps": 0},
                     train={"steps": 6, "checkpoint_every": 1})
    res = cli(["train", "--config", _yaml(tmp_path, cfg)], capsys)
    assert_clean_error(res, "step 2: the loss is", "nan", "stopped before applying the update")
    assert "train.on_nonfinite=skip" in res.err
    out = tmp_path / "run"
    assert not (out / "model").exists()
    for ckpt in checkpoints(out):
        for name, t in load_file(str(ckpt / "model.safetensors")).items():
            assert torch.isfinite(t).all(), f"{ckpt.name}: {name}"
    assert not leftovers(out)


class _PoisonAt(torch.nn.Module):
    """The training module, returning a NaN loss at the chosen steps."""

    def __init__(self, trainer: Trainer, steps: set[int]) -> None:
        super().__init__()
        self.inner, self.trainer, self.steps = trainer.layout.module, trainer, steps

    def forward(self, *args: Any) -> Any:
        loss, per_exit = self.inner(*args)
        if self.trainer.step + 1 in self.steps:
            loss = loss * math.nan
        return loss, per_exit


def test_skip_policy_drops_the_bad_step(tmp_path: Path) -> None:
    ref = Trainer(run_config(tmp_path, "ref", train={"steps": 4}))
    ref_recs = ref.train()
    t = Trainer(run_config(tmp_path, "skip", train={"steps": 4, "on_nonfinite": "skip"}))
    t.layout.module = _PoisonAt(t, {3})
    with pytest.warns(ExitlmWarning, match="step 3.*update skipped"):
        recs = t.train()
    assert [r.get("skipped") for r in recs] == [None, None, "non-finite", None]
    assert [r["loss"] for r in recs[:2]] == pytest.approx([r["loss"] for r in ref_recs[:2]])
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert (tmp_path / "skip" / "model" / "model.safetensors").is_file()


def test_error_policy_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    t = Trainer(run_config(tmp_path, train={"steps": 4, "checkpoint_every": 1}))
    t.layout.module = _PoisonAt(t, {3})
    with pytest.raises(ExitlmError, match="step 3: the loss is nan"):
        t.train()
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step-00000002",
                                                                "step-00000001"]
    assert Trainer(run_config(tmp_path, train={"steps": 4, "checkpoint_every": 1}),
                   resume=True).step == 2


def test_saving_non_finite_weights_is_refused(tmp_path: Path) -> None:
    t = Trainer(run_config(tmp_path, train={"steps": 1}))
    with torch.no_grad():
        t.model.layers[0].mlp.w_out.weight[0, 0] = math.inf
    with pytest.raises(ExitlmError, match=r"refusing to save.*layers\.0\.mlp\.w_out\.weight"):
        t.save()
    assert not checkpoints(tmp_path / "run")


@pytest.mark.parametrize("flag", ["--overwrite", None, "--resume"])
def test_files_named_like_outputs_without_a_run_are_never_deleted(
        flag: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory that never held an exitlm run (no run.json) but has files with the names of
    a run's outputs: every start refuses it, naming them, and deletes nothing."""
    out = tmp_path / "usermodel"
    (out / "model").mkdir(parents=True)
    (out / "model" / "mine.txt").write_text("mine")
    (out / "log.jsonl").write_text("log\n")
    cfg = run_config(tmp_path, "usermodel", train={"steps": 1})
    res = cli(["train", "--config", _yaml(tmp_path, cfg), *([flag] if flag else [])], capsys)
    assert_clean_error(res, str(out), "log.jsonl, model", "no run.json")
    assert (out / "model" / "mine.txt").read_text() == "mine"
    assert (out / "log.jsonl").read_text() == "log\n"
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl", "model"]


def test_overwrite_checks_for_the_run_again_when_it_starts_writing(tmp_path: Path) -> None:
    """The run's identity is checked again under the lock: outputs that appeared without a
    run.json after the checks are not deleted either."""
    out = tmp_path / "run"
    trainer = Trainer(run_config(tmp_path, train={"steps": 1}), overwrite=True)
    (out / "model").mkdir(parents=True)
    (out / "model" / "mine.txt").write_text("mine")
    with pytest.raises(ExitlmError, match=r"no run\.json"):
        trainer.train()
    assert (out / "model" / "mine.txt").read_text() == "mine"
