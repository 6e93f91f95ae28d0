"""``exitlm cache`` lists and prunes only what exitlm wrote into its cache."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from _robust_util import assert_clean_error, cli

DAY = 86400.0


def _fill(root: Path) -> dict[str, Path]:
    """A cache with one entry of three kinds (of different ages) and foreign things."""
    model = root / "gguf" / "Tiny.Q4_1-1000-1700000000-v1"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"m" * 3000)
    data = root / "data" / ("ab" * 10)
    data.mkdir(parents=True)
    (data / "train.bin").write_bytes(b"d" * 2000)
    kernel = root / "kernels" / ("c" * 64 + ".so")
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"k" * 1000)
    now = time.time()
    for path, age in ((model, 30), (model / "model.safetensors", 30), (data, 10),
                      (data / "train.bin", 10), (kernel, 1)):
        os.utime(path, (now - age * DAY, now - age * DAY))
    foreign = {"notes": root / "gguf" / "my-notes.txt", "other": root / "other" / "x.bin",
               "top": root / "readme.txt", "kernel-like": root / "kernels" / "mine.so"}
    for p in foreign.values():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("not exitlm's")
    os.utime(foreign["notes"], (now - 90 * DAY, now - 90 * DAY))
    return {"model": model, "data": data, "kernel": kernel, **foreign}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path / "cache"))
    return _fill(tmp_path / "cache")


def _listed(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    res = cli(["cache", *args, "--json"], capsys)
    assert res.rc == 0, res.err
    return json.loads(res.out)


def test_list_shows_exitlm_entries_with_sizes(cache: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    got = _listed(capsys)
    assert {(e["kind"], e["bytes"]) for e in got["entries"]} == {
        ("models", 3000), ("data", 2000), ("kernels", 1000)}
    assert got["bytes"] == 6000
    res = cli(["cache"], capsys)
    assert res.rc == 0 and "models" in res.out and "2.9 KiB" in res.out
    assert "my-notes" not in res.out and "mine.so" not in res.out


def test_prune_by_age_and_size_removes_only_exitlm_entries(
        cache: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    dry = _listed(capsys, "prune", "--older-than", "20", "--dry-run")
    assert [Path(e["path"]) for e in dry["entries"]] == [cache["model"]]
    assert cache["model"].is_dir()  # a dry run removes nothing
    assert cli(["cache", "prune", "--older-than", "20"], capsys).rc == 0
    assert not cache["model"].exists() and cache["data"].is_dir()
    # --max-size: the oldest go first until the rest fits
    got = _listed(capsys, "prune", "--max-size", "1500")
    assert [Path(e["path"]) for e in got["entries"]] == [cache["data"]]
    assert cache["kernel"].is_file()
    assert cli(["cache", "clear"], capsys).rc == 0
    assert _listed(capsys)["entries"] == []
    for name in ("notes", "other", "top", "kernel-like"):
        assert cache[name].read_text() == "not exitlm's", name


def test_clear_of_one_kind_and_bad_arguments(cache: dict[str, Path],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["cache", "clear", "--kind", "kernels"], capsys).rc == 0
    assert not cache["kernel"].exists() and cache["model"].is_dir()
    assert_clean_error(cli(["cache", "prune", "--max-size", "lots"], capsys), "--max-size")
    assert_clean_error(cli(["cache", "--older-than", "3"], capsys), "prune")
    assert cache["model"].is_dir() and cache["data"].is_dir()


@pytest.mark.parametrize("action", ["list", "prune", "clear"])
def test_a_cache_root_that_is_a_file_is_an_error(action: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cachefile"
    root.write_text("mine")
    monkeypatch.setenv("EXITLM_CACHE", str(root))
    assert_clean_error(cli(["cache", action], capsys), str(root), "not a directory")
    assert root.read_text() == "mine"
