"""The graph runner's layer step compiled by ``torch.compile`` (:mod:`exitlm.runtime.fused`).

The compiler backend here is ``aot_eager``: dynamo traces the layer and AOTAutograd
functionalises its in-place cache writes exactly as for inductor, and the traced graph runs
on eager kernels - so what is checked (the trace, the writes through a view of the cache,
one program serving every layer, few recompiles) holds for the GPU's inductor code without a
C++ compile here. tests/infer/test_cuda.py runs inductor's on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from _ee_models import ee_model, random_prompts
from exitlm.infer import generate
from exitlm.model.kv_cache import WritePlan
from exitlm.runtime.fused import FusedStep, LayerSlot
from exitlm.runtime.graphs import GraphRunner

NEW = 16

dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture
def compiled() -> Iterator[dict[str, int]]:
    """dynamo's statistics of this test's compiles, from a clean cache."""
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    yield counters["stats"]
    dynamo.reset()


def test_layer_slot_writes_where_the_cache_writes() -> None:
    """A slot's scatter at device positions lands where KVCache.write's does, through a view
    of the first S slots (what the runner hands the compiled step), and nowhere else."""
    model = ee_model("linear", every_layer=True)
    cache, want = model.new_cache(2, 96), model.new_cache(2, 96)
    k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    index = torch.tensor([[4, 5, 6], [0, 1, 2]])
    plan = WritePlan(end=64, start=-1, length=3, index=index, new_fill=torch.zeros(2).long())
    slot = LayerSlot(cache.keys[1][:, :, :64], cache.values[1][:, :, :64])
    keys, values = slot.write(1, k, v, plan)
    want.write(1, k, v, plan)
    assert keys.shape == values.shape == (2, 2, 64, 8)
    assert keys.data_ptr() == cache.keys[1].data_ptr()  # the cache's own memory
    for got, ref in zip(cache.keys + cache.values, want.keys + want.values, strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(cache.keys[1][0, :, 4:7], k[0])


@pytest.mark.parametrize("gpt2", [False, True])
def test_compiled_layers_decode_plain_greedy_tokens(gpt2: bool,
                                                    compiled: dict[str, int]) -> None:
    """AR, fixed exits and self-speculative rounds on the compiled step give the eager
    model's tokens over a padded batch; every layer of the 4 reuses one program, so the
    compiles stay a handful (a program per layer would be at least 4 for AR alone)."""
    model = ee_model("linear", every_layer=True, gpt2=gpt2)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    fixed = generate(model, None, prompts, strategy="early-exit", exit_layer=2,
                     max_new_tokens=NEW).token_ids
    runner = GraphRunner(model, capture=False, fuse="aot_eager")
    assert generate(runner, None, prompts, max_new_tokens=NEW).token_ids == ar
    assert 1 <= compiled["unique_graphs"] < model.num_layers  # layers share the program
    steps = compiled["calls_captured"]
    assert steps > 0
    assert generate(runner, None, prompts, strategy="early-exit", exit_layer=2,
                    max_new_tokens=NEW).token_ids == fixed
    spec = generate(runner, None, prompts, strategy="self-spec", exit_layer=2,
                    num_speculations=3, max_new_tokens=NEW)
    assert spec.token_ids == ar
    assert compiled["unique_graphs"] <= 8  # rows, positions, slots: dynamic after a change


def test_compiled_step_crosses_attention_windows(compiled: dict[str, int]) -> None:
    """A sequence growing past 64 attended slots (64 -> 128) keeps greedy tokens, and the
    new window size is a dynamic size of the same program, not one compile per size."""
    model = ee_model("mlp", every_layer=False)
    prompt = random_prompts(sizes=(7,))
    ar = generate(model, None, prompt, max_new_tokens=90).token_ids
    runner = GraphRunner(model, capture=False, fuse="aot_eager")
    assert generate(runner, None, prompt, max_new_tokens=90).token_ids == ar
    assert compiled["unique_graphs"] <= 2


def test_an_unknown_compiler_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown compiler backend 'triton'"):
        FusedStep("triton")
