"""exitlm.textfile: user-named text files are read within a byte limit; devices, FIFOs,
directories, oversized and non-UTF-8 files are one-line errors naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exitlm.errors import ExitlmError
from exitlm.textfile import describe_size, read_text_file


def test_reads_a_file_within_the_limit(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes("héllo\n".encode())
    assert read_text_file(f, 7) == "héllo\n"
    f.write_bytes(b"a\xffb")
    assert read_text_file(f, 10, errors="replace") == "a\ufffdb"


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: d / "missing.txt", "cannot read it"),
    (lambda d: d, "a directory"),
    (lambda _: Path("/dev/zero"), "a character device"),
])
def test_refuses_what_is_not_a_regular_file(tmp_path: Path, make, needle: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ExitlmError, match=needle) as info:
        read_text_file(path, 100, label=f"--x {path}", expected="a prompts file")
    assert str(info.value).startswith(f"--x {path}: ") and "\n" not in str(info.value)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ExitlmError, match="a FIFO"):
        read_text_file(fifo, 100)


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "big.txt"
    f.write_bytes(b"x" * 101)
    with pytest.raises(ExitlmError, match=rf"{f}: larger than 100 bytes, the limit for a "
                                          "template"):
        read_text_file(f, 100, expected="a template")
    assert read_text_file(f, 101) == "x" * 101
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ExitlmError, match="not UTF-8 text"):
        read_text_file(f, 100)


def test_describe_size() -> None:
    assert describe_size(64 * 2**20) == "64 MiB" and describe_size(1000) == "1,000 bytes"
