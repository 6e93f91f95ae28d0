"""exitlm.io.dirs: the folders exitlm creates, and one line naming a folder that cannot be
created and why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exitlm.errors import ExitlmError
from exitlm.io.dirs import PathError, check_cache_root, ensure_dir

LINUX_SYS = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/sys/kernel").is_dir(),
    reason="needs Linux's /sys (no folder can be made there)")


def test_ensure_dir_creates_parents_and_accepts_an_existing_folder(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert ensure_dir(target) == target and target.is_dir()
    assert ensure_dir(target, "train.out_dir") == target  # there already: fine


def test_a_folder_under_a_file_names_the_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(PathError) as info:
        ensure_dir(tmp_path / "afile" / "out" / "deeper", "--out-dir")
    err = info.value
    assert str(err) == (f"--out-dir {tmp_path / 'afile' / 'out' / 'deeper'}: cannot create it "
                        f"({tmp_path / 'afile'} is a file, expected a directory)")
    assert isinstance(err, ExitlmError) and isinstance(err, OSError) and err.hint is None
    assert (tmp_path / "afile").read_text() == "mine"


@LINUX_SYS
def test_a_folder_the_system_refuses_gives_its_reason() -> None:
    with pytest.raises(PathError, match=r"^/sys/exitlm-test/x: cannot create it \(\w"):
        ensure_dir(Path("/sys/exitlm-test/x"))


def test_a_cache_folder_that_cannot_be_created_points_at_exitlm_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cachefile"
    root.write_text("not a folder")
    monkeypatch.setenv("EXITLM_CACHE", str(root))
    with pytest.raises(PathError, match="is a file") as info:
        ensure_dir(root / "data" / "abc")
    assert "EXITLM_CACHE" in str(info.value.hint)
    with pytest.raises(PathError, match=r"cache root is not a directory"):
        check_cache_root()
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path / "missing"))
    assert check_cache_root() == tmp_path / "missing"  # not there yet: fine


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_check_creatable_creates_nothing(tmp_path: Path) -> None:
    """Checked before slow work: a folder that could be made is not made, nor its parents."""
    from exitlm.io.dirs import check_creatable

    (tmp_path / "kept").mkdir()
    before = _tree(tmp_path)
    for beside in (False, True):
        assert check_creatable(tmp_path / "a" / "b" / "out", beside=beside) == \
            tmp_path / "a" / "b" / "out"
        assert check_creatable(tmp_path / "kept", "train.out_dir", beside=beside)
    assert _tree(tmp_path) == before


def test_check_creatable_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    from exitlm.io.dirs import check_creatable

    (tmp_path / "afile").write_text("mine")
    for target in (tmp_path / "afile" / "out", tmp_path / "afile"):
        with pytest.raises(PathError, match=rf"^train\.out_dir {target}: cannot create it "
                                            rf"\({tmp_path / 'afile'} is a file"):
            check_creatable(target, "train.out_dir")
    assert (tmp_path / "afile").read_text() == "mine" and _tree(tmp_path) == ["afile"]


@LINUX_SYS
@pytest.mark.parametrize("where", ["/sys/exitlm-test/x", "/proc/exitlm-test"])
def test_check_creatable_refuses_what_the_system_refuses(where: str) -> None:
    from exitlm.io.dirs import check_creatable

    with pytest.raises(PathError, match=rf"^DST {where}: cannot create it \(\w"):
        check_creatable(where, "DST", beside=True)
    assert not Path(where).exists()
