"""A CPU runner's products (:class:`~exitlm.runtime.products.Products`): the same values as
the model's own layers, whatever layout and packed copies they use; stale packed copies are
never used; hooks on a layer still run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.kernels import native
from exitlm.runtime import prepare
from exitlm.runtime.products import Products
from exitlm.runtime.runner import Runner


def _model(**exit_kw: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exit_kw))  # type: ignore[arg-type]
    return EarlyExitLM(cfg).eval()


def _forward(runner: Runner, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1])[None]
        h = runner.layers(runner.embed(tokens, pos), 0, layer, pos, None)
        return runner.logits(h, layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_keep_values_and_layouts_suit_the_kernels(dtype: torch.dtype) -> None:
    model = _model(layers=(1,), output="own").to(dtype)
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        before = model(tokens)
    runner = prepare(model, pack_rows=True)
    wide, narrow = model.layers[0].attn.wqkv.weight, model.layers[0].attn.wo.weight
    # column-major only for fp32 weights with out > in that OpenBLAS multiplies; the native
    # blocks read their weights by rows
    assert wide.is_contiguous() == (dtype != torch.float32 or native.available())
    assert narrow.is_contiguous()
    # an output embedding: read by rows by exitlm's kernels, else OpenBLAS' layout
    head = model.exits["1"].proj.weight
    assert head.is_contiguous() == (dtype != torch.float32 or native.available())
    # fp16 prefill products run as fp32 GEMM (rounded differently)
    tol = {"atol": 2e-3, "rtol": 1e-2} if dtype == torch.float16 else {}
    torch.testing.assert_close(_forward(runner, tokens, 4), before.logits, **tol)
    torch.testing.assert_close(_forward(runner, tokens, 1), before.exit_logits[1], **tol)
    with torch.no_grad():  # the model's own forward still computes what it did
        torch.testing.assert_close(model(tokens).logits, before.logits)


def test_packed_bf16_weights_follow_in_place_updates() -> None:
    """A weight changed after packing (an optimizer step) must not use the stale copy."""
    model = _model().to(torch.bfloat16)
    products = Products(model)
    x = torch.randn(1, 1, model.config.dim, dtype=torch.bfloat16)
    lin = model.layers[0].mlp.w_in
    with torch.no_grad():
        torch.testing.assert_close(products(lin, x), F.linear(x, lin.weight))
        lin.weight.mul_(2)
        torch.testing.assert_close(products(lin, x), F.linear(x, lin.weight))


def test_hooks_on_a_layer_still_run() -> None:
    model = _model()
    products = Products(model)
    lin = model.layers[0].mlp.w_in
    seen: list[int] = []
    handle = lin.register_forward_hook(lambda *_: seen.append(1))
    try:
        with torch.no_grad():
            products(lin, torch.randn(1, 1, model.config.dim))
    finally:
        handle.remove()
    assert seen == [1]


def test_fp16_prefill_through_the_products_matches_fp32() -> None:
    """Many-row fp16 products run as fp32 GEMM and are cast back."""
    model = _model()
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        ref = model(tokens).logits
    half = _forward(prepare(model.half()), tokens, model.num_layers).float()
    torch.testing.assert_close(half, ref, atol=2e-2, rtol=2e-2)
