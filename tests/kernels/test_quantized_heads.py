"""Int8 heads alone (issue 34): ``quantize_heads`` quantizes the output embeddings of a float
model - the LM head, the exits' own matrices, an int8 output copy of a tied embedding - and
nothing else; every head's logits are the int8 product; the copy is saved, rebuilt and loaded
with the model; ``--head-dtype`` reaches the model from the commands; bad combinations are one
line. (Lossless strategies on every runner: tests/infer/test_conformance.py.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from _byte_models import sharp_model
from _default_model import requires_default_model
from exitlm.cli import main
from exitlm.config import ConfigError, ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.io import load_model
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.io.native import save_native
from exitlm.kernels.quant import QuantizedWeight, qlinear, quantize
from exitlm.kernels.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    quantize_heads,
    quantize_model,
)
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.products import head_modules

VOCAB = 40


def _model(*, tie: bool = True, exits: ExitConfig | None = None, dim: int = 64) -> EarlyExitLM:
    return sharp_model(ModelConfig(
        vocab_size=VOCAB, dim=dim, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=128, tie_embeddings=tie,
        exits=exits or ExitConfig(every_layer=True, norm="final")), 0)


def _float_weights(model: EarlyExitLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_tied_head_gets_an_int8_copy_and_the_rest_stays_float() -> None:
    model = _model()
    before = _float_weights(model)
    q = quantize_heads(copy.deepcopy(model))
    assert type(q.embed_tokens) is torch.nn.Embedding  # lookups stay float
    assert isinstance(q.tied_head, QuantizedLinear) and q.tied_head.kind == "int8"
    assert not any(isinstance(m, QuantizedLinear) for m in q.layers.modules())
    after = _float_weights(q)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)  # nothing else changed
    head = q.output_embedding()
    assert isinstance(head, QuantizedWeight)
    want = quantize(model.embed_tokens.weight.detach(), "int8")
    assert torch.equal(head.q, want.q) and torch.equal(head.scales, want.scales)
    # the copy reads 1 + 4/32 bytes a weight: 28% of the fp32 embedding
    assert head.nbytes() == pytest.approx(0.28125 * model.embed_tokens.weight.numel() * 4)
    assert head_modules(q) == [q.tied_head]
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        got = q(tokens, exit_layers=(2,))
        h = q.norm(q.run_layers(q.embed(tokens), 0, 4))
        assert torch.equal(got.logits, qlinear(h, want))  # the int8 product, not the float one
        assert not torch.equal(got.logits, model(tokens).logits)
        h2 = q.norm(q.run_layers(q.embed(tokens), 0, 2))
        assert torch.equal(got.exit_logits[2], qlinear(h2, want))


def test_untied_head_and_own_exit_matrices_are_quantized() -> None:
    exits = ExitConfig(layers=(1, 2), head="mlp", output="own")
    model = quantize_heads(_model(tie=False, exits=exits))
    assert isinstance(model.lm_head, QuantizedLinear)
    assert all(isinstance(e.proj, QuantizedLinear) for e in model.exits.values())
    assert all(type(e.mlp.w_in) is not QuantizedLinear for e in model.exits.values())
    assert model.tied_head is None  # the embedding is no output here
    tied_exits = ExitConfig(layers=(1, 2), output="tied_embedding")
    model = quantize_heads(_model(tie=False, exits=tied_exits))
    assert isinstance(model.lm_head, QuantizedLinear) and model.tied_head is not None
    assert model.exit_features(torch.zeros(1, 64), 1)[1].q is model.tied_head.q


def test_already_quantized_heads_are_kept_and_bad_widths_are_refused() -> None:
    q = quantize_model(_model(), "int4")
    embed = q.embed_tokens
    quantize_heads(q)
    assert isinstance(q.embed_tokens, QuantizedEmbedding) and q.embed_tokens is embed
    assert q.tied_head is None and q.output_embedding().kind == "int4"
    with pytest.raises(ConfigError, match="width 48"):
        quantize_heads(_model(dim=48))
    with pytest.raises(ConfigError, match="int3"):
        quantize_heads(_model(), "int3")


def test_int8_heads_round_trip_through_checkpoints_and_processes(tmp_path: Path) -> None:
    model = quantize_heads(_model())
    tokens = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        want = model(tokens).logits
    save_native(model, tmp_path / "m")
    back = load_model(str(tmp_path / "m")).model
    assert isinstance(back.tied_head, QuantizedLinear)
    again = rebuild_model(model.config, model_tensors(model), "test")  # spawned workers' way
    assert again.tied_head is not None and again.tied_head.q.data_ptr() == \
        model.tied_head.q.data_ptr()  # the same storage, no copy
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)
        assert torch.equal(again(tokens).logits, want)


def test_lossless_strategies_are_exact_with_own_int8_exit_matrices() -> None:
    """Exits with their own (int8) output matrices: drafts from them, verification by the int8
    LM head, so self-speculation emits plain decoding's tokens."""
    exits = ExitConfig(layers=(1, 2), head="linear", output="own")
    model = quantize_heads(_model(tie=False, exits=exits))
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 8)]
    runner = prepare(model)
    kw = {"max_new_tokens": 14, "threads": 1}
    ar = generate(runner, None, prompts, **kw).token_ids
    ss = generate(runner, None, prompts, strategy="self-spec", exit_layer=2,
                  num_speculations=3, **kw)
    assert ss.token_ids == ar and ss.stats.drafted > 0


@pytest.mark.parametrize("int8_activations", [True, False], indirect=True)
@torch.no_grad()
def test_the_native_runners_heads_follow_int8_activations(int8_activations: bool) -> None:
    """The native runner's quantized heads (an int8 head of a float model, an int4 model's
    tied head; final and early) take the product with int8 activations while the blocks do,
    float32 ones otherwise; greedy tokens are the argmax of those logits."""
    for model in (quantize_heads(_model()), quantize_model(_model(), "int4")):
        runner = prepare(model, backend="native")
        head = model.output_embedding()
        assert isinstance(head, QuantizedWeight)
        h = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(3))
        for layer in (2, model.num_layers):
            got = runner.logits(h, layer)
            want = qlinear(model.norm(h), head, int8_activations=int8_activations)
            assert torch.equal(got, want)
            other = qlinear(model.norm(h), head, int8_activations=not int8_activations)
            assert not torch.equal(got, other)
            assert runner.greedy(h, layer) == got[:, -1].argmax(-1).tolist()


def test_head_dtype_reaches_the_model_from_the_commands(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with pytest.raises(ConfigError, match="quantizes the heads already"):
        load_model("debug", dtype="int8", head_dtype="int8")
    assert isinstance(load_model("debug", head_dtype="int8").model.tied_head, QuantizedLinear)
    args = ["generate", "Hello", "--model", "debug", "--max-new-tokens", "5", "--json",
            "--strategy", "self-spec", "--exit-layer", "1"]
    assert main([*args, "--head-dtype", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["head_dtype"] == "int8" and len(out["sequences"][0]["token_ids"]) == 5
    assert main([*args, "--head-dtype", "int8", "--dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "int4" in err and "Traceback" not in err
    for cmd in (["serve"], ["bench"], ["lm-eval", "--tasks", "x"], ["humaneval"]):
        with pytest.raises(SystemExit):  # one shared definition: the same choices everywhere
            main([*cmd, "--head-dtype", "int9"])
        assert "int9" in capsys.readouterr().err


def test_convert_quantize_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "debug", str(tmp_path / "h8"), "--quantize-head", "int8"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "h8"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["dtype"], info["head_dtype"]) == ("float32", "int8")
    assert info["parameters"]["total"] == load_model("debug").model.num_parameters()
    assert isinstance(load_model(str(tmp_path / "h8")).model.tied_head, QuantizedLinear)
    assert main(["convert", "debug", str(tmp_path / "x"), "--quantize-head", "int8",
                 "--quantize", "int8"]) == 2
    assert main(["convert", "debug", str(tmp_path / "y"), "--quantize-head", "int8",
                 "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("--quantize-head") == 2 and "Traceback" not in err


@pytest.mark.real_model
@requires_default_model
def test_default_model_int8_head_self_spec_is_exact() -> None:
    """SmolLM2 fp32 with its tied head in int8: self-speculation (drafts through the native
    chain's int8 head) emits plain decoding's tokens with the same head."""
    loaded = load_model("default", head_dtype="int8",
                        exits=ExitConfig(every_layer=True, norm="final"))
    model = loaded.model
    assert loaded.tokenizer is not None and model.tied_head is not None
    ids = loaded.tokenizer.encode("def fibonacci(n):\n    ")
    runner = prepare(model)
    kw = {"max_new_tokens": 12, "threads": 1, "ignore_eos": True}
    ar = generate(runner, None, ids, **kw).token_ids
    ss = generate(runner, None, ids, strategy="self-spec", exit_layer=20,
                  num_speculations=3, **kw)
    assert ss.token_ids == ar
