"""``exitlm generate --tp T`` / ``--kv pipeline --stages P``: self-started processes and
torchrun give one process's tokens; bad settings are one line naming the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import free_port
from _ee_models import ee_model
from exitlm.cli import main
from exitlm.io import save_model

ROOT = Path(__file__).resolve().parents[3]
FLAGS = ["--strategy", "early-exit", "--threshold", "0.6", "--max-new-tokens", "12",
         "--ignore-eos", "--json", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dist") / "m"
    save_model(ee_model("linear", vocab=256), path)
    return path


def _tokens(out: str) -> list[list[int]]:
    res = json.loads(out.strip().splitlines()[-1])
    return [s["token_ids"] + s["exit_layers"] for s in res["sequences"]]


def test_self_started(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    got = {}
    for name, extra in (("one", []), ("tp", ["--tp", "2"]),
                        ("pipeline", ["--kv", "pipeline", "--stages", "2"])):
        assert main(["generate", "def f(x):", "--model", str(model_dir), *FLAGS, *extra]) == 0
        got[name] = _tokens(capsys.readouterr().out)
    assert got["tp"] == got["one"]
    assert got["pipeline"] == got["one"]
    assert any(x < 4 for x in got["one"][0][12:])  # some tokens exit early


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--kv", "pipeline"]])
def test_torchrun(model_dir: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "def f(x):", "--model", str(model_dir), *FLAGS]) == 0
    want = _tokens(capsys.readouterr().out)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "exitlm", "generate", "def f(x):",
         "--model", str(model_dir), *FLAGS, *extra, "--dist-timeout", "60"],
        capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _tokens(proc.stdout) == want


@pytest.mark.parametrize(("flags", "message"), [
    (["--strategy", "early-exit", "--kv", "pipeline", "--stages", "9"],
     "--stages 9: expected 2 to 4"),
    (["--strategy", "early-exit", "--stages", "2"], "--stages 2 applies only to --kv pipeline"),
    (["--kv", "pipeline"], "--kv does not apply to --strategy ar"),
    (["--tp", "3"], "--tp 3: expected at most the model's 2 key/value heads"),
    (["--tp", "2", "--strategy", "ppd"], "--tp runs --strategy"),
    (["--tp", "2", "--strategy", "early-exit", "--kv", "pipeline"], "--tp and --kv pipeline"),
])
def test_bad_flags(model_dir: Path, flags: list[str], message: str,
                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "x", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_stalled_stage_is_one_line(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    """A pipeline stage stopped (SIGSTOP) while decoding: one line naming its rank, status 2,
    no traceback from any process, and no stage process left behind."""
    from _stall import kill_all, stall_at

    torch.set_num_threads(1)
    pids = stall_at(monkeypatch, 3, 2)  # the last of 3 stages, at the second decoding step
    try:
        code = main(["generate", "def f(x):", "--model", str(model_dir), *FLAGS,
                     "--threshold", "1.0", "--kv", "pipeline", "--stages", "3",
                     "--dist-timeout", "4"])
    finally:
        left = kill_all(pids)
    err = capfd.readouterr().err
    assert code == 2, err
    assert len(pids) == 2 and not left
    lines = [line for line in err.splitlines() if not line.startswith("exitlm: ")]
    assert lines[0].startswith("exitlm generate: error: "), err
    assert "rank 2 did not complete within 4 s (--dist-timeout)" in lines[0], err
    assert "Traceback" not in err, err
    assert all(line.startswith("  hint: ") for line in lines[1:]), err
