"""Project hygiene: the README's commands, CI, ruff."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from _readme import quickstart_commands

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quickstart_is_two_commands() -> None:
    cmds = quickstart_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds), "each quickstart command is one line"
    assert "exitlm generate" in cmds[0]
    # the shipped LayerSkip model's speed-up over plain decoding, shown at once (issue #30)
    assert "--model layerskip-code --strategy self-spec --compare" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quickstart_commands()[1] in ci


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean() -> None:
    res = subprocess.run(
        ["ruff", "check", "--no-cache", "src", "tests", "benchmarks", "device"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_test_module_basenames_are_unique() -> None:
    """Test folders have no ``__init__.py`` (rootdir-style imports), so two test files with
    the same name in different folders break collection; keep basenames unique."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path


def test_every_shipped_config_loads() -> None:
    from exitlm.train.config import load_config

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(str(path))
        assert cfg.train.steps >= 1, path
    assert load_config(str(ROOT / "configs" / "scratch-ee-pipeline.yaml")).parallel.pp == 2
