"""Folders exitlm must create but cannot (a run's out_dir, the cache's, a data cache_dir): one
line naming the folder and the system's reason, exit status 2, nothing of the user's touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from _robust_util import assert_clean_error, cli, needs_linux_sys, run_config


def _yaml(root: Path, cfg: object) -> Path:
    file = root / "tiny.yaml"
    file.write_text(yaml.safe_dump(cfg.to_dict()))  # type: ignore[attr-defined]
    return file


@needs_linux_sys
def test_train_out_dir_the_system_refuses(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path, train={"steps": 1})
    res = cli(["train", "-c", _yaml(tmp_path, cfg), "train.out_dir=/sys/exitlm-test-run"],
              capsys)
    assert_clean_error(res, "train.out_dir /sys/exitlm-test-run: cannot create it (")


@pytest.mark.parametrize("where", [pytest.param("/proc/exitlm-test-run", marks=needs_linux_sys),
                                   "under-a-file"])
def test_train_out_dir_is_checked_before_the_model_and_the_data(
        where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The out_dir is refused before the model is built and the data read: with data that
    does not exist, the error is still about the out_dir, and nothing is created."""
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "run" if where == "under-a-file" else Path(where)
    cfg = run_config(tmp_path, train={"steps": 1})
    file = _yaml(tmp_path, cfg)
    before = sorted(tmp_path.rglob("*"))
    res = cli(["train", "-c", file, f"train.out_dir={out}",
               f"data.paths=[{tmp_path / 'no-such-data'}]"], capsys)
    assert_clean_error(res, "train.out_dir", str(out), "cannot")
    assert sorted(tmp_path.rglob("*")) == before and not out.exists()


@pytest.mark.parametrize("root", ["a-file", pytest.param("/sys/exitlm-test-cache",
                                                          marks=needs_linux_sys)])
def test_train_and_eval_with_a_cache_that_cannot_be_created(
        root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "cachefile"
    afile.write_text("mine")
    cache = afile if root == "a-file" else Path(root)
    monkeypatch.setenv("EXITLM_CACHE", str(cache))
    cfg = run_config(tmp_path, train={"steps": 1})
    res = cli(["train", "-c", _yaml(tmp_path, cfg), "data.cache_dir=null"], capsys)
    line = assert_clean_error(res, f"{cache / 'data'}", "cannot create it (")
    assert "EXITLM_CACHE" in res.err  # the hint says which setting to change
    if root == "a-file":
        assert f"{afile} is a file" in line
        res = cli(["eval", "debug", "--max-samples", "1"], capsys)
        assert_clean_error(res, f"{cache / 'data'}", f"{afile} is a file")
    assert afile.read_text() == "mine" and not (tmp_path / "run").exists()


def test_data_cache_dir_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("mine")
    cfg = run_config(tmp_path, train={"steps": 1})
    res = cli(["train", "-c", _yaml(tmp_path, cfg), f"data.cache_dir={tmp_path}/afile/c"],
              capsys)
    assert_clean_error(res, "data.cache_dir", f"{tmp_path / 'afile'} is a file")
    assert (tmp_path / "afile").read_text() == "mine"
