"""``--resume`` never replaces a run it cannot resume, and the output directory's and the
overrides' mistakes are one clear line (issue 32)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from _robust_util import assert_clean_error, cli, run_config


def _yaml(root: Path, cfg: Any, name: str = "run.yaml") -> Path:
    file = root / name
    file.write_text(yaml.safe_dump(cfg.to_dict()))
    return file


def _digest(out: Path) -> dict[str, str]:
    """Every file under ``out`` and its content hash."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_resume_of_a_finished_run_without_checkpoints_refuses_and_keeps_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, train={"steps": 3, "checkpoint_every": 0})
    file = _yaml(tmp_path, cfg)
    assert cli(["train", "--config", file], capsys).rc == 0
    out = tmp_path / "run"
    before = _digest(out)
    assert "model/model.safetensors" in before or any(k.startswith("model/") for k in before)
    res = cli(["train", "--config", file, "--resume"], capsys)
    line = assert_clean_error(res, "--resume", "no checkpoint in", str(out / "checkpoints"),
                              "finished at step 3", str(out / "model"))
    assert "starting from step 0" not in res.out + res.err, line
    assert "--overwrite" in res.err and "model.init=" in res.err
    assert _digest(out) == before  # nothing rewritten
    # more steps asked for: still refused (there is nothing to continue from)
    res = cli(["train", "--config", file, "--resume", "train.steps=6"], capsys)
    assert_clean_error(res, "no checkpoint in", "finished at step 3")
    assert _digest(out) == before
    # the way out the hint names works
    res = cli(["train", "--config", file, "train.steps=2", "--overwrite"], capsys)
    assert res.rc == 0, res.err


def test_resume_of_a_run_stopped_before_its_first_checkpoint_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, train={"steps": 3, "checkpoint_every": 0})
    file = _yaml(tmp_path, cfg)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"run_id": "killed", "pid": 1}')
    (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    before = _digest(out)
    res = cli(["train", "--config", file, "--resume"], capsys)
    assert_clean_error(res, "no checkpoint in", "stopped at step 2 before its first checkpoint")
    assert _digest(out) == before


def test_resume_into_an_empty_directory_starts_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing to replace: --resume in a new directory is "resume if possible" and starts."""
    cfg = run_config(tmp_path, train={"steps": 2, "checkpoint_every": 0})
    res = cli(["train", "--config", _yaml(tmp_path, cfg), "--resume"], capsys)
    assert res.rc == 0, res.err
    assert "starting from step 0" in res.out


def test_resume_to_fewer_steps_than_the_checkpoint_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, train={"steps": 4, "checkpoint_every": 2})
    file = _yaml(tmp_path, cfg)
    assert cli(["train", "--config", file], capsys).rc == 0
    before = _digest(tmp_path / "run")
    res = cli(["train", "--config", file, "--resume", "train.steps=2"], capsys)
    assert_clean_error(res, "train.steps=2", "step 4")
    assert _digest(tmp_path / "run") == before


def test_overrides_on_both_sides_of_an_option_are_all_applied(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, train={"steps": 2})
    file = _yaml(tmp_path, cfg)
    res = cli(["train", "train.steps=7", "--config", file, "--resume", "optim.lr=0.5",
               "--print-config"], capsys)
    assert res.rc == 0, res.err
    printed = yaml.safe_load(res.out)
    assert printed["train"]["steps"] == 7 and printed["optim"]["lr"] == 0.5
    res = cli(["train", "--config", file, "--resume", "train.steps=3", "--bogus"], capsys)
    assert_clean_error(res, "exitlm train: error: unrecognized arguments: --bogus")
    res = cli(["train", "--config", file, "--resume", "trian.steps=3"], capsys)
    assert_clean_error(res, "trian.steps", "train")


def test_out_dir_under_a_file_is_one_line(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("not a directory")
    cfg = run_config(tmp_path, train={"steps": 2, "out_dir": str(tmp_path / "afile" / "run")})
    res = cli(["train", "--config", _yaml(tmp_path, cfg)], capsys)
    assert_clean_error(res, "train.out_dir", str(tmp_path / "afile"), "is a file")
    assert (tmp_path / "afile").read_text() == "not a directory"
