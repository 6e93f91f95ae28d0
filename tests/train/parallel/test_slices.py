"""TeraPipe token slices in one process: slicing a sequence changes no gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.train.losses import multi_exit_loss
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.pipeline.engine import PipelineEngine
from exitlm.train.parallel.pipeline.executor import Microbatch


@pytest.mark.parametrize("head,deferred,gpt2", [("linear", True, False), ("mlp", False, False),
                                                ("block", False, False),
                                                ("linear", True, True)])
def test_slices_match_one_backward_over_the_sequence(head: str, deferred: bool,
                                                     gpt2: bool) -> None:
    name = "debug-gpt2" if gpt2 else "debug"
    cfg = preset(name, exits=ExitConfig(layers=(1, 2), head=head), dim=32, num_heads=2,
                 hidden_dim=64)
    ref = EarlyExitLM(cfg)
    model = copy.deepcopy(ref)
    weights = {1: 0.3, 2: 0.5, cfg.num_layers: 1.0}
    batches = []
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (2, 14))
        batches.append(Microbatch(x[:, :-1], x[:, 1:]))
    for b in batches:
        (multi_exit_loss(ref, b.tokens, b.labels, weights).total / 2).backward()
    eng = PipelineEngine(model, ParallelConfig(deferred_exits=deferred),
                         ParallelDims.build(1, 0, 1), microbatches=2, slices=(5, 1, 7),
                         device=torch.device("cpu"))
    stats = eng.run(batches, weights)
    assert set(stats.exit_ce) == set(weights)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-4, atol=1e-6, msg=n)


def test_block_exits_cannot_be_deferred_across_slices() -> None:
    from exitlm.config import ConfigError

    model = EarlyExitLM(preset("debug", exits=ExitConfig(layers=(1,), head="block")))
    with pytest.raises(ConfigError, match="deferred_exits=false"):
        PipelineEngine(model, ParallelConfig(), ParallelDims.build(1, 0, 1), microbatches=1,
                       slices=(4, 4), device=torch.device("cpu"))
