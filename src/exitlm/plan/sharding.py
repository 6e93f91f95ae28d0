"""Tensor parallelism's one sharding plan: which rows and columns of every weight rank ``r`` of
``T`` holds (Megatron-LM's layout, which EE-LLM trains and decodes under, EE-LLM Sec. 3.1).

* attention: rank ``r`` keeps key/value heads ``share(Hkv, r, T)`` and the query heads of
  their grouped-query groups - rows of each section of the fused ``wqkv`` projection
  (column-parallel) and the matching input columns of ``wo`` (row-parallel: partial outputs
  summed over the ranks);
* MLP: rank ``r`` keeps ``share(F, r, T)`` of the hidden width (whole quantization groups when
  the weights are grouped) - rows of both halves of the fused gate/up ``w_in``, columns of
  ``w_out``;
* output embeddings (the LM head, exits' own matrices, a tied input embedding): vocabulary
  rows ``[r n, (r + 1) n)`` with ``n = ceil(V / T)``, the last rank's padded.

Training applies the plan with DTensor (:mod:`exitlm.train.parallel.tensor`), whose shards must
be even (:func:`check_even`): a fused weight's rows are put in rank-major order
(:func:`rank_major_order`) and split in ``T`` equal chunks. Decoding applies it to plain tensors
(:mod:`exitlm.infer.executors.tp_shard`), where any ``T`` up to ``Hkv`` works (:func:`share`
gives every rank whole key/value heads, within one of even). With an even split both give each
rank the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exitlm.config import ConfigError, ModelConfig

Range = tuple[int, int]


def share(n: int, rank: int, tp: int) -> Range:
    """Rank ``rank``'s contiguous share ``[a, b)`` of ``n`` items over ``tp`` ranks: even when
    ``tp`` divides ``n``, otherwise within one item of even (9 heads in 3 groups over 2
    ranks: one group and two)."""
    return rank * n // tp, (rank + 1) * n // tp


@dataclass(frozen=True)
class AttentionShard:
    """Rank ``r``'s part of an attention layer: rows ``q``, ``k``, ``v`` of the fused
    ``wqkv`` (and of its bias), input columns ``q`` of ``wo``, and its local head counts."""

    q: Range
    k: Range
    v: Range
    heads: int
    kv_heads: int

    @property
    def rows(self) -> list[Range]:
        return [self.q, self.k, self.v]


def attention_shard(heads: int, kv_heads: int, head_dim: int, rank: int, tp: int
                    ) -> AttentionShard:
    """Rank ``rank``'s key/value heads ``share(kv_heads, rank, tp)`` and their query heads
    (grouped-query groups stay whole on one rank)."""
    k0, k1 = share(kv_heads, rank, tp)
    g, d = heads // kv_heads, head_dim
    q = (k0 * g * d, k1 * g * d)
    k = ((heads + k0) * d, (heads + k1) * d)
    v = ((heads + kv_heads + k0) * d, (heads + kv_heads + k1) * d)
    return AttentionShard(q, k, v, (k1 - k0) * g, k1 - k0)


@dataclass(frozen=True)
class MLPShard:
    """Rank ``r``'s part of an MLP: rows of ``w_in`` (each half of a gated one), input columns
    ``own`` of ``w_out``, and its local hidden width."""

    rows: list[Range]
    own: Range

    @property
    def hidden(self) -> int:
        return self.own[1] - self.own[0]


def mlp_shard(hidden: int, rank: int, tp: int, *, gated: bool, group: int = 1) -> MLPShard:
    """Rank ``rank``'s share of the hidden width, cut between ``group``-wide groups (a
    quantized ``w_out``'s scales cover 32 input columns each)."""
    g0, g1 = share(hidden // group, rank, tp)
    own = (g0 * group, g1 * group)
    rows = [own, (hidden + own[0], hidden + own[1])] if gated else [own]
    return MLPShard(rows, own)


def vocab_rows(vocab: int, rank: int, tp: int) -> tuple[int, int, int]:
    """Rank ``rank``'s vocabulary rows ``[a, b)`` of an output embedding and the padded shard
    size ``n = ceil(vocab / tp)`` (``torch.chunk``'s split, which DTensor's ``Shard(0)``
    follows too)."""
    n = math.ceil(vocab / tp)
    return rank * n, min(vocab, (rank + 1) * n), n


def rank_major_order(shards: list[list[Range]]) -> torch.Tensor:
    """The row order ``[rank 0's rows | rank 1's rows | ...]`` of a fused weight, given every
    rank's row ranges (``shards[r]``): after ``W[order]`` an even split in ``T`` chunks gives
    rank ``r`` exactly its rows."""
    return torch.cat([torch.arange(a, b) for ranges in shards for a, b in ranges])


def check_even(cfg: ModelConfig, tp: int, setting: str = "parallel.tp") -> None:
    """Raise a :class:`ConfigError` naming ``setting`` unless heads, key/value heads and the
    MLP width divide evenly by ``tp`` (DTensor's shards are equal)."""
    if tp == 1:
        return
    sizes = {"model.num_heads": cfg.num_heads, "model.num_kv_heads": cfg.n_kv_heads,
             "model.hidden_dim": cfg.hidden_dim}
    for key, n in sizes.items():
        if n % tp:
            ok = [d for d in range(1, n + 1) if n % d == 0 and all(v % d == 0
                                                                  for v in sizes.values())]
            raise ConfigError(f"{setting}={tp} does not divide {key}={n}: every rank needs "
                              f"the same number of them; use {setting} in {ok}")


def check_whole_heads(cfg: ModelConfig, tp: int, setting: str = "--tp") -> None:
    """Raise a :class:`ConfigError` naming ``setting`` unless every rank gets at least one
    key/value head (and so a whole group of query heads) and one MLP row."""
    if tp < 1:
        raise ConfigError(f"{setting} {tp}: expected a positive number of processes")
    if tp > cfg.n_kv_heads:
        raise ConfigError(f"{setting} {tp}: expected at most the model's {cfg.n_kv_heads} "
                          "key/value heads (each rank keeps whole grouped-query groups)")
