"""exitlm.paths: atomic file writes (a reader sees the old file or the whole new one; a failed
write leaves the target as it was and no temporary) and the removal of temporaries that killed
writers left."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from exitlm.paths import (
    atomic_file,
    remove_stale_temps,
    temp_prefix,
    temp_target,
    write_text_atomic,
)


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def test_atomic_file_replaces_the_target_and_keeps_its_suffix(tmp_path: Path) -> None:
    target = tmp_path / "loss.png"
    target.write_bytes(b"old")
    with atomic_file(target) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name.startswith(".")
        assert temp_target(tmp.name) == ("loss.png", "tmp", os.getpid())
        assert target.read_bytes() == b"old"  # not replaced before the block ends
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_target_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    write_text_atomic(target, "{}\n")
    with pytest.raises(RuntimeError, match="compiler failed"), atomic_file(target) as tmp:
        tmp.write_text("{\"half\": ")
        raise RuntimeError("compiler failed")
    assert target.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_stale_temporaries_of_dead_writers_go_and_live_ones_stay(tmp_path: Path) -> None:
    target = tmp_path / "costs.json"
    dead = _dead_pid()
    stale = tmp_path / f".costs.json.tmp-{dead}-ab_12.json"
    stale.write_text("half")
    live = tmp_path / f"{temp_prefix('costs.json', 'tmp')}live01.json"
    live.write_text("being written")
    other = tmp_path / f".other.json.tmp-{dead}-ab_12.json"  # another target's: not ours
    other.write_text("x")
    moved = tmp_path / f".costs.json.old-{dead}-cd34"  # a previous version moved aside
    (moved / "d").mkdir(parents=True)
    removed = remove_stale_temps(target)
    assert sorted(p.name for p in removed) == sorted([stale.name, moved.name])
    assert live.exists() and other.exists() and not stale.exists()
    assert target.is_dir()  # the moved-aside version came back: target itself was missing
    assert temp_target("costs.json") is None and temp_target(".costs.json.tmp-x-1") is None


def test_the_next_write_removes_a_killed_writers_temporary(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    stale = tmp_path / f".latest.tmp-{_dead_pid()}-zz99"
    stale.write_text("step-0000")
    write_text_atomic(target, "step-00000010\n")
    assert target.read_text() == "step-00000010\n" and not stale.exists()
