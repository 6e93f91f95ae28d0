"""Round trips through exitlm's format, HF export, sharded HF dirs and a tiny GGUF."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from _io_util import all_logits, tiny_config, tiny_model, tiny_tokenizer, write_tiny_gguf
from safetensors import safe_open
from safetensors.torch import save_file

from exitlm.config import ExitConfig
from exitlm.io import export_hf, load_model, save_model
from exitlm.io.native import is_native_dir

TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

EXITS = {
    "linear-own-final_head": ExitConfig(layers=(1, 2), head="linear", norm="own",
                                        output="final_head"),
    "mlp-final-own": ExitConfig(layers=(1,), head="mlp", norm="final", output="own"),
    "block-own-tied": ExitConfig(layers=(2,), head="block", norm="own", output="tied_embedding"),
    "block-final-own": ExitConfig(layers=(1, 2), head="block", norm="final", output="own"),
    "every-layer": ExitConfig(every_layer=True, norm="none"),
}
CASES = [(kind, ex) for kind in ("llama", "qwen2", "gpt2") for ex in EXITS]


def _assert_same(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"logits of layer {k} differ"


@pytest.mark.parametrize(("kind", "exits"), CASES)
def test_exitlm_format_round_trip(tmp_path: Path, kind: str, exits: str) -> None:
    model = tiny_model(tiny_config(kind, EXITS[exits]))
    save_model(model, tmp_path / "m", tokenizer=tiny_tokenizer())
    assert is_native_dir(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.config == model.config
    _assert_same(all_logits(model, TOKENS), all_logits(loaded.model, TOKENS))
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("hello") == tiny_tokenizer().encode("hello")


@pytest.mark.parametrize(("kind", "exits"), CASES)
def test_hf_export_round_trip(tmp_path: Path, kind: str, exits: str) -> None:
    model = tiny_model(tiny_config(kind, EXITS[exits]))
    export_hf(model, tmp_path / "hf")
    loaded = load_model(str(tmp_path / "hf"))
    assert loaded.config.exits == model.config.exits
    _assert_same(all_logits(model, TOKENS), all_logits(loaded.model, TOKENS))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_hf_export_loads_in_transformers(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny_model(tiny_config(kind, EXITS["mlp-final-own"]))
    export_hf(model, tmp_path / "hf", tokenizer=tiny_tokenizer())
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(TOKENS).logits, model(TOKENS).logits,
                                   atol=1e-5, rtol=1e-4)


def test_saving_non_contiguous_and_tied_parameters(tmp_path: Path) -> None:
    model = tiny_model(tiny_config("llama", EXITS["mlp-final-own"], tie_embeddings=False))
    with torch.no_grad():  # a layout optimisation may leave weights transposed in memory
        w = model.layers[0].attn.wqkv.weight
        model.layers[0].attn.wqkv.weight = torch.nn.Parameter(w.t().contiguous().t())
        model.lm_head.weight = model.embed_tokens.weight  # tied after construction
    assert not model.layers[0].attn.wqkv.weight.is_contiguous()
    save_model(model, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in list(f.keys())  # stored once, as an alias
    loaded = load_model(str(tmp_path / "m"))
    _assert_same(all_logits(model, TOKENS), all_logits(loaded.model, TOKENS))


def test_sharded_hf_directory(tmp_path: Path) -> None:
    model = tiny_model(tiny_config("llama", ExitConfig()))
    export_hf(model, tmp_path / "full")
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(shard / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (shard / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_model(str(shard))
    _assert_same(all_logits(model, TOKENS), all_logits(loaded.model, TOKENS))


def test_exits_override_keeps_matching_heads_and_initialises_new(tmp_path: Path) -> None:
    model = tiny_model(tiny_config("llama", ExitConfig(layers=(1,), head="mlp")))
    save_model(model, tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), exits=ExitConfig(layers=(1, 2), head="mlp"))
    assert set(loaded.model.exits) == {"1", "2"}
    got, want = all_logits(loaded.model, TOKENS), all_logits(model, TOKENS)
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
    other = load_model(str(tmp_path / "m"), exits=ExitConfig(layers=(2,), head="block"))
    assert set(other.model.exits) == {"2"}
    assert torch.equal(all_logits(other.model, TOKENS)[3], want[3])


def test_presets_and_dtype() -> None:
    loaded = load_model("debug", dtype=torch.bfloat16, exits=ExitConfig(layers=(3,)))
    assert loaded.tokenizer is None and loaded.source == "preset:debug"
    assert loaded.config.exits.layers == (3,)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.rope_inv_freq.dtype == torch.float32


def test_tiny_gguf_matches_the_model_it_was_written_from(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    model = tiny_model(tiny_config("llama", ExitConfig()))
    write_tiny_gguf(tmp_path / "tiny.gguf", model)
    loaded = load_model(str(tmp_path / "tiny.gguf"))
    assert loaded.config.tie_embeddings is False and loaded.config.num_kv_heads == 2
    torch.testing.assert_close(all_logits(loaded.model, TOKENS)[3], all_logits(model, TOKENS)[3])
    tok = loaded.tokenizer
    assert tok is not None and tok.eos_token_ids == (1,) and tok.add_bos is False
    assert tok.encode("hello<|im_end|>") == tiny_tokenizer().encode("hello<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_transformers_save_pretrained_directory(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        # token ids inside the vocabulary (GPT2Config's default 50256 is refused on load)
        hf_cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        ref = transformers.GPT2LMHeadModel(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        ref = transformers.LlamaForCausalLM(hf_cfg)
    ref.eval().save_pretrained(str(tmp_path / "saved"))
    tok = tiny_tokenizer()
    tok.chat_template = None  # transformers 5 writes the template to its own file
    tok.save(tmp_path / "saved")
    (tmp_path / "saved" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    loaded = load_model(str(tmp_path / "saved"), exits=ExitConfig(layers=(1,)))
    assert set(loaded.model.exits) == {"1"}
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS).logits, ref(TOKENS).logits,
                                   atol=1e-5, rtol=1e-4)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_the_format_marker_is_spelled_in_one_place() -> None:
    """``exitlm_format_version`` lives in ``io/st.py`` (the lowest module that needs it, for
    :func:`~exitlm.io.st.written_by_exitlm`); ``io/native.py`` and the rest import it."""
    import exitlm.io.native as native
    import exitlm.io.st as st

    assert st.FORMAT_KEY == "exitlm_format_version" and native.FORMAT_KEY is st.FORMAT_KEY
    src = Path(st.__file__).resolve().parents[1]
    spelled = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value == st.FORMAT_KEY
                            for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))))
    assert spelled == ["io/st.py"], spelled
