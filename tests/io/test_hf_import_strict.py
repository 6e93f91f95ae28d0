"""Hugging Face / native imports that exitlm cannot compute exactly, or whose values are bad,
are refused with one line naming the file and key/tensor (exit 2); what loads matches
``transformers``' logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from exitlm.cli import main
from exitlm.config import ExitConfig
from exitlm.io import export_hf, load_model, save_model
from exitlm.io.native import EXITS_WEIGHTS

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)


def _save(tmp: Path, kind: str, **kw: object) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, bos_token_id=1, eos_token_id=2, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "llama": ("LlamaConfig", "LlamaForCausalLM")}[kind]
        cfg = getattr(transformers, cls[0])(**{**LLAMA, **kw})
        model = getattr(transformers, cls[1])(cfg)
    out = tmp / kind
    model.eval().save_pretrained(str(out), safe_serialization=True)
    return out, model


def _info(path: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    capsys.readouterr()
    try:
        rc = main(["info", str(path)])
    except SystemExit as stop:
        rc = int(stop.code or 0)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  hint: ")]
    assert rc == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _parity(path: Path, ref: torch.nn.Module) -> None:
    ours = load_model(path).model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS).logits, ref(TOKENS).logits, atol=1e-4, rtol=1e-4)


REFUSED_CONFIGS = [
    ("mistral", {"sliding_window": 4}, ["sliding_window", "full context"]),
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 32768}, ["sliding_window"]),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     ["sliding_window", "use_sliding_window"]),
    ("gpt2", {"scale_attn_weights": False}, ["scale_attn_weights"]),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
]


@pytest.mark.parametrize(("kind", "kw", "needles"), REFUSED_CONFIGS,
                         ids=[f"{k}-{json.dumps(c)}" for k, c, _ in REFUSED_CONFIGS])
def test_inexact_attention_is_refused(kind: str, kw: dict, needles: list[str], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _save(tmp_path, kind, **kw)
    _info(path, capsys, str(path / "config.json"), *needles)


EXACT_CONFIGS = [
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 64, "max_position_embeddings": 64}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    ("gpt2", {"reorder_and_upcast_attn": True}),
]


@pytest.mark.parametrize(("kind", "kw"), EXACT_CONFIGS,
                         ids=[f"{k}-{json.dumps(c)}" for k, c in EXACT_CONFIGS])
def test_exact_attention_variants_load_with_parity(kind: str, kw: dict, tmp_path: Path) -> None:
    path, ref = _save(tmp_path, kind, **kw)
    _parity(path, ref)


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return _save(tmp_path, "llama")[0]


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("dtype", ["int8", "bool", "int32", "uint8", "float8_e4m3fn",
                                   "float8_e5m2"])
def test_bad_dtype_in_a_fused_part_is_refused(dtype: str, llama_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    file = llama_dir / "model.safetensors"
    sd = load_file(file)
    dt = getattr(torch, dtype)
    sd[Q] = sd[Q] > 0 if dt == torch.bool else (sd[Q] * 100).to(dt)
    save_file(sd, file, metadata={"format": "pt"})
    _info(llama_dir, capsys, Q, dtype)


def test_exit_file_may_not_hold_backbone_tensors(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    sys_path, _ = _save(tmp_path, "llama")
    loaded = load_model(sys_path, exits=ExitConfig(layers=(1,)))
    out = tmp_path / "export"
    export_hf(loaded.model, out)
    exits = out / EXITS_WEIGHTS
    sd = load_file(exits)
    sd["layers.0.attn.wo.weight"] = torch.zeros(32, 32)
    save_file(sd, exits, metadata=safe_open(exits, "pt").metadata())
    _info(out, capsys, str(exits), "layers.0.attn.wo.weight", "exit-head")


@pytest.fixture
def native_dir(tmp_path: Path) -> Path:
    path, _ = _save(tmp_path, "llama")
    out = tmp_path / "native"
    save_model(load_model(path), out)
    return out


@pytest.mark.parametrize(("aliases", "needles"), [
    ('{"layers.0.attn.wo.weight": "layers.1.attn.wo.weight"}', ["layers.0.attn.wo.weight"]),
    ("[1,2]", ["'[1,2]'"]),
    ('{"x": [1]}', ["x"]),
    ("{", []),
])
def test_bad_aliases_are_refused(aliases: str, needles: list[str], native_dir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    file = native_dir / "model.safetensors"
    meta = safe_open(file, "pt").metadata()
    save_file(load_file(file), file, metadata={**meta, "exitlm_aliases": aliases})
    _info(native_dir, capsys, str(file), "exitlm_aliases", *needles)


@pytest.mark.parametrize(("change", "needles"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
     ["rope_scaling.factor", "'8'"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": True}}, ["rope_scaling.factor"]),
    ({"eos_token_id": 64}, ["eos_token_id", "64", "vocab_size"]),
    ({"eos_token_id": [2, 1000]}, ["eos_token_id", "1000"]),
    ({"bos_token_id": 99}, ["bos_token_id", "99"]),
])
def test_lax_config_values_are_refused(change: dict, needles: list[str], llama_dir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    file = llama_dir / "config.json"
    data = json.loads(file.read_text())
    data.pop("rope_parameters", None)
    data.update(change)
    file.write_text(json.dumps(data))
    _info(llama_dir, capsys, str(file), *needles)


FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", [*FLOAT8, "int8", "bool"])
@pytest.mark.parametrize("tensor", [Q, "model.layers.0.self_attn.o_proj.weight",
                                    "model.layers.1.mlp.down_proj.weight"])
def test_a_tensor_that_is_no_float_weight_is_refused_naming_its_file(
        tensor: str, dtype: str, llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fused (q/k/v) or not, float8, integer and bool tensors are refused alike: one line
    naming the file, the checkpoint's tensor and the dtype (a float8 ``o_proj`` once loaded,
    widened to float32)."""
    file = llama_dir / "model.safetensors"
    sd = load_file(file)
    dt = getattr(torch, dtype)
    sd[tensor] = sd[tensor] > 0 if dt == torch.bool else (sd[tensor] * 100).to(dt)
    save_file(sd, file, metadata={"format": "pt"})
    _info(llama_dir, capsys, f"{file}: tensor {tensor!r}", f"dtype {dtype}", "float")


@pytest.mark.parametrize("dtype", FLOAT8)
def test_a_float8_tensor_in_exitlms_format_is_refused(
        dtype: str, native_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = native_dir / "model.safetensors"
    meta = safe_open(file, "pt").metadata()
    sd = load_file(file)
    sd["layers.0.attn.wo.weight"] = sd["layers.0.attn.wo.weight"].to(getattr(torch, dtype))
    save_file(sd, file, metadata=meta)
    _info(native_dir, capsys, f"{file}: tensor 'layers.0.attn.wo.weight'", f"dtype {dtype}")


def test_non_finite_fused_parts_are_named_as_the_checkpoint_names_them(
        llama_dir: Path) -> None:
    """A NaN in ``q_proj`` is reported under the checkpoint's names and file, not exitlm's
    fused ``layers.0.attn.wqkv.weight``."""
    from exitlm.errors import ExitlmWarning

    file = llama_dir / "model.safetensors"
    sd = load_file(file)
    sd[Q][0, 0] = float("nan")
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.warns(ExitlmWarning) as got:
        load_model(llama_dir)
    text = " ".join(str(w.message) for w in got)
    assert str(file) in text and repr(Q) in text and "wqkv" not in text, text


def test_a_fused_gguf_tensor_of_the_wrong_shape_is_named_as_the_file_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF whose metadata claims more key/value heads than its tensors hold: the shape
    error names the GGUF's own q/k/v tensors and the file."""
    from _io_util import tiny_config, tiny_model, write_tiny_gguf

    file = tmp_path / "m.gguf"
    write_tiny_gguf(file, tiny_model(tiny_config("llama", ExitConfig())), kv_heads=4)
    line = _info(file, capsys, f"{file}: tensors 'blk.0.attn_q.weight', 'blk.0.attn_k.weight', "
                               "'blk.0.attn_v.weight'", "shape")
    assert "wqkv" not in line
