"""A model whose weights are inference tensors (made under ``torch.inference_mode``: loaded,
converted or quantized inside it) decodes as the same model made outside it. Inference tensors
keep no version counter; the caches of copies made from weights (int4 blocks, greedy screens,
sliced heads) and the native blocks' checks key them on where they live
(:mod:`exitlm.kernels.versions`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _byte_models import sharp_model
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.kernels import native
from exitlm.kernels.quantized import quantize_model
from exitlm.kernels.versions import INFERENCE, version_of
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare

# a head of 4096 rows: greedy steps read its screen (screen.MIN_ROWS) once 32 tokens are ahead
CFG = ModelConfig(vocab_size=4096, dim=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  hidden_dim=96, max_seq_len=128,
                  exits=ExitConfig(every_layer=True, norm="final"))
CASES: list[tuple[str, dict[str, Any]]] = [
    ("ar", {}),
    ("self-spec", {"exit_layer": 1, "num_speculations": 3}),
    ("early-exit", {"threshold": 0.6}),
]


def _model(kind: str) -> EarlyExitLM:
    model = sharp_model(CFG, 4)
    if kind == "float16":
        return model.half()
    return model if kind == "float32" else quantize_model(model, kind)  # type: ignore[return-value]


def test_inference_tensors_count_as_one_version() -> None:
    with torch.inference_mode():
        t = torch.zeros(3)
        t.add_(1)
    assert version_of(t) == INFERENCE
    u = torch.zeros(3)
    before = version_of(u)
    u.add_(1)
    assert version_of(u) == before + 1


@pytest.mark.parametrize("kind", ["float32", "float16", "int8", "int4"])
def test_a_model_made_in_inference_mode_decodes_as_one_made_outside(kind: str) -> None:
    ref = _model(kind)
    with torch.inference_mode():
        model = _model(kind)
    assert all(t.is_inference() for t in (*model.parameters(), *model.buffers()))
    prompt = torch.randint(0, CFG.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    for strategy, kw in CASES:
        call = {"strategy": strategy, "max_new_tokens": 40, "ignore_eos": True, **kw}
        want = generate(ref, None, prompt.tolist(), **call)
        got = generate(model, None, prompt.tolist(), **call)
        assert got.token_ids == want.token_ids, (kind, strategy)
        assert [s.exit_layers for s in got.sequences] == \
            [s.exit_layers for s in want.sequences], (kind, strategy)


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_preparing_keeps_inference_weights_inference_tensors(backend: str) -> None:
    """Re-strided (column-major fp32 for OpenBLAS' GEMV) or moved weights stay inference
    tensors: a normal tensor put under an inference tensor's ``.data`` loses its version
    counter, and every later op on it raises."""
    if backend == "native" and native.library() is None:
        pytest.skip("no native library")
    with torch.inference_mode():
        model = _model("float32")
        half = _model("float16")
    prepare(model, backend=backend)  # type: ignore[arg-type]
    assert all(p.is_inference() for p in model.parameters())
    quantize_model(half, "int8")  # outside inference mode: its float16 norms become float32
    assert all(p.is_inference() for p in half.parameters())
    tokens = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        for m in (model, half):
            assert torch.isfinite(m(tokens).logits).all()
