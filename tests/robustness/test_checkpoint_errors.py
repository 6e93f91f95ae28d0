"""Bad checkpoints: a broken or lying config.json, damaged weights, broken exit bundles. Every
loading command answers with one line naming the file (and key), in bounded memory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _robust_util import (
    assert_clean_error,
    cli,
    cli_subprocess,
    edit_json,
    tiny_checkpoint,
    tiny_model,
)
from safetensors.torch import load_file, save_file

from exitlm.errors import ExitlmError, ExitlmWarning
from exitlm.io import export_hf, load_model
from exitlm.io.bundle import save_bundle


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("native") / "ckpt")


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    return export_hf(load_model(str(native)), tmp_path_factory.mktemp("hf") / "ckpt")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


NATIVE_CONFIGS = [
    ({"num_layers": "abc"}, ["num_layers", "'abc'"]),
    ({"num_layers": 4.5}, ["num_layers", "4.5"]),
    ({"num_layers": None}, ["num_layers", "None"]),
    ({"num_layers": 0}, ["num_layers", "got 0"]),
    ({"num_kv_heads": 0}, ["num_kv_heads", "got 0"]),
    ({"head_dim": -16}, ["head_dim", "-16"]),
    ({"exits": "yes"}, ["exits", "'yes'"]),
    ({"exits": {"layers": "yes"}}, ["exits.layers", "'yes'"]),
    ({"tie_embeddings": "false"}, ["tie_embeddings", "'false'"]),
    ({"eos_token_ids": [-1]}, ["eos_token_ids[0]", "-1"]),
    ({"norm": "batchnorm"}, ["norm", "'batchnorm'"]),
    ({"rope_scaling": {"factor": "x"}}, ["rope_scaling.factor", "'x'"]),
    ({"vocab_size": 1000}, ["embed_tokens.weight", "(1000, 32)"]),
    ({"num_layers": 3}, ["num_layers=3", "2 layer"]),
    ({"num_layers": 1, "exits": {"layers": []}}, ["layer 2", "num_layers=1"]),
    ({"dimm": 3}, ["unknown model config keys", "dimm"]),
    ({"exitlm_format_version": 99}, ["format version 99"]),
]


@pytest.mark.parametrize(("change", "needles"), NATIVE_CONFIGS,
                         ids=[json.dumps(c) for c, _ in NATIVE_CONFIGS])
def test_native_config_json(change: dict, needles: list[str], native: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(native, tmp_path / "c")
    edit_json(ckpt / "config.json", **change)
    res = cli(["info", ckpt], capsys)
    assert_clean_error(res, *needles)


HF_CONFIGS = [
    ({"num_hidden_layers": "abc"}, ["num_hidden_layers", "'abc'"]),
    ({"num_hidden_layers": 4.5}, ["num_hidden_layers", "4.5"]),
    ({"num_key_value_heads": 0}, ["num_key_value_heads", "got 0"]),
    ({"head_dim": -16}, ["head_dim", "-16"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings", "'false'"]),
    ({"hidden_act": ["silu"]}, ["hidden_act"]),
    ({"architectures": "LlamaForCausalLM", "model_type": ["x"]}, ["unknown architecture"]),
    ({"rope_scaling": "yes"}, ["rope_scaling", "'yes'"]),
    ({"rope_theta": float("inf")}, ["rope_theta"]),
    ({"intermediate_size": 65}, ["shape"]),
]


@pytest.mark.parametrize(("change", "needles"), HF_CONFIGS,
                         ids=[json.dumps(c) for c, _ in HF_CONFIGS])
def test_hf_config_json(change: dict, needles: list[str], hf: Path, tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(hf, tmp_path / "c")
    edit_json(ckpt / "config.json", **change)
    assert_clean_error(cli(["info", ckpt], capsys), str(ckpt), *needles)


@pytest.mark.parametrize("fmt", ["native", "hf"])
def test_ten_million_layers_fail_fast_in_bounded_memory(fmt: str, native: Path, hf: Path,
                                                        tmp_path: Path) -> None:
    """The issue's case: a tiny config.json claiming 10,000,000 layers. Checked against the
    tensor headers before anything is built, in a process limited to 3 GiB and 60 s."""
    ckpt = _copy(native if fmt == "native" else hf, tmp_path / "c")
    key = "num_layers" if fmt == "native" else "num_hidden_layers"
    edit_json(ckpt / "config.json", **{key: 10_000_000})
    for command in (["info", ckpt], ["generate", "x", "--model", ckpt, "--max-new-tokens", "1"],
                    ["eval", ckpt]):
        res = cli_subprocess(command, timeout=60)
        assert_clean_error(res, "10000000", "2 layer")


BROKEN_FILES = [
    ("config.json", b"\x00\x01\x02 binary", ["config.json", "invalid JSON"]),
    ("config.json", b"[" * 100000 + b"]" * 100000, ["config.json", "invalid JSON"]),
    ("config.json", b"[1, 2]", ["config.json", "expected a JSON object"]),
    ("config.json", b"null", ["config.json", "expected a JSON object", "NoneType"]),
    ("config.json", b"1", ["config.json", "expected a JSON object", "int"]),
    ("config.json", b"true", ["config.json", "expected a JSON object", "bool"]),
    ("config.json", b'"exitlm_format_version"', ["config.json", "expected a JSON object"]),
    ("config.json", b'{"num_layers": 1' + b"0" * 5000 + b"}", ["config.json", "invalid JSON"]),
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{", ["model.safetensors"]),
    ("tokenizer.json", b"{not json", ["tokenizer.json"]),
]


@pytest.mark.parametrize(("name", "content", "needles"), BROKEN_FILES,
                         ids=[f"{n}:{c[:12]!r}" for n, c, _ in BROKEN_FILES])
def test_broken_files(name: str, content: bytes, needles: list[str], native: Path,
                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(native, tmp_path / "c")
    (ckpt / name).write_bytes(content)
    assert_clean_error(cli(["info", ckpt], capsys), *needles)


def test_truncated_weights(native: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(native, tmp_path / "c")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_clean_error(cli(["info", ckpt], capsys), "model.safetensors")


def test_pickled_weights_are_refused(native: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert_clean_error(cli(["info", tmp_path / "model.bin"], capsys), "pickled")


def test_a_pickle_named_by_a_shard_index_is_refused_as_a_pickle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hf"
    assert cli(["convert", "debug", hf, "--to", "hf"], capsys).rc == 0
    names = list(load_file(str(hf / "model.safetensors")))
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    index = {"weight_map": dict.fromkeys(names, "pytorch_model.bin")}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_clean_error(cli(["info", hf], capsys), "pytorch_model.bin", "pickled")


def test_nan_weights_warn_naming_the_tensor(native: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _copy(native, tmp_path / "c")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["layers.1.mlp.w_out.weight"][0, 0] = math.nan
    tensors["norm.weight"][3] = math.inf
    meta = {"exitlm_format_version": "1", "exitlm_aliases": "{}"}
    save_file(tensors, str(ckpt / "model.safetensors"), metadata=meta)
    with pytest.warns(ExitlmWarning, match=r"layers\.1\.mlp\.w_out\.weight.*norm\.weight"):
        load_model(str(ckpt))
    res = cli(["info", ckpt], capsys)
    assert res.rc == 0
    assert "exitlm: warning:" in res.err and "layers.1.mlp.w_out.weight" in res.err


BUNDLE_META = [
    ("{not json", ["exits.json", "invalid JSON"]),
    ('{"format": 1, "exits": {"layers": [1]}}', ["exits.json", "'base'"]),
    ('{"format": 1, "base": 7, "exits": {"layers": [1]}}', ["exits.json", "'base'", "7"]),
    ('{"format": 1, "base": "debug", "exits": "yes"}', ["exits.json", "exits", "'yes'"]),
    ('{"format": 1, "base": "debug", "exits": {"layers": [1], "head": "conv"}}',
     ["exits.json", "exits.head", "'conv'"]),
    ('{"format": 3, "base": "debug"}', ["exits.json", "format 3"]),
    ('{"format": 1, "base": "debug", "exits": {"layers": [3]}}', ["exit"]),
    ('[1, 2]', ["exits.json", "JSON object"]),
]


@pytest.mark.parametrize(("meta", "needles"), BUNDLE_META, ids=[m[:40] for m, _ in BUNDLE_META])
def test_broken_exit_bundles(meta: str, needles: list[str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    bundle = save_bundle(tiny_model(), tmp_path / "exits", "debug")
    (bundle / "exits.json").write_text(meta)
    assert_clean_error(cli(["info", bundle], capsys), *needles)


def test_bundle_without_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = save_bundle(tiny_model(), tmp_path / "exits", "debug")
    (bundle / "exits.safetensors").unlink()
    assert_clean_error(cli(["info", bundle], capsys), "exits.safetensors", "missing")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bool])
def test_bundle_heads_that_are_no_float_weights(dtype: torch.dtype, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A bundle's head tensors are float weights like a checkpoint's: others are refused (they
    were once widened to float32 silently)."""
    bundle = save_bundle(tiny_model(), tmp_path / "exits", str(tiny_checkpoint(tmp_path / "b")))
    file = bundle / "exits.safetensors"
    heads = load_file(file)
    name = next(iter(heads))
    heads[name] = heads[name] > 0 if dtype == torch.bool else heads[name].to(dtype)
    save_file(heads, file)
    shown = str(dtype).removeprefix("torch.")
    assert_clean_error(cli(["info", bundle], capsys), f"{file}: tensor {name!r}", shown)


def test_load_errors_are_exitlm_errors(native: Path, tmp_path: Path) -> None:
    ckpt = _copy(native, tmp_path / "c")
    edit_json(ckpt / "config.json", num_layers="abc")
    with pytest.raises(ExitlmError):
        load_model(str(ckpt))
    with pytest.raises(ExitlmError):
        load_model(str(tmp_path / "nothing-here"))
    assert torch.isfinite(load_model(str(native)).model.embed_tokens.weight).all()
