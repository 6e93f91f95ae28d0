"""LayerSkip's released checkpoints (facebook/layerskip-llama2-7B ... layerskip-llama3.2-1B) are
plain ``LlamaForCausalLM`` directories whose every layer was trained to exit through the shared
final norm and LM head. A tiny Llama of the same configuration shape (tied embeddings, GQA,
Llama-3 rope scaling, as layerskip-llama3.2-1B) loads with exits at every layer through the
shared head, and self-speculative decoding on it is token-identical to greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exitlm.config import ExitConfig
from exitlm.infer import generate
from exitlm.io import load_model

SHARED_HEAD = ExitConfig(every_layer=True, norm="final")


def _layerskip_like(path: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        initializer_range=0.3, bos_token_id=1, eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def test_every_layer_exits_through_the_shared_head(tmp_path: Path) -> None:
    hf = _layerskip_like(tmp_path / "ls")
    loaded = load_model(str(tmp_path / "ls"), exits=SHARED_HEAD)
    model = loaded.model
    assert model.config.exit_layers == (1, 2, 3)
    assert model.num_parameters(exits_only=True) == 0  # nothing beyond the backbone
    tokens = torch.randint(0, 97, (2, 20))  # longer than the scaling's original context
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
        out = model(tokens, exit_layers=(1, 2, 3))
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    for layer in (1, 2, 3):
        with torch.no_grad():
            want = hf.lm_head(hf.model.norm(ref.hidden_states[layer]))
        torch.testing.assert_close(out.exit_logits[layer], want, atol=1e-4, rtol=1e-4)


def test_self_spec_is_token_identical_to_greedy(tmp_path: Path) -> None:
    _layerskip_like(tmp_path / "ls")
    model = load_model(str(tmp_path / "ls"), exits=SHARED_HEAD).model
    torch.manual_seed(1)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 9, 3)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ar = generate(model, None, prompts, max_new_tokens=20).token_ids
        for exit_layer, d in ((1, 4), (2, 3)):
            got = generate(model, None, prompts, max_new_tokens=20, strategy="self-spec",
                           exit_layer=exit_layer, num_speculations=d)
            assert got.token_ids == ar, (exit_layer, d)
            assert got.stats.drafted > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("to", ["exitlm", "hf"])
def test_convert_records_a_round_on_a_model_without_exits(
        to: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``convert LAYERSKIP_DIR OUT --draft E,D``: the round lives in the exits, so the copy
    gets the exits decoding gives such a model (every layer through the shared head)."""
    from exitlm.cli import main
    from exitlm.config import DraftHint

    _layerskip_like(tmp_path / "ls")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ls"), str(out), "--to", to, "--draft", "1,3",
                 "--threshold", "0.9"]) == 0
    assert "LayerSkip style" in capsys.readouterr().err
    exits = load_model(str(out)).config.exits
    assert (exits.every_layer, exits.norm, exits.layers) == (True, "final", ())
    assert (exits.draft, exits.threshold) == (DraftHint(1, 3), 0.9)
    # a round at no layer of the model is still refused, naming it
    assert main(["convert", str(tmp_path / "ls"), str(tmp_path / "bad"), "--draft", "4,3"]) == 2
    err = capsys.readouterr().err
    assert "--draft 4,3" in err and "1-3" in err and "Traceback" not in err, err
    assert not (tmp_path / "bad").exists()
