"""Quantized draft copies (runtime/draft_copy.py): the copy leaves its model as it was, owns
its tensors, says why it cannot run where it cannot, and is built once per model and kind."""

from __future__ import annotations

import pytest
import torch

from _ee_models import ee_model
from exitlm.kernels import native
from exitlm.kernels.quantized import QuantizedEmbedding, QuantizedLinear, quantize_model
from exitlm.model.layers import Linear
from exitlm.runtime import prepare
from exitlm.runtime.draft_copy import draft_runner, quantized_copy, unsupported

needs_native = pytest.mark.skipif(not native.available(), reason="no native library")


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor, tuple, bool]]:
    return {n: (p.data_ptr(), p.detach().clone(), p.stride(), p.requires_grad)
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("style", [{"every_layer": True}, {"head": "mlp", "gpt2": True}])
def test_the_copy_is_quantized_and_the_model_untouched(kind: str, style: dict) -> None:
    model = ee_model(**style)
    model.requires_grad_(True)
    classes = {n: type(m) for n, m in model.named_modules()}
    before = _snapshot(model)
    copy = quantized_copy(model, kind)
    assert {n: type(m) for n, m in model.named_modules()} == classes
    for name, (ptr, value, stride, grad) in before.items():
        p = model.get_parameter(name)
        assert (p.data_ptr(), p.stride(), p.requires_grad) == (ptr, stride, grad)
        assert torch.equal(p, value)
    assert isinstance(copy.embed_tokens, QuantizedEmbedding)
    linears = [m for m in copy.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.weight.kind == kind for m in linears)  # type: ignore[union-attr]
    assert not any(isinstance(m, torch.nn.Linear) for m in copy.modules())
    ours = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    theirs = {t.untyped_storage().data_ptr() for t in copy.state_dict().values()
              if isinstance(t, torch.Tensor)}
    assert not ours & theirs
    # what the copy computes is the model quantized the ordinary way
    ref = quantize_model(ee_model(**style), kind)
    x = torch.randint(0, 23, (1, 7))
    with torch.no_grad():
        assert torch.equal(copy(x).logits, ref(x).logits)


@needs_native
def test_unsupported_names_what_is_expected() -> None:
    model = ee_model(every_layer=True)
    assert unsupported(prepare(model, backend="native"), "int8") is None
    assert "native" in (unsupported(prepare(model, backend="eager"), "int8") or "")
    assert "int8" in (unsupported(prepare(model, backend="native"), "int3") or "")
    half = ee_model(every_layer=True).half()
    assert "float32" in (unsupported(prepare(half, backend="native"), "int8") or "")
    quantized = quantize_model(ee_model(every_layer=True), "int8")
    assert "already int8" in (unsupported(prepare(quantized, backend="native"), "int4") or "")
    with pytest.raises(ValueError, match="float32"):
        draft_runner(prepare(half, backend="native"), "int8")


@needs_native
def test_one_copy_per_model_and_kind_with_the_models_token_order() -> None:
    model = ee_model(every_layer=True)
    a = draft_runner(prepare(model, backend="native"), "int8")
    assert draft_runner(prepare(model, backend="native"), "int8") is a
    b = draft_runner(prepare(model, backend="native"), "int4")
    assert b is not a and b.model is not a.model
    assert a.model.token_order is None
    model.set_token_order(torch.arange(22, -1, -1))
    assert torch.equal(draft_runner(prepare(model, backend="native"), "int8").model.token_order,
                       model.token_order)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layers_that_cannot_be_quantized_are_kept_in_float16(kind: str) -> None:
    model = ee_model(every_layer=True, hidden=48)  # MLP outputs: input 48, not quantizable
    copy = quantized_copy(model, kind)
    outs = [m for n, m in copy.named_modules() if n.endswith("mlp.w_out")]
    assert len(outs) == 4 and all(type(m) is Linear and m.weight.dtype is torch.float16
                                  for m in outs)
    assert all(model.get_submodule(n).weight.dtype is torch.float32
               for n, _ in model.named_modules() if n.endswith("mlp.w_out"))
    # the copy computes the model quantized with those weights rounded to fp16 (in fp32)
    ref = ee_model(every_layer=True, hidden=48)
    with torch.no_grad():
        for n, m in ref.named_modules():
            if n.endswith("mlp.w_out"):
                m.weight.copy_(m.weight.half().float())
    quantize_model(ref, kind)
    x = torch.randint(0, 23, (2, 9))
    with torch.no_grad():
        assert torch.equal(copy(x).logits, ref(x).logits)
