"""The f32 GGUF writer of ``benchmarks/decode_vs_llamacpp.py`` (no llama-cpp-python needed):
metadata, names and order kept, quantized tensors dequantized, and exitlm loads the copy to the
same model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _io_util import all_logits, tiny_config, tiny_model, write_tiny_gguf

from exitlm.config import ExitConfig
from exitlm.io import load_model

gguf = pytest.importorskip("gguf")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from decode_vs_llamacpp import write_f32_gguf  # noqa: E402

TOKENS = torch.tensor([[5, 9, 3, 17, 2, 30]])


def _fields(path: Path) -> dict[str, object]:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_f32_copy_of_a_tiny_gguf_loads_to_the_same_model(tmp_path: Path) -> None:
    model = tiny_model(tiny_config("llama", ExitConfig()))
    write_tiny_gguf(tmp_path / "tiny.gguf", model)
    write_f32_gguf(tmp_path / "tiny.gguf", tmp_path / "copy.gguf")
    a, b = _fields(tmp_path / "tiny.gguf"), _fields(tmp_path / "copy.gguf")
    assert b.pop("general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    a.pop("general.file_type", None)
    assert a == b
    ours = load_model(str(tmp_path / "copy.gguf"))
    torch.testing.assert_close(all_logits(ours.model, TOKENS)[3], all_logits(model, TOKENS)[3],
                               rtol=0, atol=0)
    assert list(tmp_path.glob(".*tmp")) == []  # written through a temporary file


def test_quantized_tensors_are_dequantized_in_place(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([3, 1, 1])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_float32("llama.rope.freq_base", 100000.0)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    norm = rng.standard_normal(64).astype(np.float32)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    write_f32_gguf(tmp_path / "q.gguf", tmp_path / "f.gguf")
    src, out = gguf.GGUFReader(tmp_path / "q.gguf"), gguf.GGUFReader(tmp_path / "f.gguf")
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for s, o in zip(src.tensors, out.tensors, strict=True):
        assert o.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(o.shape) == list(s.shape)
        want = gguf.quants.dequantize(s.data, s.tensor_type).reshape(o.data.shape)
        np.testing.assert_array_equal(np.asarray(o.data), want)
    qt = out.tensors[0]
    assert np.abs(np.asarray(qt.data) - q).max() < 0.05  # Q8_0 rounding only
    b = _fields(tmp_path / "f.gguf")
    assert b["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    assert b["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert b["tokenizer.ggml.token_type"] == [3, 1, 1]
    assert b["tokenizer.ggml.add_bos_token"] is False


def test_byte_level_checkpoint_to_gguf(tmp_path: Path) -> None:
    """The LayerSkip side's writer: llama tensor names, llama.cpp's q/k row order (exitlm's
    GGUF loader undoes it), no separate output tensor for tied embeddings, a 256-byte
    GPT-2-style vocabulary."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _byte_models import sharp_byte_model
    from decode_vs_llamacpp import write_byte_level_gguf
    from exitlm.io.gguf_load import unpermute_rotary_rows
    from exitlm.io.native import save_native
    from exitlm.tokenizer import byte_level_alphabet

    model = sharp_byte_model(2, 64)
    save_native(model, tmp_path / "ckpt")
    write_byte_level_gguf(tmp_path / "ckpt", tmp_path / "b.gguf")
    r = gguf.GGUFReader(tmp_path / "b.gguf")
    f = {k: v.contents() for k, v in r.fields.items()}
    alpha = byte_level_alphabet()
    assert f["tokenizer.ggml.tokens"] == [alpha[b] for b in range(256)]
    assert f["llama.block_count"] == 2 and f["llama.attention.head_count_kv"] == 2
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    assert "output.weight" not in t and len(t) == 2 + 2 * 9
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(t["token_embd.weight"], sd["embed_tokens.weight"])
    q = unpermute_rotary_rows(t["blk.0.attn_q.weight"], 4)
    k = unpermute_rotary_rows(t["blk.0.attn_k.weight"], 2)
    qkv = np.concatenate([q, k, t["blk.0.attn_v.weight"]])
    np.testing.assert_array_equal(qkv, sd["layers.0.attn.wqkv.weight"])
