"""Tensor-parallel decoding of int8/int4-quantized models: the shards hold slices of the
quantized weights as they are (rows of ``q``/``scales``/``mins``; input columns in whole
groups of 32), so TP=2 computes the products one process computes on the same weights, only
summed in two parts - in real gloo processes, on the quantized kernels and, with the native
library, in the fused native block with its shared-memory sums.

The token tests run with float32 activations (``EXITLM_INT8_ACTIVATIONS=0``): the native
blocks' default int8 activations round every product input to a step of its group's
``absmax / 127``, and on these sharp random models a last-bit difference of the residual
stream (two partial sums instead of one) was seen to move an input across a rounding boundary
within the first token (int4), after which the streams differ by far more than a last bit.
:func:`test_a_quantized_shards_blocks_are_native_calls_with_their_sums` checks the int8
activation path layer by layer instead: given the same input, a shard's block gives the
one-process block's output up to summation order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _byte_models import sharp_model
from _dist import free_port, run_processes
from _native import needs_native
from exitlm.comm.launch import join_group
from exitlm.config import ConfigError, ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.infer.executors.tp import TPExecutor
from exitlm.infer.executors.tp_shard import (
    QuantizedRowParallelLinear,
    check_quantized,
    shard_model,
)
from exitlm.kernels import native
from exitlm.kernels.quant import GROUP, QuantizedWeight, qlinear, quantize
from exitlm.kernels.quantized import QuantizedLinear, quantize_model
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import NativeRunner, prepare
from exitlm.runtime.runner import Runner

KINDS = ("int8", "int4")
VOCAB = 41  # odd: rank 1's rows of every output embedding are padded with a zero row
NEW = 16
MODELS: dict[str, dict[str, Any]] = {
    # LayerSkip exits through the tied (quantized) input embedding
    "layerskip": {"exits": ExitConfig(every_layer=True, norm="final")},
    # block exit heads (sharded like layers) with their own quantized output matrices
    "block-heads": {"exits": ExitConfig(layers=(1, 2, 3), head="block", output="own"),
                    "tie_embeddings": False},
}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("ar", {}),
    ("early-exit", {"threshold": 0.6}),
    ("self-spec", {"exit_layer": 2, "num_speculations": 3}),
]


def _model(kind: str, name: str = "layerskip") -> EarlyExitLM:
    """4 heads of 16 over 2 key/value heads: 32 attention-output columns per rank (one group);
    MLP width 96 = 3 groups, split 1 + 2 (32 and 64 columns)."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      hidden_dim=96, max_seq_len=128, **MODELS[name])
    return quantize_model(sharp_model(cfg, 2), kind)  # type: ignore[return-value]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 3)]


@pytest.fixture
def fp32_activations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Float32 activations in the native blocks of this process and of the ranks it spawns
    (the setting travels in the environment, which is restored afterwards)."""
    monkeypatch.setenv("EXITLM_INT8_ACTIVATIONS", "0")
    prev = native.set_int8_activations(False)
    yield
    native.set_int8_activations(prev)


@pytest.mark.parametrize("kind", KINDS)
def test_slices_are_slices_of_the_quantized_weight(kind: str) -> None:
    torch.manual_seed(0)
    qw = quantize(torch.randn(7, 4 * GROUP), kind)
    full = qw.dequantize()
    for a, b in ((0, 32), (32, 96), (64, 128), (0, 128)):
        part = qw.columns(a, b)
        assert part.shape == (7, b - a) and part.q.is_contiguous()
        assert torch.equal(part.dequantize(), full[:, a:b])
    assert torch.equal(qw[2:5].dequantize(), full[2:5])
    padded = qw[5:7].padded(4)
    assert torch.equal(padded.dequantize(), torch.cat([full[5:7], torch.zeros(2, 128)]))
    # the row-parallel products are partial sums of the whole weight's product
    x = torch.randn(3, 128)
    parts = qlinear(x[:, :32].contiguous(), qw.columns(0, 32)) + qlinear(
        x[:, 32:].contiguous(), qw.columns(32, 128))
    torch.testing.assert_close(parts, qlinear(x, qw), rtol=1e-5, atol=1e-5)
    for a, b in ((16, 64), (0, 48), (32, 32)):
        with pytest.raises(ValueError, match="whole groups of 32"):
            qw.columns(a, b)


def test_splits_that_would_cut_a_group_are_refused() -> None:
    def quantized(**kw: Any) -> EarlyExitLM:
        cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, max_seq_len=64, **kw)
        return quantize_model(sharp_model(cfg), "int8")  # type: ignore[return-value]

    heads16 = quantized(dim=64, num_heads=4, num_kv_heads=4, hidden_dim=96)
    check_quantized(heads16, 2)  # 2 heads of 16 per rank: one group each
    with pytest.raises(ConfigError, match=r"--tp 3: layers\.0\.attn\.wo .* input width 64 \(4 "
                                          r"heads x 16\), which 3 ranks would cut at column 16"):
        check_quantized(heads16, 3)
    # refused before any process starts
    with pytest.raises(ConfigError, match="--tp 3"):
        TPExecutor(heads16, 3)
    narrow = quantized(dim=128, num_heads=4, num_kv_heads=4, hidden_dim=64)
    check_quantized(narrow, 2)
    with pytest.raises(ConfigError, match=r"--tp 4: layers\.0\.mlp\.w_out .* width 64, 2 "
                                          r"group\(s\) for 4 ranks; choose --tp 2 or less"):
        check_quantized(narrow, 4)
    # float weights split anywhere
    check_quantized(sharp_model(ModelConfig(vocab_size=VOCAB, dim=64, num_heads=4,
                                            num_kv_heads=4, hidden_dim=96, num_layers=2)), 3)


@pytest.mark.parametrize(("kind", "shm"), [("int8", "1"), ("int4", "1"), ("int4", "0")],
                         ids=["int8-shared-memory", "int4-shared-memory", "int4-gloo"])
def test_tp2_on_quantized_weights_equals_one_process(
        kind: str, shm: str, monkeypatch: pytest.MonkeyPatch, fp32_activations: None) -> None:
    """Greedy ``ar``, ``early-exit`` (KV recomputation) and ``self-spec`` on one sequence
    (native blocks, when available) and on a batch of two (the torch path: quantized
    products from Python, prefill included) give one process's tokens and exit layers."""
    monkeypatch.setenv("EXITLM_TP_SHM", shm)  # inherited by the spawned rank
    torch.set_num_threads(1)
    prompts = _prompts()
    for name in MODELS:
        model = _model(kind, name)
        calls = [{"prompts": ps, "strategy": strategy, "max_new_tokens": NEW,
                  "ignore_eos": True, **kw}
                 for strategy, kw in CASES for ps in ([prompts[0]], prompts)]
        with TPExecutor(model, 2) as ranks:
            got = [generate(ranks, None, **call) for call in calls]
        early = 0
        for call, res in zip(calls, got, strict=True):
            ref = generate(model, None, threads=1, **call)
            what = (name, call["strategy"], len(call["prompts"]))
            for field in ("token_ids", "exit_layers"):
                assert [getattr(s, field) for s in res.sequences] == \
                    [getattr(s, field) for s in ref.sequences], (*what, field)
            if call["strategy"] == "early-exit":
                early += sum(layer < model.num_layers for s in res.sequences
                             for layer in s.exit_layers)
        assert early > 0, name  # the early-exit case really exits early
        # the caller's model is left whole
        assert isinstance(model.layers[0].attn.wo, QuantizedLinear)
        assert model.layers[0].mlp.w_out.weight.shape == (64, 96)


STEPS = 6


def _layer_steps(runner: Runner, inputs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``STEPS`` fixed tokens one at a time through the cache, layer by layer (one
    runner call each); returns every layer's input and output ``(steps, layers, dim)``. With
    ``inputs`` (another model's), each layer takes that input instead of the previous
    layer's output."""
    model = runner.model
    tokens = torch.randint(0, VOCAB, (STEPS,), generator=torch.Generator().manual_seed(5))
    cache = runner.new_cache(1, 32)
    ins, outs = [], []
    with torch.inference_mode():
        for i in range(STEPS):
            pos = torch.tensor([[i]])
            h = runner.embed(tokens[i].view(1, 1), pos)
            for j in range(model.num_layers):
                if inputs is not None:
                    h = inputs[i, j].view(1, 1, -1)
                ins.append(h.reshape(-1))
                h = runner.layers(h, j, j + 1, pos, cache)
                outs.append(h.reshape(-1))
    shape = (STEPS, model.num_layers, -1)
    return torch.stack(ins).view(shape), torch.stack(outs).view(shape)


def _native_shard(rank: int, world: int, port: int, root: str, kind: str) -> None:
    import exitlm.runtime.native as native_runner

    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        calls = [0]
        plain_chain = native_runner.run_chain

        def counted(run: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls[0] += len(run.blocks)  # blocks run by native calls
            return plain_chain(run, *args, **kwargs)

        native_runner.run_chain = counted  # type: ignore[assignment]  # this process only
        runner = prepare(shard_model(_model(kind), rank, world, timeout_s=30.0),
                         backend="native")
        assert isinstance(runner, NativeRunner)
        shard = runner.model
        layer = shard.layers[0]
        reducer = shard.output_layout.reducer  # type: ignore[union-attr]
        info = {
            "native": [b is not None and b.reducer is reducer is not None
                       for b in runner.blocks],
            "types": [type(layer.attn.wo).__name__, type(layer.mlp.w_out).__name__],
            "widths": [list(layer.attn.wo.weight.shape), list(layer.mlp.w_out.weight.shape),
                       list(layer.attn.wqkv.weight.shape), list(layer.mlp.w_in.weight.shape)],
        }
        ins, outs = _layer_steps(runner)
        info["native_calls"] = calls[0]
        if rank == 0:
            (Path(root) / "info.json").write_text(json.dumps(info))
            torch.save({"ins": ins, "outs": outs}, Path(root) / "layers.pt")
    finally:
        dist.destroy_process_group()


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_shards_blocks_are_native_calls_with_their_sums(kind: str,
                                                                   tmp_path: Path) -> None:
    """With the native kernels (and their default int8 activations), every block of a
    quantized shard is one ``block.c`` call that runs both sums through the shared-memory
    reducer; fed the same inputs, its outputs are the one-process block's up to the order of
    the fp32 sums (a wrong slice would be off by the size of the values)."""
    torch.set_num_threads(1)
    run_processes(_native_shard, (2, free_port(), str(tmp_path), kind), 2,
                  what="tensor-parallel ranks")
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["native"] == [True] * 4
    assert info["types"] == [QuantizedRowParallelLinear.__name__] * 2
    # rank 0: 2 query heads + 1 + 1 key/value heads of 16; MLP 1 group of 32 (gate and up)
    assert info["widths"] == [[64, 32], [64, 32], [64, 64], [64, 64]]
    assert info["native_calls"] == STEPS * 4
    got = torch.load(tmp_path / "layers.pt", weights_only=True)
    ref = prepare(_model(kind), backend="native")
    assert isinstance(ref, NativeRunner) and ref.blocks[0] is not None
    _, ref_outs = _layer_steps(ref, got["ins"])
    scale = ref_outs.abs().amax(dim=-1, keepdim=True)
    err = ((got["outs"] - ref_outs).abs() / scale).amax().item()
    assert err < 1e-4, err  # seen: 2.6e-7 (int8), 6.3e-6 (int4)


def test_sliced_weights_are_held_as_quantized_buffers() -> None:
    """One rank's shard (TP=1 needs no group) keeps the model's quantized modules on the
    model's own buffers - made in this process, and as a spawned rank makes it from the
    model's tensors (:func:`~exitlm.io.materialize.model_tensors`)."""
    from exitlm.infer.executors.tp_shard import rank_shard
    from exitlm.io.materialize import model_tensors

    model = _model("int4", "block-heads")
    for shard in (shard_model(model, 0, 1),
                  rank_shard(model.config, model_tensors(model), 0, 1, 30.0)):
        wo = shard.layers[1].attn.wo
        assert isinstance(wo, QuantizedLinear) and isinstance(wo.weight, QuantizedWeight)
        assert wo.q.data_ptr() == model.layers[1].attn.wo.q.data_ptr()  # no copy
        assert isinstance(shard.exits["2"].proj, QuantizedLinear)
        assert not any(t.is_meta for t in (*shard.parameters(), *shard.buffers()))
        tokens = torch.tensor([_prompts()[0]])
        with torch.no_grad():
            assert torch.equal(shard(tokens).logits, model(tokens).logits)
