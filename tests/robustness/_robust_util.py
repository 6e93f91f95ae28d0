"""Helpers of the robustness suite: run the CLI (in this process or in a bounded subprocess),
check that an error is one clear line, build tiny checkpoints and runs."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from exitlm.cli import main
from exitlm.config import ExitConfig, preset
from exitlm.io import save_model
from exitlm.model.transformer import EarlyExitLM

ROOT = Path(__file__).resolve().parents[2]
from _train_util import tiny_config  # noqa: E402

GIB = 2**30
ON_LINUX_SYS = sys.platform.startswith("linux") and Path("/sys/kernel").is_dir()
"""Whether /sys and /proc are Linux's: nothing can be created in them, not even by root."""
needs_linux_sys = pytest.mark.skipif(not ON_LINUX_SYS, reason="needs Linux's /sys and /proc")
# Temporaries exitlm creates for atomic writes; none may survive a successful run.
TEMP_NAME = re.compile(r"(^\..+\.(tmp|old)-)|(\.tmp(-\d+)?$)")


@dataclass
class Result:
    """Exit status and output of one ``exitlm`` command."""

    rc: int
    out: str
    err: str


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> Result:
    """``exitlm ARGS`` in this process (fast); any exception escaping ``main`` fails the
    test, as it would print a traceback."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as stop:  # argparse errors
        rc = int(stop.code or 0)
    got = capsys.readouterr()
    return Result(rc, got.out, got.err)


def cli_subprocess(args: list[str], *, memory_gib: float = 3.0, timeout: float = 120.0,
                   env: dict[str, str] | None = None) -> Result:
    """``python -m exitlm ARGS`` in a child process whose address space is limited to
    ``memory_gib`` (the risky inputs: unbounded allocation becomes a MemoryError there, not
    a machine running out of memory) and whose run time is limited to ``timeout``."""
    limit = int(memory_gib * GIB)

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "exitlm", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, preexec_fn=bound,
                          env=full_env, cwd=str(ROOT), check=False)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_error(res: Result, *needles: str, rc: int = 2) -> str:
    """The command failed with status ``rc``, printed no traceback, and its error is one
    ``exitlm ...: error: ...`` line (plus at most a hint line) containing every needle.
    Returns the error line."""
    assert res.rc == rc, f"exit status {res.rc}, stderr:\n{res.err}"
    assert "Traceback" not in res.err, res.err
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"exitlm( [a-z-]+)*: error: ", ln)]
    assert len(errors) == 1, f"expected one error line, stderr:\n{res.err}"
    notes = [ln for ln in lines if ln.startswith("exitlm: ") and ln not in errors]
    extra = [ln for ln in lines
             if ln not in errors and ln not in notes and not ln.startswith("  hint: ")]
    assert not extra, f"unexpected output besides the error:\n{res.err}"
    line = errors[0]
    for needle in needles:
        assert needle in line, f"{needle!r} not in the error line: {line}"
    return line


def tiny_model(exits: tuple[int, ...] = (1,)) -> EarlyExitLM:
    """A 2-layer, dim-32 model (seeded)."""
    torch.manual_seed(0)
    cfg = preset("debug", dim=32, num_layers=2, num_heads=2, num_kv_heads=2, hidden_dim=64,
                 exits=ExitConfig(layers=exits))
    return EarlyExitLM(cfg).eval()


def tiny_checkpoint(path: Path, **kwargs: Any) -> Path:
    """An exitlm checkpoint directory of :func:`tiny_model`."""
    return save_model(tiny_model(**kwargs), path)


def edit_json(file: Path, **changes: Any) -> None:
    """Set keys of a JSON object file (``None`` values are written as null)."""
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def leftovers(root: Path) -> list[Path]:
    """Temporary files/directories and empty files under ``root`` (none should remain)."""
    out = []
    for p in root.rglob("*"):
        if TEMP_NAME.search(p.name) or (p.is_file() and p.stat().st_size == 0):
            out.append(p)
    return out


def run_config(root: Path, out: str = "run", **sections: dict[str, Any]) -> Any:
    """The tiny training config of the trainer tests, without progress bars."""
    return tiny_config(root, out, **sections)
