"""Malformed GGUF files are refused with one line naming the file and the key or tensor, in
bounded time and memory, whatever their header claims."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _io_util import tiny_config, tiny_model, write_tiny_gguf

from exitlm.config import ExitConfig
from exitlm.io import CheckpointError, load_model

pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "robustness"))
from _robust_util import assert_clean_error, cli

_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
        12: "d"}


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _enc(t: int, v: Any) -> bytes:
    return _s(v) if t == 8 else struct.pack("<" + _FMT[t], v)


def kv_scalar(key: str, t: int, v: Any) -> bytes:
    return _s(key) + struct.pack("<I", t) + _enc(t, v)


def kv_array(key: str, t: int, values: list[Any], count: int | None = None) -> bytes:
    n = len(values) if count is None else count
    return (_s(key) + struct.pack("<IIQ", 9, t, n) + b"".join(_enc(t, v) for v in values))


class Raw:
    """A valid tiny llama GGUF taken apart into raw key/value entries and tensors, to be
    edited and written back byte by byte (as a broken converter could)."""

    def __init__(self, base: Path) -> None:
        from gguf import GGUFReader

        r = GGUFReader(str(base))
        self.kvs: list[tuple[str, bytes]] = []
        for f in r.fields.values():
            if f.name.startswith("GGUF."):
                continue
            if f.types[0] == 9:
                self.kvs.append((f.name, kv_array(f.name, f.types[1], f.contents())))
            else:
                self.kvs.append((f.name, kv_scalar(f.name, f.types[0], f.contents())))
        self.tensors = [dict(name=t.name, dims=[int(x) for x in t.shape],
                             type=int(t.tensor_type), data=np.asarray(t.data).tobytes())
                        for t in r.tensors]

    def set(self, key: str, entry: bytes | None) -> Raw:
        self.kvs = [(k, b) for k, b in self.kvs if k != key]
        if entry is not None:
            self.kvs.append((key, entry))
        return self

    def write(self, path: Path, offsets: dict[str, int] | None = None) -> Path:
        ts = self.tensors
        head = b"GGUF" + struct.pack("<IQQ", 3, len(ts), len(self.kvs))
        head += b"".join(b for _, b in self.kvs)
        data, offs = b"", []
        for t in ts:
            data += b"\0" * ((-len(data)) % 32)
            offs.append(len(data))
            data += t["data"]
        for t, o in zip(ts, offs, strict=True):
            o = (offsets or {}).get(t["name"], o)
            head += (_s(t["name"]) + struct.pack("<I", len(t["dims"]))
                     + b"".join(struct.pack("<Q", d) for d in t["dims"])
                     + struct.pack("<IQ", t["type"], o))
        head += b"\0" * ((-len(head)) % 32)
        path.write_bytes(head + data)
        return path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(file, tiny_model(tiny_config("llama", ExitConfig())))
    return file


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(str(path))
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


def test_base_file_loads(base: Path) -> None:
    loaded = load_model(str(base))
    assert loaded.tokenizer is not None


# 1. bounded header scan


def _error_before_reader(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """:func:`_error`, with gguf's GGUFReader (which loops per item an array header claims)
    out of reach: the bounded scan must refuse the file first (no timing: CI is loaded)."""
    import gguf

    def reached(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("GGUFReader was reached: the header scan let the file through")

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFReader", reached)
        return _error(path)


def test_array_claiming_2_60_items_is_refused_at_once(base: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for t, vals in ((0, [1, 2, 3]), (8, ["a"])):
        f = Raw(base).set("x.arr", kv_array("x.arr", t, vals, count=2**60)).write(
            tmp_path / f"huge{t}.gguf")
        msg = _error_before_reader(f, monkeypatch)
        assert "'x.arr'" in msg and "1,152,921,504,606,846,976" in msg


def test_too_many_array_items_in_all_is_refused(base: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    n = 3_000_000  # a real array of empty strings: 24 MB
    entry = _s("x.arr") + struct.pack("<IIQ", 9, 8, n) + bytes(8 * n)
    f = Raw(base).set("x.arr", entry).write(tmp_path / "many.gguf")
    msg = _error_before_reader(f, monkeypatch)
    assert "'x.arr'" in msg and "3,000,000" in msg and "2,000,000" in msg


def test_huge_string_key_and_counts(base: Path, tmp_path: Path) -> None:
    f = Raw(base).set("x.s", _s("x.s") + struct.pack("<IQ", 8, 2**63) + b"abc").write(
        tmp_path / "s.gguf")
    assert "'x.s'" in _error(f)
    f = Raw(base).set("k", struct.pack("<Q", 2**63) + b"abc").write(tmp_path / "k.gguf")
    assert "key" in _error(f)
    data = bytearray(Raw(base).write(tmp_path / "n.gguf").read_bytes())
    data[8:16] = struct.pack("<Q", 2**60)
    (tmp_path / "n.gguf").write_bytes(bytes(data))
    assert "tensors" in _error(tmp_path / "n.gguf")


def test_cli_prints_one_line(base: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    f = Raw(base).set("x.arr", kv_array("x.arr", 0, [1], count=2**60)).write(tmp_path / "c.gguf")
    assert_clean_error(cli(["info", f], capsys), str(f), "'x.arr'")
    f = Raw(base).set("llama.block_count", kv_scalar("llama.block_count", 8, "2")).write(
        tmp_path / "b.gguf")
    assert_clean_error(cli(["info", f], capsys), str(f), "'llama.block_count'", "integer")


# 2. tokenizer metadata


def test_tokenizer_tokens_missing_or_not_strings(base: Path, tmp_path: Path) -> None:
    f = Raw(base).set("tokenizer.ggml.tokens", None)  # llama.vocab_size stays
    msg = _error(f.write(tmp_path / "none.gguf"))
    assert "'tokenizer.ggml.tokens'" in msg and "array of strings" in msg
    f = Raw(base).set("tokenizer.ggml.tokens",
                      kv_array("tokenizer.ggml.tokens", 4, list(range(64))))
    msg = _error(f.write(tmp_path / "ints.gguf"))
    assert "'tokenizer.ggml.tokens'" in msg and "array of strings" in msg


# 3. tensor names


def test_non_numeric_block_index_names_the_tensor(base: Path, tmp_path: Path) -> None:
    r = Raw(base)
    r.tensors[-1] = dict(r.tensors[-1], name="blk.x.attn_q.weight")
    assert "'blk.x.attn_q.weight'" in _error(r.write(tmp_path / "blk.gguf"))


# 4. tensor data layout


def test_misaligned_and_overlapping_tensor_data(base: Path, tmp_path: Path) -> None:
    r = Raw(base)
    last = r.tensors[-1]["name"]
    msg = _error(r.write(tmp_path / "mis.gguf", offsets={last: 3}))
    assert repr(last) in msg and "alignment" in msg
    msg = _error(r.write(tmp_path / "ovl.gguf", offsets={last: 0}))
    assert "overlaps" in msg


# 5. integer metadata types


@pytest.mark.parametrize("entry", [
    kv_scalar("llama.block_count", 8, "2"),
    kv_scalar("llama.block_count", 6, 2.5),
    kv_array("llama.block_count", 4, [2, 2]),
    kv_scalar("llama.block_count", 7, True),
], ids=["str", "float", "array", "bool"])
def test_integer_metadata_must_be_an_integer(base: Path, tmp_path: Path, entry: bytes) -> None:
    msg = _error(Raw(base).set("llama.block_count", entry).write(tmp_path / "b.gguf"))
    assert "'llama.block_count'" in msg and "integer" in msg


def test_float_metadata_names_the_key(base: Path, tmp_path: Path) -> None:
    key = "llama.attention.layer_norm_rms_epsilon"
    msg = _error(Raw(base).set(key, kv_scalar(key, 8, "x")).write(tmp_path / "e.gguf"))
    assert repr(key) in msg and "number" in msg


# 6. rope


def test_unsupported_rope_scaling_and_partial_rotary(base: Path, tmp_path: Path) -> None:
    key = "llama.rope.scaling.type"
    msg = _error(Raw(base).set(key, kv_scalar(key, 8, "yarn")).write(tmp_path / "y.gguf"))
    assert repr(key) in msg and "'yarn'" in msg
    key = "llama.rope.dimension_count"
    half = tiny_config("llama", ExitConfig()).hdim // 2
    msg = _error(Raw(base).set(key, kv_scalar(key, 4, half)).write(tmp_path / "d.gguf"))
    assert repr(key) in msg and "partial" in msg


def test_rope_dimension_count_equal_to_head_dim_is_fine(base: Path, tmp_path: Path) -> None:
    cfg = tiny_config("llama", ExitConfig())
    key = "llama.rope.dimension_count"
    f = Raw(base).set(key, kv_scalar(key, 4, cfg.hdim)).write(tmp_path / "ok.gguf")
    assert load_model(str(f)).config.hdim == cfg.hdim


# 7. special token ids


def test_eos_id_outside_the_vocabulary(base: Path, tmp_path: Path) -> None:
    key = "tokenizer.ggml.eos_token_id"
    msg = _error(Raw(base).set(key, kv_scalar(key, 4, 10**6)).write(tmp_path / "eos.gguf"))
    assert repr(key) in msg and "1000000" in msg
