"""Gradient equality of pipeline-parallel steps with a single-process reference.

The reference is plain autograd on the whole model of ``sum_m sum_i w_i L_i(m) / M``
(EE-LLM Eq. 1), averaged over data-parallel replicas; bubble-filling microbatches add the
partial contributions of EE-LLM App. C.2 (parameters of stages a microbatch's backward did
not reach get nothing from it). Each test spawns one group of gloo processes that runs several
cases in sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _pp_util import check_case, spawn

UNTIED = {"model": {"tie_embeddings": False},
          "exits": {"layers": (1, 2, 3), "output": "own", "norm": "own"}}

TWO = [
    # 1F1B, deferred exits (Optimization 1), exit 2 at the boundary moves to stage 1 (Opt. 2)
    {"name": "1f1b-deferred-tied", "pp": 2},
    # GPipe, exits in the forward step, boundary exit kept at the end of stage 0, exits tied
    # to the input embedding (replicated on both stages)
    {"name": "gpipe-eager-end-tied-emb", "pp": 2, "schedule": "gpipe", "deferred": False,
     "placement": "end",
     "exits": {"layers": (1, 2, 3), "head": "mlp", "output": "tied_embedding"}},
    # exits only on the first stage, final loss on the last
    {"name": "first-stage-exits", "pp": 2, "exits": {"layers": (1,), "head": "mlp"}},
    # exits only on the last stage, untied weights, uneven explicit boundaries
    {"name": "last-stage-exits-untied", "pp": 2, "boundaries": (1,),
     "model": {"tie_embeddings": False}, "exits": {"layers": (2, 3), "output": "own"}},
    # TeraPipe token slices of unequal length, 1F1B, deferred exits
    {"name": "1f1b-slices", "pp": 2, "slices": (5, 3, 4)},
    # slices with full transformer-block exits (their KV spans slices; not deferred)
    {"name": "gpipe-slices-block-exit", "pp": 2, "schedule": "gpipe", "deferred": False,
     "slices": (6, 6), "exits": {"layers": (1, 3), "head": "block"}},
    # LayerSkip: every layer exits through the shared final norm + head, with layer dropout
    {"name": "layerskip-dropout", "pp": 2, "dropout": 0.5,
     "exits": {"layers": (), "every_layer": True, "norm": "final"}},
    # one microbatch, final weight 0 (exit tuning's objective)
    {"name": "single-microbatch", "pp": 2, "microbatches": 1,
     "weights": {1: 0.5, 3: 1.0, 4: 0.0}},
]

FOUR = [
    {"name": "pp4-1f1b-deferred", "pp": 4},
    {"name": "pp4-gpipe-eager-end-slices", "pp": 4, "schedule": "gpipe", "deferred": False,
     "placement": "end", "slices": (4, 4, 4)},
    {"name": "pp4-1f1b-slices-tied-emb", "pp": 4, "microbatches": 4, "slices": (7, 5),
     "exits": {"layers": (1, 2, 3), "output": "tied_embedding"}},
    {"name": "pp2-dp2-1f1b", "pp": 2, "dp": 2, "slices": (6, 6)},
    {"name": "pp4-fill-both", "pp": 4, "fill": "both", "microbatches": 4, **UNTIED},
    {"name": "pp4-fill-warmup-gpipe", "pp": 4, "fill": "warmup", "schedule": "gpipe",
     "fill_microbatches": 3, **UNTIED},
]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp2")
    spawn(2, root, TWO)
    return root


@pytest.fixture(scope="module")
def four_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp4")
    spawn(4, root, FOUR)
    return root


@pytest.mark.parametrize("case", TWO, ids=[c["name"] for c in TWO])
def test_two_processes(two_runs: Path, case: dict) -> None:
    check_case(two_runs, case, 2)


@pytest.mark.parametrize("case", FOUR, ids=[c["name"] for c in FOUR])
def test_four_processes(four_runs: Path, case: dict) -> None:
    check_case(four_runs, case, 4)
