"""The tensor-parallel sharding plan training and decoding share: every rank holds whole
key/value heads with their query groups, the ranks' shares cover every row once, training's
rank-major order gives each rank the rows decoding slices out, and bad settings are one line."""

from __future__ import annotations

import pytest
import torch

from exitlm.config import ConfigError, ModelConfig
from exitlm.plan.sharding import (
    attention_shard,
    check_even,
    check_whole_heads,
    mlp_shard,
    rank_major_order,
    share,
    vocab_rows,
)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 2), (8, 4, 4), (4, 2, 2),
                                                       (6, 6, 4)])
def test_attention_shards_cover_every_row_once_with_whole_groups(heads: int, kv_heads: int,
                                                                  tp: int) -> None:
    d = 8
    shards = [attention_shard(heads, kv_heads, d, r, tp) for r in range(tp)]
    rows = torch.cat([torch.arange(a, b) for s in shards for a, b in s.rows])
    assert sorted(rows.tolist()) == list(range((heads + 2 * kv_heads) * d))
    group = heads // kv_heads
    for s in shards:
        assert s.heads == s.kv_heads * group and s.kv_heads >= 1  # whole GQA groups
        assert s.q[1] - s.q[0] == s.heads * d and s.k[1] - s.k[0] == s.kv_heads * d
    assert sum(s.kv_heads for s in shards) == kv_heads


def test_training_order_gives_each_rank_the_rows_decoding_slices() -> None:
    """An even split of the rank-major rows (DTensor's Shard(0)) is each rank's decoding
    slice, for the fused q/k/v and gate/up weights."""
    heads, kv_heads, d, hidden, tp = 8, 4, 4, 24, 2
    w = torch.arange((heads + 2 * kv_heads) * d).float()
    order = rank_major_order([attention_shard(heads, kv_heads, d, r, tp).rows
                              for r in range(tp)])
    chunks = w[order].chunk(tp)
    for r in range(tp):
        s = attention_shard(heads, kv_heads, d, r, tp)
        assert torch.equal(chunks[r], torch.cat([w[a:b] for a, b in s.rows]))
    up = torch.arange(2 * hidden).float()
    order = rank_major_order([mlp_shard(hidden, r, tp, gated=True).rows for r in range(tp)])
    for r, chunk in enumerate(up[order].chunk(tp)):
        s = mlp_shard(hidden, r, tp, gated=True)
        assert torch.equal(chunk, torch.cat([up[a:b] for a, b in s.rows]))
        assert s.hidden == hidden // tp


def test_grouped_mlp_shares_cut_between_groups_and_vocabulary_rows_pad() -> None:
    s = [mlp_shard(96, r, 2, gated=False, group=32) for r in range(2)]
    assert [x.own for x in s] == [(0, 32), (32, 96)]
    assert share(9, 0, 2) == (0, 4) and share(9, 1, 2) == (4, 9)
    assert [vocab_rows(23, r, 2) for r in range(2)] == [(0, 12, 12), (12, 23, 12)]
    assert [len(c) for c in torch.arange(23).chunk(2)] == [12, 11]  # torch.chunk agrees


def test_bad_splits_name_their_setting() -> None:
    cfg = ModelConfig(vocab_size=32, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      hidden_dim=96)
    check_even(cfg, 2)
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide model.num_heads=4"):
        check_even(cfg, 3)
    check_whole_heads(cfg, 2)
    with pytest.raises(ConfigError, match=r"--tp 3: expected at most the model's 2 key/value"):
        check_whole_heads(cfg, 3)
    with pytest.raises(ConfigError, match="--tp 0: expected a positive"):
        check_whole_heads(cfg, 0)
