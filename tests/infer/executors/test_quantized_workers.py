"""Quantized models in the decoding processes exitlm spawns: PPD's branch worker and the
pipeline stages rebuild the model on the parent's quantized weights (shared memory, no copy)
with the parent's kernels and int8-activation setting, so their tokens equal one process's.

Found by running them: the stage processes used to rebuild a plain model and assign the
quantized buffers beside random weights (wrong tokens, silently), the PPD worker did not
start, and moving the weights to shared memory left the parent's native blocks pointing at
the old storage (its steps fell back to torch, other rounding). Tensor-parallel ranks take
shards of the same quantized weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _byte_models import sharp_model
from _native import needs_native
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.infer.executors.pipeline import PipelineExecutor
from exitlm.infer.executors.tp import TPExecutor
from exitlm.kernels import native
from exitlm.kernels.quantized import quantize_model
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import NativeRunner, prepare

pytestmark = needs_native

VOCAB = 40
NEW = 24


def _model(kind: str) -> EarlyExitLM:
    return quantize_model(sharp_model(ModelConfig(
        vocab_size=VOCAB, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=96,
        max_seq_len=128, exits=ExitConfig(every_layer=True, norm="final")), 2), kind)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 3)]


def _tokens(model: Any, prompt: list[int], **kw: object) -> tuple[list, list]:
    res = generate(model, None, [prompt], max_new_tokens=NEW, ignore_eos=True, threads=1, **kw)
    return res.sequences[0].token_ids, res.sequences[0].exit_layers


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_ppd_worker_process_on_quantized_weights(kind: str) -> None:
    torch.set_num_threads(1)
    model = _model(kind)
    runner = prepare(model)
    for p in _prompts():
        ar = _tokens(model, p)[0]
        got = generate(runner, None, [p], strategy="ppd", ppd_layer=2, ppd_workers="process",
                       max_new_tokens=NEW, ignore_eos=True, threads=1)
        assert got.sequences[0].token_ids == ar
        assert got.stats.matches > 0
    # the runner's calls follow the weights into shared memory (the worker's spawn moved
    # them) and stay native
    if isinstance(runner, NativeRunner):
        cache = runner.new_cache(1, 32)
        assert all(runner._serves(i, cache) for i in range(model.num_layers))


def test_pipeline_stages_on_quantized_weights() -> None:
    torch.set_num_threads(1)
    model = _model("int8")
    early = 0
    with torch.inference_mode(), PipelineExecutor(prepare(model), 2) as stages:
        for thr in (0.6, 1.0):
            for p in _prompts():
                ref = _tokens(model, p, strategy="early-exit", threshold=thr)
                got = _tokens(stages, p, strategy="early-exit", threshold=thr, kv="pipeline")
                assert got == ref, (thr, p)
                early += sum(layer < model.num_layers for layer in got[1])
                if thr == 1.0:
                    assert got[0] == _tokens(model, p)[0]
    assert early > 0


def test_tensor_parallel_ranks_on_quantized_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tp`` on quantized weights (it used to be refused): the self-started rank rebuilds
    the quantized modules from the parent's buffers and keeps the parent's activation setting,
    so with float32 activations its tokens are one process's (int8 activations and the other
    strategies: tests/parallel/test_tp_quantized.py)."""
    torch.set_num_threads(1)
    monkeypatch.setenv("EXITLM_INT8_ACTIVATIONS", "0")
    prev = native.set_int8_activations(False)  # exported to the spawned rank
    try:
        model = _model("int4")
        kw = {"strategy": "early-exit", "threshold": 0.6, "max_new_tokens": NEW,
              "ignore_eos": True}
        with TPExecutor(model, 2) as ranks:
            got = generate(ranks, None, _prompts()[:1], **kw)
        ref = generate(model, None, _prompts()[:1], threads=1, **kw)
    finally:
        native.set_int8_activations(prev)
    assert got.sequences[0].token_ids == ref.sequences[0].token_ids
    assert got.sequences[0].exit_layers == ref.sequences[0].exit_layers
    assert min(got.sequences[0].exit_layers) < model.num_layers
