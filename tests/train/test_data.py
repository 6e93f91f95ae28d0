"""Data: files / directories / JSONL, deterministic split and shuffle, sharding, safe re-runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from exitlm.config import ConfigError
from exitlm.io.corpus import DataConfig, list_sources
from exitlm.train.data import (
    BatchStream,
    ByteTokenizer,
    TokenFile,
    data_dir_for,
    open_split,
    prepare,
)


def _corpus(root: Path) -> Path:
    d = root / "c"
    (d / "sub").mkdir(parents=True)
    for i in range(20):
        (d / ("sub" if i % 2 else "") / f"f{i}.txt").write_text(f"document {i} " * 30)
    (d / "skip.bin").write_bytes(b"\0\1")
    with (d / "more.jsonl").open("w") as f:
        for i in range(10):
            f.write(json.dumps({"text": f"json line {i} " * 20}) + "\n")
    return d


def test_prepare_split_and_reuse(tmp_path: Path) -> None:
    cfg = DataConfig(paths=(str(_corpus(tmp_path)),), seq_len=16, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"))
    keys = [k for k, _ in list_sources(cfg)]
    assert "skip.bin" not in keys and "more.jsonl" in keys and "sub/f1.txt" in keys
    out = prepare(cfg, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["val"] == 30
    assert meta["documents"]["val"] > 0
    val = set(meta["val_documents"])
    assert prepare(cfg, progress=False) == out  # complete: reused
    # same split on a fresh preprocessing
    other = DataConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "cache2")})
    meta2 = json.loads((prepare(other, progress=False) / "meta.json").read_text())
    assert set(meta2["val_documents"]) == val
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    text = ByteTokenizer().decode(train.tolist())
    assert "document" in text and "json line" in text


def test_interrupted_prepare_is_redone(tmp_path: Path) -> None:
    cfg = DataConfig(paths=(str(_corpus(tmp_path)),), seq_len=16, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"))
    d = data_dir_for(cfg)
    d.mkdir(parents=True)
    (d / "train.bin").write_bytes(b"garbage")  # a crashed run left this, but no meta.json
    out = prepare(cfg, progress=False)
    assert (out / "train.bin").stat().st_size > 100


def test_batch_stream_shards_and_resumes(tmp_path: Path) -> None:
    data = TokenFile(np.arange(1000, dtype=np.int64) % 256, seq_len=10)
    single = BatchStream(data, 4, seed=1)
    r0 = BatchStream(data, 2, seed=1, rank=0, world_size=2)
    r1 = BatchStream(data, 2, seed=1, rank=1, world_size=2)
    for _ in range(30):  # crosses epoch boundaries (99 samples)
        x, y = single.next()
        a, _ = r0.next()
        b, _ = r1.next()
        assert np.array_equal(x.numpy(), np.concatenate([a.numpy(), b.numpy()]))
        assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    again = BatchStream(data, 4, seed=1, position=single.position - 4)
    single.position -= 4
    assert np.array_equal(again.next()[0].numpy(), single.next()[0].numpy())


def test_open_split_and_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        list_sources(DataConfig(paths=(str(tmp_path / "nope"),)))
    with pytest.raises(ConfigError, match="seq_len"):
        DataConfig(seq_len=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="text_field"):
        prepare(DataConfig(paths=(str(bad),), cache_dir=str(tmp_path)), progress=False)
    cfg = DataConfig(paths=(str(_corpus(tmp_path)),), seq_len=8, val_fraction=0.2,
                     cache_dir=str(tmp_path / "c3"))
    assert open_split(prepare(cfg, progress=False), "val", 8).num_samples > 0


def test_sources_sorted_by_path_parts_and_filtered_by_suffix(tmp_path: Path) -> None:
    d = tmp_path / "c"
    for rel in ("b.py", "a/z.py", "a.py", "a-b/c.py", "a/y.txt", "n.md", "a/x.jsonl"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("x = 1\n")
    (d / "a" / "dir.py").mkdir()  # a folder named like a source is not one
    keys = [k for k, _ in list_sources(DataConfig(paths=(str(d),)))]
    # the order of sorted(Path.rglob("*")): by the parts of the path, not by the string
    assert keys == ["a/x.jsonl", "a/y.txt", "a/z.py", "a-b/c.py", "a.py", "b.py", "n.md"]
    only_py = [k for k, _ in list_sources(DataConfig(paths=(str(d),), suffixes=(".py",)))]
    assert only_py == ["a/z.py", "a-b/c.py", "a.py", "b.py"]
    with pytest.raises(ConfigError, match=r"data.suffixes: '\.c' is not a file kind"):
        DataConfig(suffixes=(".c",))


def test_packages_inside_the_stdlib_folder_are_skipped(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from exitlm.io import corpus

    lib = tmp_path / "lib"
    for rel in ("os.py", "json/decoder.py", "site-packages/torch/nn.py", "dist-packages/x.py"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text("pass\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: lib)
    want = ["json/decoder.py", "os.py"]
    assert [k for k, _ in list_sources(DataConfig())] == want
    # also when the folder is named explicitly (a corpus of "stdlib + some packages")
    assert [k for k, _ in list_sources(DataConfig(paths=(str(lib),), suffixes=(".py",)))] == want
    # any other folder keeps its site-packages (it is what the user asked for)
    other = [k for k, _ in list_sources(DataConfig(paths=(str(lib / "site-packages"),)))]
    assert other == ["torch/nn.py"]


def test_held_out_samples_are_held_out_prefixes(tmp_path: Path) -> None:
    from exitlm.io.corpus import held_out_samples, is_held_out

    cfg = DataConfig(paths=(str(_corpus(tmp_path)),), val_fraction=0.5)
    got = held_out_samples(cfg, 3, 40)
    want = [p.read_bytes()[:40] for k, p in list_sources(cfg)
            if p.suffix != ".jsonl" and is_held_out(k, 0.5, 0)][:3]
    assert got == want and len(got) == 3 and all(len(x) == 40 for x in got)
    assert held_out_samples(cfg, 3, 10**6) == []  # no file that long
