"""Tensor parallelism alone and composed with pipeline and data parallelism: gradients equal a
single-process autograd reference of ``sum_m sum_i w_i L_i(m) / M`` (EE-LLM Eq. 1).

Every rank gathers its shards into whole tensors (undoing the rank-major order of fused
projections) and must match the reference, so a wrong head split, a missing all-reduce of a
replicated parameter or a vocabulary shard that sees the wrong rows shows up by name.
Exits: linear / MLP / transformer-block heads, own output matrices or tied to the (sharded)
input embedding or final head, LayerSkip every-layer exits with layer dropout (every rank of
a tensor-parallel group drops the same rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _pp_util import check_case, spawn

MLP_OWN = {"model": {"tie_embeddings": False},
           "exits": {"layers": (1, 3), "head": "mlp", "output": "own", "norm": "own"}}
LAYERSKIP = {"dropout": 0.5, "exits": {"layers": (), "every_layer": True, "norm": "final"}}

TWO = [
    # tp=2 alone: linear exits sharing the tied embedding / head (vocabulary-sharded)
    {"name": "tp2-linear-tied", "tp": 2, "flat": True},
    # MLP heads sharded like layers, own norms and own vocabulary-sharded output matrices
    {"name": "tp2-mlp-own", "tp": 2, "flat": True, **MLP_OWN},
    # a transformer-block exit (its attention heads split) tied to the input embedding
    {"name": "tp2-block-tied-embedding", "tp": 2, "flat": True,
     "exits": {"layers": (2,), "head": "block", "output": "tied_embedding"}},
    # LayerSkip: every layer exits through the shared final norm + head, layer dropout
    {"name": "tp2-layerskip-dropout", "tp": 2, "flat": True, **LAYERSKIP},
    # sequence parallelism with GPT-2's LayerNorm, biases and learned positions
    {"name": "tp2-sp-gpt2-mlp", "tp": 2, "sp": True, "flat": True, "preset": "debug-gpt2",
     "model": {"num_kv_heads": 4}, "exits": {"layers": (1, 2), "head": "mlp"}},
    # sequence parallelism with block exits that own their output matrices
    {"name": "tp2-sp-block-own", "tp": 2, "sp": True, "flat": True,
     "model": {"tie_embeddings": False}, "exits": {"layers": (1, 3), "head": "block",
                                                    "output": "own", "norm": "own"}},
]

FOUR = [
    # tp=4: one query head and one key/value head per rank, exits on the untied final head
    {"name": "tp4-final-head", "tp": 4, "flat": True, "model": {"tie_embeddings": False},
     "exits": {"layers": (1, 2, 3), "output": "final_head"}},
    # pp=2 x tp=2: EE-LLM Eq. 2 through stages, deferred exits, the tied embedding
    # replicated on both stages (its shards summed shard by shard)
    {"name": "pp2-tp2-1f1b-deferred", "pp": 2, "tp": 2},
    # pp=2 x tp=2 with sequence parallelism, GPipe, exits in the forward step, token slices
    {"name": "pp2-tp2-sp-gpipe-eager-slices", "pp": 2, "tp": 2, "sp": True,
     "schedule": "gpipe", "deferred": False, "slices": (6, 6), **MLP_OWN},
    # pp=2 x tp=2 LayerSkip with dropout
    {"name": "pp2-tp2-layerskip-dropout", "pp": 2, "tp": 2, **LAYERSKIP},
    # dp=2 x tp=2 without a pipeline: shards averaged over replicas
    {"name": "dp2-tp2-mlp-own", "dp": 2, "tp": 2, "flat": True, **MLP_OWN},
]

EIGHT = [
    # pp=2 x dp=2 x tp=2 on 8 processes
    {"name": "pp2-dp2-tp2", "pp": 2, "dp": 2, "tp": 2,
     "exits": {"layers": (1, 2, 3), "head": "mlp"}},
]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp2")
    spawn(2, root, TWO)
    return root


@pytest.fixture(scope="module")
def four_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp4")
    spawn(4, root, FOUR)
    return root


@pytest.fixture(scope="module")
def eight_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp8")
    spawn(8, root, EIGHT, timeout=300.0)
    return root


@pytest.mark.parametrize("case", TWO, ids=[c["name"] for c in TWO])
def test_two_processes(two_runs: Path, case: dict) -> None:
    check_case(two_runs, case, 2)


@pytest.mark.parametrize("case", FOUR, ids=[c["name"] for c in FOUR])
def test_four_processes(four_runs: Path, case: dict) -> None:
    check_case(four_runs, case, 4)


@pytest.mark.parametrize("case", EIGHT, ids=[c["name"] for c in EIGHT])
def test_eight_processes(eight_runs: Path, case: dict) -> None:
    check_case(eight_runs, case, 8)
