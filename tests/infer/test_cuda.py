"""The decoding strategies on a CUDA device (skipped without one; CI has none).

On CUDA, PPD runs each branch on its own stream, the path CPU tests never reach. Every lossless
strategy must still give the tokens of greedy decoding on the same device, for single prompts
and (AR, early exit, self-spec) padded batches.
"""

from __future__ import annotations

import pytest
import torch
from _ee_models import ee_model, random_prompts

from exitlm.infer import generate

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
