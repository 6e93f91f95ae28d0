"""Cutting a model into stages: layer ranges, exit placement (EE-LLM App. A.2), parameter
ownership and replication, and the parallel config's errors."""

from __future__ import annotations

import copy

import pytest
import torch

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.config import ConfigError
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.pipeline.stage import (
    build_stages,
    prune_to_stage,
    shared_parameter_users,
    split_layers,
    stage_parameter_names,
)


def test_split_layers() -> None:
    assert split_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(8, 3, (2, 7)) == [(0, 2), (2, 7), (7, 8)]
    with pytest.raises(ConfigError, match="every stage needs"):
        split_layers(2, 3)
    with pytest.raises(ConfigError, match="increase"):
        split_layers(8, 3, (5, 5))
    with pytest.raises(ConfigError, match="pp - 1"):
        split_layers(8, 3, (4,))


def test_exit_placement_at_stage_boundaries() -> None:
    cfg = preset("debug", num_layers=8, exits=ExitConfig(layers=(2, 3, 4, 6)))
    nxt = build_stages(cfg, 2)  # layers 1-4 | 5-8; exit 4 sits on the boundary
    assert [s.exits for s in nxt] == [(2, 3), (4, 6)]  # Optimization 2: next stage's start
    end = build_stages(cfg, 2, placement="end")
    assert [s.exits for s in end] == [(2, 3, 4), (6,)]
    assert nxt[1].loss_layers == (4, 6, 8)
    every = build_stages(preset("debug", exits=ExitConfig(every_layer=True)), 4)
    assert [s.exits for s in every] == [(), (1,), (2,), (3,)]


def test_parameters_partition_the_model_with_tied_weights_replicated() -> None:
    cfg = preset("debug", exits=ExitConfig(layers=(1, 3), head="mlp"))
    model = EarlyExitLM(cfg)
    specs = build_stages(model, 2)
    names = [stage_parameter_names(model, s) for s in specs]
    assert set().union(*names) == {n for n, _ in model.named_parameters()}
    shared = shared_parameter_users(model, specs)
    # tied input embedding = LM head, used by stage 0 (embedding) and stage 1 (head + exits)
    assert shared == {"embed_tokens.weight": [0, 1]}
    assert "exits.1.mlp.w_in.weight" in names[0] and "layers.3.mlp.w_in.weight" in names[1]


def test_prune_keeps_only_the_stage() -> None:
    model = EarlyExitLM(preset("debug", exits=ExitConfig(layers=(1, 3))))
    ref = copy.deepcopy(model)
    spec = build_stages(model, 2)[1]
    owned = prune_to_stage(model, spec)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == owned
    assert not any(n.startswith("layers.0.") for n, _ in model.named_parameters())
    held = {n for n, p in model.named_parameters() if p.numel() > 0}
    assert held == owned
    h = torch.randn(1, 5, model.config.dim)
    torch.testing.assert_close(model.run_layers(h, 2, 4), ref.run_layers(h, 2, 4))


def test_parallel_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.pp"):
        ParallelConfig(pp=0)
    with pytest.raises(ConfigError, match="token_slices"):
        ParallelConfig(token_slices="many")
    with pytest.raises(ConfigError, match="boundaries"):
        ParallelConfig(pp=3, boundaries=(2,))
    with pytest.raises(ConfigError, match="sum to"):
        ParallelConfig(token_slices=[3, 3]).slice_lengths(8)
    assert ParallelConfig(token_slices=3).slice_lengths(8) == (3, 3, 2)
    with pytest.raises(ConfigError, match="processes"):
        ParallelDims.build(4, 0, pp=2, dp=3)
    g = ParallelDims.build(4, 3, pp=2)
    assert (g.stage, g.replica, g.dp_ranks(), g.pipeline_ranks()) == (1, 1, [1, 3], [2, 3])
