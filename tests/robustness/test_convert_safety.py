"""``exitlm convert`` (and every checkpoint writer) never deletes what exitlm did not write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _robust_util import assert_clean_error, cli, leftovers, needs_linux_sys, tiny_checkpoint

from exitlm.io import load_model, save_model
from exitlm.io.hf_map import CheckpointError


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return tiny_checkpoint(tmp_path / "work" / "ckpt")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_refuses_a_directory_with_foreign_files(ckpt: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "thesis"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    (dst / "figures").mkdir()
    res = cli(["convert", ckpt, dst], capsys)
    assert_clean_error(res, str(dst), "thesis.tex", "did not write")
    assert "--overwrite" in res.err
    assert (dst / "thesis.tex").read_text() == "years of work" and (dst / "figures").is_dir()
    # refused before anything was written next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis", "work"]


def test_a_users_checkpoint_with_exitlm_file_names_is_refused(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """File names alone do not make a directory exitlm's: a user's own config.json (and
    weights) without exitlm's marker are refused; a link is not replaced by a directory."""
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "config.json").write_text('{"my": "important settings"}')
    (dst / "model.safetensors").write_bytes(b"user weights")
    before = _snapshot(dst)
    assert_clean_error(cli(["convert", ckpt, dst], capsys), str(dst), "no exitlm marker")
    assert _snapshot(dst) == before
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert_clean_error(cli(["convert", ckpt, link], capsys), str(link), "symbolic link")
    assert link.is_symlink()


@pytest.mark.parametrize("to", ["exitlm", "hf"])
def test_exitlms_own_output_is_replaced_without_overwrite(
        to: str, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out"
    assert cli(["convert", ckpt, dst, "--to", to], capsys).rc == 0
    assert cli(["convert", ckpt, dst, "--to", to], capsys).rc == 0


def test_overwrite_replaces_it(ckpt: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "old"
    dst.mkdir()
    (dst / "junk.txt").write_text("x")
    assert cli(["convert", ckpt, dst, "--overwrite"], capsys).rc == 0
    assert not (dst / "junk.txt").exists() and (dst / "model.safetensors").is_file()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("where", ["parent", "same", "grandparent"])
def test_never_the_source_or_a_directory_containing_it(
        where: str, overwrite: bool, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = {"parent": ckpt.parent, "same": ckpt, "grandparent": ckpt.parent.parent}[where]
    before = _snapshot(dst)
    res = cli(["convert", ckpt, dst, *(["--overwrite"] if overwrite else [])], capsys)
    assert_clean_error(res, "source", str(ckpt))
    assert _snapshot(dst) == before
    load_model(str(ckpt))  # the source is intact


def test_symlinked_parent_is_recognised(ckpt: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "link"
    link.symlink_to(ckpt.parent, target_is_directory=True)
    assert_clean_error(cli(["convert", ckpt, link, "--overwrite"], capsys), "source")
    assert (ckpt / "model.safetensors").is_file()


def test_a_previous_conversion_may_be_replaced(ckpt: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out"
    assert cli(["convert", ckpt, dst], capsys).rc == 0
    assert cli(["convert", ckpt, dst, "--to", "hf"], capsys).rc == 0  # exitlm's own files
    assert (dst / "exitlm_exits.json").is_file()
    assert cli(["convert", ckpt, dst], capsys).rc == 0
    assert not (dst / "exitlm_exits.json").exists()


def test_destination_that_is_a_file(ckpt: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "model.txt"
    f.write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert_clean_error(cli(["convert", ckpt, f, *extra], capsys), str(f), "not a directory")
    assert f.read_text() == "mine"


@pytest.mark.parametrize("where", [
    "under-a-file", pytest.param("/sys/exitlm-test", marks=needs_linux_sys),
    pytest.param("/proc/exitlm-test", marks=needs_linux_sys)])
def test_destination_that_cannot_be_created(where: str, ckpt: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A destination the system will not create is one line naming it and the reason."""
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    dst = afile / "out" if where == "under-a-file" else Path(where)
    reason = "afile.txt is a file" if where == "under-a-file" else "("
    assert_clean_error(cli(["convert", ckpt, dst], capsys), str(dst), "cannot create it",
                       reason)
    assert afile.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile.txt", "work"]


@pytest.mark.parametrize("where", [
    "under-a-file", pytest.param("/proc/exitlm-test", marks=needs_linux_sys)])
def test_destination_is_checked_before_the_source_is_loaded(
        where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DST that cannot be created is refused before the (slow) load: with a source that
    would not load, the error is still about DST."""
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    dst = afile / "out" if where == "under-a-file" else Path(where)
    assert_clean_error(cli(["convert", broken, dst], capsys), str(dst), "cannot create it")
    assert sorted(os.listdir(tmp_path)) == ["afile.txt", "broken"]


def test_a_failed_write_leaves_no_folders_it_made(ckpt: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way (a disk that fills up) removes its temporary and the
    folders it created on the way to its target; folders that were there stay."""
    import exitlm.io.native as native

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    loaded = load_model(str(ckpt))
    monkeypatch.setattr(native, "write_safetensors", full)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="No space left"):
        save_model(loaded, tmp_path / "out" / "new" / "deeper" / "dst")
    assert sorted(os.listdir(tmp_path)) == ["out", "work"] and not os.listdir(tmp_path / "out")


def test_python_api_refuses_too(ckpt: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.md").write_text("n")
    with pytest.raises(CheckpointError, match=r"notes\.md"):
        save_model(load_model(str(ckpt)), home)
    assert (home / "notes.md").read_text() == "n"


def test_killed_conversion_leaves_nothing_after_the_next(ckpt: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """A conversion killed mid-write leaves ``.DST.tmp-PID-*``; the next one into the same
    DST removes it (the pid is dead), and touches nothing else."""
    dst = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".out.tmp-{pid}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".other.tmp-{pid}-abc123").mkdir()  # another target's: not ours to judge
    live = tmp_path / f".out.tmp-{os.getpid()}-live01"  # a live writer's: kept
    live.mkdir()
    assert cli(["convert", ckpt, dst], capsys).rc == 0
    assert not stale.exists() and live.is_dir()
    assert (tmp_path / f".other.tmp-{pid}-abc123").is_dir()
    assert not [p for p in leftovers(tmp_path) if p not in (live,)
                and ".other." not in p.name]
