"""Sharded exitlm directories (``model-0000I-of-0000N.safetensors``) and models shipped in the
package by name (:mod:`exitlm.io.shipped`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _io_util import all_logits, tiny_config, tiny_model, tiny_tokenizer

from exitlm.config import ExitConfig
from exitlm.io import load_model, save_model
from exitlm.io import shipped as shipped_mod
from exitlm.io.hf_map import CheckpointError
from exitlm.io.native import save_native, shard_name, shard_tensors, weight_files
from exitlm.io.shipped import shipped_dir, shipped_names

TOKENS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
EXITS = ExitConfig(every_layer=True, norm="final")


def _model() -> torch.nn.Module:
    return tiny_model(tiny_config("llama", EXITS))


def test_sharded_round_trip_is_exact(tmp_path: Path) -> None:
    model = _model()
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_native(model, tmp_path / "m", tiny_tokenizer(), max_shard_bytes=total // 4)
    names = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(names) >= 4 and names[0] == shard_name(1, len(names))
    assert not (tmp_path / "m" / "model.safetensors").exists()
    loaded = load_model(tmp_path / "m")
    got, want = all_logits(loaded.model, TOKENS), all_logits(model, TOKENS)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"layer {k}"
    # a sharded directory is exitlm's own: saving over it is allowed without overwrite
    save_model(loaded, tmp_path / "m")
    assert [p.name for p in weight_files(tmp_path / "m")] == ["model.safetensors"]


def test_shards_in_fp16_load_as_the_rounded_model(tmp_path: Path) -> None:
    model = _model()
    save_native(model, tmp_path / "m", max_shard_bytes=10_000, dtype=torch.float16)
    for p in weight_files(tmp_path / "m"):
        assert p.stat().st_size < 10_000 + 4096 or len(weight_files(tmp_path / "m")) == 1
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.half().float())
    got = all_logits(load_model(tmp_path / "m").model, TOKENS)
    want = all_logits(rounded, TOKENS)
    for k in want:
        assert torch.equal(got[k], want[k]), f"layer {k}"


def test_shard_tensors_limits() -> None:
    t = {f"t{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    assert [list(s) for s in shard_tensors(t, 80)] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [list(s) for s in shard_tensors(t, 10)] == [[f"t{i}"] for i in range(5)]
    assert len(shard_tensors(t, None)) == 1
    with pytest.raises(ValueError, match="positive"):
        shard_tensors(t, 0)


def test_missing_or_mixed_shards_are_named(tmp_path: Path) -> None:
    save_native(_model(), tmp_path / "m", max_shard_bytes=20_000)
    files = weight_files(tmp_path / "m")
    n = len(files)
    assert n >= 3
    files[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard_name(2, n)} is missing"):
        load_model(tmp_path / "m")
    files[1].write_bytes(b"")  # put a name back, then add a shard of another set
    (tmp_path / "m" / shard_name(1, n + 1)).write_bytes(b"")
    with pytest.raises(CheckpointError, match="shards of different models"):
        load_model(tmp_path / "m")
    for p in (tmp_path / "m").glob("model-*.safetensors"):
        p.unlink()
    with pytest.raises(CheckpointError, match="weight file is missing"):
        load_model(tmp_path / "m")


def test_shipped_names_appear_only_when_installed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipped_mod, "DATA_DIR", tmp_path)
    assert shipped_dir("layerskip-code") is None and shipped_names() == []
    with pytest.raises(CheckpointError, match="not a known name") as err:
        load_model("layerskip-code")
    assert "layerskip-code" not in str(err.value).split("known names:")[1]
    model = _model()
    save_native(model, tmp_path / "layerskip_code", tiny_tokenizer(), max_shard_bytes=30_000)
    assert shipped_dir("layerskip-code") == tmp_path / "layerskip_code"
    assert shipped_names() == ["layerskip-code"]
    assert shipped_dir("default-ee") is None  # a bundle, not a shipped checkpoint
    loaded = load_model("layerskip-code")
    assert loaded.source.startswith("layerskip-code:")
    got, want = all_logits(loaded.model, TOKENS), all_logits(model, TOKENS)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(CheckpointError) as err:
        load_model("layerskip_code")
    assert err.value.hint == "did you mean 'layerskip-code'?"
