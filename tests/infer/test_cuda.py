"""The decoding strategies on a CUDA device (skipped without one; CI has none).

On CUDA, PPD runs each branch on its own stream, the path CPU tests never reach. Every lossless
strategy must still give the tokens of greedy decoding on the same device, for single prompts
and (AR, early exit, self-spec) padded batches.
"""

from __future__ import annotations

import pytest
import torch

from _ee_models import BUDGETS, ee_model, random_prompts, self_spec_with_budgets
from exitlm.infer import generate
from exitlm.runtime import GraphRunner, prepare
from exitlm.runtime.runner import Runner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW = 24


def _cuda_model(head: str, every: bool) -> torch.nn.Module:
    return ee_model(head, every_layer=every).to("cuda")


@pytest.mark.parametrize(("head", "every"), [("linear", True), ("mlp", False)])
def test_lossless_strategies_match_greedy_on_cuda(head: str, every: bool) -> None:
    model = _cuda_model(head, every)
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    singles = [generate(model, None, [p], max_new_tokens=NEW).token_ids[0] for p in prompts]
    assert ar == singles  # padded batch == one by one
    spec = generate(model, None, prompts, strategy="self-spec", exit_layer=2,
                    num_speculations=3, max_new_tokens=NEW)
    assert spec.token_ids == ar
    ee = generate(model, None, prompts, strategy="early-exit", threshold=1.0,
                  max_new_tokens=NEW)
    assert ee.token_ids == ar
    for p, want in zip(prompts, ar, strict=True):
        for parallel in (True, False):  # CUDA streams, then sequential branches
            got = generate(model, None, [p], strategy="ppd", ppd_layer=3, ppd_k=2,
                           parallel=parallel, max_new_tokens=NEW)
            assert got.token_ids == [want], parallel
            assert got.stats.forks == NEW - 2  # one per decoded token but the last


def test_kv_recomputation_matches_cpu_decisions_on_cuda() -> None:
    """Confidence exits with KV recomputation on CUDA give the CPU run's tokens when the
    model and prompts are the same (exit decisions are far from the threshold here)."""
    cpu = ee_model("linear", every_layer=True)
    gpu = ee_model("linear", every_layer=True).to("cuda")
    prompt = random_prompts(sizes=(7,))
    a = generate(cpu, None, prompt, strategy="early-exit", threshold=0.5, max_new_tokens=NEW)
    b = generate(gpu, None, prompt, strategy="early-exit", threshold=0.5, max_new_tokens=NEW)
    assert b.token_ids == a.token_ids
    assert b.sequences[0].exit_layers == a.sequences[0].exit_layers
    assert min(a.sequences[0].exit_layers) < 4  # some tokens really exited early


def _runners(model: torch.nn.Module) -> tuple[GraphRunner, Runner]:
    """The model's CUDA-graph runner (what prepare() gives a CUDA model) and its eager one."""
    graphs = prepare(model)
    assert isinstance(graphs, GraphRunner) and graphs.capture
    return graphs, prepare(model, backend="eager")


def test_cuda_graphs_give_the_eager_tokens() -> None:
    """AR, fixed exit and self-speculative rounds on the graph runner give the eager
    runner's tokens (fp32), over padded batches and lengths that cross attention windows
    (64 -> 128 -> 160 slots) and grow the engine's pool."""
    model = _cuda_model("linear", True)
    graphs, eager = _runners(model)
    prompts = random_prompts(sizes=(5, 9, 3))
    long = 120
    ar = generate(eager, None, prompts, max_new_tokens=long).token_ids
    fixed = generate(eager, None, prompts, strategy="early-exit", exit_layer=2,
                     max_new_tokens=NEW).token_ids
    assert generate(graphs, None, prompts, max_new_tokens=long).token_ids == ar
    assert graphs.captures > 0
    assert generate(graphs, None, prompts, strategy="early-exit", exit_layer=2,
                    max_new_tokens=NEW).token_ids == fixed
    for d in (1, 4):
        before = graphs.captures
        spec = generate(graphs, None, prompts, strategy="self-spec", exit_layer=2,
                        num_speculations=d, max_new_tokens=long)
        assert spec.token_ids == ar, d
        assert graphs.captures > before  # the rounds' chains and layers were graphs
    for p, want in zip(prompts, ar, strict=True):  # one sequence at a time
        got = generate(graphs, None, [p], strategy="self-spec", exit_layer=3,
                       num_speculations=3, max_new_tokens=long).token_ids
        assert got == [want]


def test_cuda_graph_rounds_with_rows_leaving() -> None:
    """Rows with their own budgets leave the batch at different rounds; each keeps the
    tokens it gets decoded alone, eagerly."""
    model = _cuda_model("mlp", False)
    graphs, eager = _runners(model)
    prompts = random_prompts(sizes=(4, 7, 6, 2))
    alone = [generate(eager, None, [p], max_new_tokens=n).token_ids[0]
             for p, n in zip(prompts, BUDGETS, strict=True)]
    assert self_spec_with_budgets(graphs, prompts, 3) == alone


def test_cuda_graph_ppd_equals_greedy_and_eager_ppd() -> None:
    """PPD on the graph runner (branches replayed on their own streams, or one after
    another) gives greedy tokens and the same confirmed predictions as eager PPD."""
    model = _cuda_model("linear", True)
    graphs, eager = _runners(model)
    prompts = random_prompts(sizes=(5, 9, 3))
    opts = {"strategy": "ppd", "ppd_layer": 3, "ppd_k": 2, "max_new_tokens": NEW}
    want = [generate(eager, None, [p], max_new_tokens=NEW).token_ids for p in prompts]
    serial = [generate(eager, None, [p], parallel=False, **opts) for p in prompts]
    for parallel in (True, False):
        for p, w, e in zip(prompts, want, serial, strict=True):
            got = generate(graphs, None, [p], parallel=parallel, **opts)
            assert got.token_ids == w == e.token_ids, parallel
            assert (got.stats.forks, got.stats.matches) == (e.stats.forks, e.stats.matches)
    assert graphs.captures > 0


def test_fused_layer_steps_give_the_eager_tokens() -> None:
    """The graph runner whose layer steps inductor compiled (:mod:`exitlm.runtime.fused`)
    gives the eager runner's tokens (fp32): AR over lengths that cross attention windows,
    self-speculative rounds, and PPD with its branch on a second stream."""
    model = _cuda_model("linear", True)
    fused, eager = prepare(model, backend="fused"), prepare(model, backend="eager")
    assert isinstance(fused, GraphRunner) and fused.capture and fused.fused is not None
    prompts = random_prompts(sizes=(5, 9, 3))
    ar = generate(eager, None, prompts, max_new_tokens=90).token_ids
    assert generate(fused, None, prompts, max_new_tokens=90).token_ids == ar
    spec = generate(fused, None, prompts, strategy="self-spec", exit_layer=2,
                    num_speculations=3, max_new_tokens=90)
    assert spec.token_ids == ar
    for p in prompts:
        want = generate(eager, None, [p], max_new_tokens=NEW).token_ids
        got = generate(fused, None, [p], strategy="ppd", ppd_layer=3, ppd_k=2,
                       max_new_tokens=NEW)
        assert got.token_ids == want
    assert fused.captures > 0
