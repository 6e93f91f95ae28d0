"""Quantized models (issue 16): int8/int4 modules equal a float model holding the dequantized
weights, every lossless strategy stays token-identical to plain decoding on quantized
weights, quantized checkpoints round-trip, and GGUF blocks load without a float copy."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _byte_models import sharp_model
from _default_model import requires_default_model
from exitlm.cli import main
from exitlm.config import ConfigError, ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.io import load_model
from exitlm.io.native import save_native
from exitlm.kernels import native
from exitlm.kernels.quant import QuantizedWeight
from exitlm.kernels.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    is_quantized,
    quantize_model,
    quantized_numel,
)
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare

KINDS = ("int8", "int4")
VOCAB = 40


def _model(*, exits: ExitConfig | None = None, seed: int = 0, tie: bool = True) -> EarlyExitLM:
    """A random 4-layer Llama-family model with dims that are multiples of 32; large weights
    make greedy choices sharp (few near-ties)."""
    return sharp_model(ModelConfig(
        vocab_size=VOCAB, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=128, tie_embeddings=tie,
        exits=exits or ExitConfig(every_layer=True, norm="final")), seed)


def _dequantized_twin(model: EarlyExitLM, quantized: EarlyExitLM) -> EarlyExitLM:
    """``model`` with every weight replaced by the values ``quantized`` holds."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in quantized.named_modules():
            if isinstance(mod, QuantizedLinear | QuantizedEmbedding):
                ref.get_submodule(name).weight.copy_(mod.weight.dequantize())
    return ref


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [True, False])
def test_quantized_logits_equal_dequantized_float_model(kind: str, tie: bool) -> None:
    model = _model(tie=tie, exits=ExitConfig(layers=(1, 2), head="mlp"))
    q = quantize_model(copy.deepcopy(model), kind)
    assert is_quantized(q) == kind
    assert isinstance(q.embed_tokens, QuantizedEmbedding)
    assert isinstance(q.layers[0].attn.wqkv, QuantizedLinear)
    assert isinstance(q.exits["1"].mlp.w_in, QuantizedLinear)
    assert quantized_numel(q) == sum(p.numel() for n, p in model.named_parameters()
                                     if p.dim() == 2)
    ref = _dequantized_twin(model, q)
    tokens = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        a, b = q(tokens, exit_layers=(1, 2)), ref(tokens, exit_layers=(1, 2))
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    for layer in (1, 2):
        torch.testing.assert_close(a.exit_logits[layer], b.exit_logits[layer],
                                   rtol=1e-4, atol=1e-4)
    # and the quantized weights are close to the float ones (int4 coarser than int8)
    w = model.layers[1].mlp.w_in.weight
    err = (q.layers[1].mlp.w_in.weight.dequantize() - w).abs().mean() / w.abs().mean()
    assert err < (0.01 if kind == "int8" else 0.15)


@pytest.mark.parametrize("kind", KINDS)
def test_lossless_strategies_are_token_identical_on_quantized_weights(kind: str) -> None:
    model = quantize_model(_model(), kind)
    torch.manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 3)]
    kw = {"max_new_tokens": 20, "threads": 1}
    ar = generate(model, None, prompts, **kw).token_ids
    for e, d in ((1, 3), (2, 4)):
        ss = generate(model, None, prompts, strategy="self-spec", exit_layer=e,
                      num_speculations=d, **kw)
        assert ss.token_ids == ar, (e, d)
        assert ss.stats.drafted > 0
    small = generate(model, None, prompts, strategy="self-spec", exit_layer=2,
                     num_speculations=3, draft_vocab=9, **kw)
    assert small.token_ids == ar
    # one sequence decodes through the native blocks (int8 activations by default), a batch
    # through torch: compare PPD, which takes one prompt, with plain decoding of that prompt
    ppd = generate(model, None, prompts[0], strategy="ppd", ppd_layer=2, **kw)
    assert ppd.token_ids == generate(model, None, prompts[0], **kw).token_ids
    ee = generate(model, None, prompts, strategy="early-exit", threshold=1.0, **kw)
    assert ee.token_ids == ar


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("int8_activations", [True, False], indirect=True)
def test_one_sequence_is_exact_through_native_blocks(kind: str, int8_activations: bool) -> None:
    """One prompt decodes through the native blocks, with int8 activations by default: plain
    steps, verification chunks of up to 21 rows (past the torch lean step's 16) and PPD round
    alike, so the lossless strategies stay token-identical; switching the setting changes the
    logits (it is in use)."""
    model = quantize_model(_model(seed=2), kind)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = {"max_new_tokens": 40, "threads": 1}
    ar = generate(model, None, prompt, **kw).token_ids
    for e, d in ((1, 3), (2, 20)):
        ss = generate(model, None, prompt, strategy="self-spec", exit_layer=e,
                      num_speculations=d, **kw)
        assert ss.token_ids == ar, (e, d)
        assert ss.stats.drafted > 0
    assert generate(model, None, prompt, strategy="ppd", ppd_layer=2, **kw).token_ids == ar
    ee = generate(model, None, prompt, strategy="early-exit", threshold=1.0, **kw)
    assert ee.token_ids == ar
    runner = prepare(model)  # one sequence over a cache: the native blocks
    step = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]

    def forward() -> torch.Tensor:
        h = runner.layers(runner.embed(step, pos), 0, model.num_layers, pos,
                          model.new_cache(1, 64))
        return runner.logits(h, model.num_layers)

    with torch.no_grad():
        mine = forward()
        native.set_int8_activations(not int8_activations)
        other = forward()
        native.set_int8_activations(int8_activations)
    assert not torch.equal(mine, other)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_checkpoint_round_trip(kind: str, tmp_path: Path) -> None:
    model = quantize_model(_model(), kind)
    save_native(model, tmp_path / "q")
    back = load_model(str(tmp_path / "q")).model
    assert is_quantized(back) == kind
    tokens = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)
    size = (tmp_path / "q" / "model.safetensors").stat().st_size
    save_native(_model(), tmp_path / "f")
    assert size < (tmp_path / "f" / "model.safetensors").stat().st_size / 3


def test_convert_quantize_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "debug", str(tmp_path / "q8"), "--quantize", "int8"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q8"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "int8"
    plain = load_model("debug").model
    assert info["parameters"]["total"] == plain.num_parameters()
    assert main(["convert", "debug", str(tmp_path / "hf"), "--quantize", "int4",
                 "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "--quantize" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="int3"):
        load_model("debug", dtype="int3")


@pytest.mark.parametrize("ggml", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_become_quantized_weights_exactly(ggml: str) -> None:
    from gguf import GGMLQuantizationType, quants

    from exitlm.io.gguf_quant import blocks_to_weight

    qtype = GGMLQuantizationType[ggml]
    w = np.random.default_rng(0).normal(size=(7, 96)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    qw = blocks_to_weight(raw, ggml, (7, 96))
    assert isinstance(qw, QuantizedWeight)
    assert qw.kind == ("int8" if ggml == "Q8_0" else "int4")
    want = quants.dequantize(raw, qtype).reshape(7, 96)
    np.testing.assert_array_equal(qw.dequantize().numpy(), want)


@requires_default_model
def test_default_model_int4_keeps_the_gguf_weights() -> None:
    """The embedded GGUF is Q4_1 (embedding Q8_0): loaded as int4 its blocks are used as they
    are, so logits equal the fp32 model's (dequantized from the same blocks) up to summation
    order; int8 re-quantizes the Q4_1 layers and stays close."""
    f, q = load_model("default"), load_model("default", dtype="int4")
    assert isinstance(q.model.layers[0].mlp.w_in, QuantizedLinear)
    assert q.model.layers[0].mlp.w_in.kind == "int4"
    assert q.model.embed_tokens.kind == "int8"
    ids = torch.tensor([f.tokenizer.encode("def fibonacci(n):\n    return")])
    with torch.no_grad():
        a, b = f.model(ids).logits, q.model(ids).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-3)


def test_generate_cli_takes_quantized_dtypes(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["generate", "Hello", "--model", "debug", "--dtype", "int4",
                 "--max-new-tokens", "5", "--json", "--strategy", "self-spec",
                 "--exit-layer", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "int4" and len(out["sequences"][0]["token_ids"]) == 5
    with pytest.raises(SystemExit):  # argparse: one line naming the choices
        main(["generate", "Hello", "--model", "debug", "--dtype", "int9"])
    assert "int9" in capsys.readouterr().err
