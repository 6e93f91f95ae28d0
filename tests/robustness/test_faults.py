"""Faults: ``kill -9`` at several points of checkpointing, a torn log line, a damaged latest
checkpoint. Each time ``--resume`` reproduces the uninterrupted run's losses exactly, and the
next successful run leaves no temporary files behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _robust_util import ROOT, leftovers, run_config

from exitlm.errors import ExitlmWarning
from exitlm.train.checkpoint import checkpoints
from exitlm.train.trainer import Trainer

EXTRA: dict[str, Any] = {"train": {"checkpoint_every": 2, "keep_checkpoints": 1},
                         "dropout": {"p_max": 0.5, "seed": 3}}
CRASH = Path(__file__).with_name("_crash_run.py")


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root: Path) -> dict[int, float]:
    """The uninterrupted run's loss per step."""
    Trainer(run_config(root, "reference", **EXTRA)).train()
    losses = _losses(root / "reference")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return losses


def _check_resumed(out: Path, cfg: Any, reference: dict[int, float]) -> None:
    resumed = Trainer(cfg, resume=True)
    resumed.train()
    assert _losses(out) == pytest.approx(reference, rel=1e-6, abs=1e-7)
    assert not leftovers(out), leftovers(out)
    assert (out / "model" / "model.safetensors").is_file()
    assert [p.name for p in checkpoints(out)] == ["step-00000006"]


CRASH_POINTS = [
    ("after-step", 3),                    # between checkpoints
    ("before-model.safetensors", 2),      # empty temporary checkpoint directory
    ("before-optimizer.safetensors", 2),  # half-written temporary checkpoint
    ("before-rename", 2),                 # complete temporary, not in place
    ("latest-tmp-created", 2),            # 0-byte temporary pointer file
    ("mid-prune", 1),                     # an old checkpoint half deleted
]


@pytest.mark.parametrize(("point", "nth"), CRASH_POINTS, ids=[p for p, _ in CRASH_POINTS])
def test_kill_9_then_resume(point: str, nth: int, root: Path,
                            reference: dict[int, float]) -> None:
    out = f"crash-{point}"
    cfg = run_config(root, out, **EXTRA)
    cfg_file = root / f"{out}.json"
    cfg_file.write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests" / "train"),
         *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(CRASH), str(cfg_file), point, str(nth)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == -9, proc.stderr  # killed at the point, as planned
    debris = leftovers(root / out)
    assert bool(debris) == (point != "after-step"), debris  # the kill left what it should
    _check_resumed(root / out, cfg, reference)


def test_torn_log_line(root: Path, reference: dict[int, float]) -> None:
    """Power loss while a log line was written: the torn line is dropped on resume."""
    cfg = run_config(root, "torn", **EXTRA)
    Trainer(cfg).train(until_step=5)
    with open(root / "torn" / "log.jsonl", "a", encoding="utf-8") as log:
        log.write('{"step": 6, "loss": 4.1')  # no closing brace, no newline
    _check_resumed(root / "torn", cfg, reference)


@pytest.mark.parametrize("damage", ["flip", "truncate", "state", "missing"])
def test_damaged_latest_checkpoint_falls_back(damage: str, root: Path,
                                              reference: dict[int, float]) -> None:
    extra = {**EXTRA, "train": {"checkpoint_every": 2, "keep_checkpoints": 2}}
    cfg = run_config(root, f"damaged-{damage}", **extra)
    out = root / f"damaged-{damage}"
    Trainer(cfg).train(until_step=5)
    latest = checkpoints(out)[0]
    assert latest.name == "step-00000004"
    if damage == "flip":  # bytes changed in the middle: only the checksum notices
        f = latest / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f = latest / "optimizer.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "state":
        (latest / "state.json").write_text('{"version": 1, "step": ')
    else:
        (latest / "model.safetensors").unlink()
    with pytest.warns(ExitlmWarning, match="falling back"):
        resumed = Trainer(cfg, resume=True)
    assert resumed.step == 2
    resumed.train()
    assert _losses(out) == pytest.approx(reference, rel=1e-6, abs=1e-7)
    assert not leftovers(out)
    assert [p.name for p in checkpoints(out)] == ["step-00000006", "step-00000004"]


def test_killed_preprocessing_leaves_nothing(tmp_path: Path) -> None:
    """Token files a killed preprocessing run left (``*.bin.tmp-PID``, here empty) go when
    the corpus is next prepared."""
    from exitlm.train.data import data_dir_for, prepare

    cfg = run_config(tmp_path).data
    out = data_dir_for(cfg)
    out.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = out / f"train.bin.tmp-{int(dead.stdout)}"
    stale.write_bytes(b"")
    prepare(cfg, progress=False)
    assert not stale.exists()
    assert (out / "meta.json").is_file() and not leftovers(out)
