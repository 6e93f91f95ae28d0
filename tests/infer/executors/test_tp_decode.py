"""Tensor-parallel decoding in real gloo processes: every strategy it serves gives the tokens
of one process (greedy and seeded sampling), on Llama- and GPT-2-style tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _dist import free_port, run_processes
from _ee_models import ee_model, random_prompts
from exitlm.comm.launch import join_group
from exitlm.config import ConfigError
from exitlm.infer import Engine, SamplingOptions, generate
from exitlm.infer.executors.tp import TPExecutor
from exitlm.infer.executors.tp_shard import check_strategy, shard_model
from exitlm.infer.strategies import get_strategy
from exitlm.plan.sharding import check_whole_heads as check_tp

CASES: list[tuple[str, dict[str, Any]]] = [
    ("ar", {}),
    ("ar", {"temperature": 0.9, "seed": 5}),
    ("early-exit", {"threshold": 0.6}),
    ("early-exit", {"threshold": 1.0}),
    ("self-spec", {"exit_layer": 2, "num_speculations": 3}),
]
MODELS = {"llama-block": {"head": "block"}, "gpt2-mlp": {"head": "mlp", "gpt2": True}}


def _decode_all(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, Any]:
    out = {}
    for i, (strategy, kw) in enumerate(CASES):
        res = generate(model, None, prompts, strategy=strategy, max_new_tokens=16,
                       ignore_eos=True, threads=1, **kw)
        out[str(i)] = [[s.token_ids, s.exit_layers] for s in res.sequences]
    return out


def _worker(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 90.0)
    try:
        for name, kw in MODELS.items():
            model = shard_model(ee_model(**kw), rank, world)
            attn = model.layers[0].attn
            assert attn.num_heads == 4 // world and attn.num_kv_heads == 2 // world
            torch.manual_seed(1)
            got = _decode_all(model, random_prompts())
            if rank == 0:
                (Path(root) / f"{name}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_tp2_equals_one_process(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run_processes(_worker, (2, free_port(), str(tmp_path)), 2, what="tensor-parallel ranks")
    for name, kw in MODELS.items():
        model = ee_model(**kw)
        torch.manual_seed(1)
        ref = _decode_all(model, random_prompts())
        got = json.loads((tmp_path / f"{name}.json").read_text())
        for i in ref:
            assert got[i] == ref[i], (name, CASES[int(i)])
        early = sum(layer < 4 for seq in got["2"] for layer in seq[1])
        assert early > 5  # the early-exit case really exits early


def test_self_started_ranks_serve_one_engine_after_another() -> None:
    torch.set_num_threads(1)
    model = ee_model("linear", vocab=23)  # 23 is not divisible by 2: padded vocabulary shards
    prompts = random_prompts()
    ref = generate(model, None, prompts, strategy="early-exit", threshold=0.7,
                   max_new_tokens=12, ignore_eos=True, threads=1)
    with TPExecutor(model, 2) as ranks:
        got = generate(ranks, None, prompts, strategy="early-exit", threshold=0.7,
                       max_new_tokens=12, ignore_eos=True)
        again = generate(ranks, None, prompts[:2], strategy="ar", max_new_tokens=6)
        # prompts over 4 tokens in parts: the ranks replay the parts in step
        engine = Engine(ranks, None, "self-spec", get_strategy("self-spec").options(
            exit_layer=2), prefill_chunk=4)
        sampling = SamplingOptions(max_new_tokens=7, ignore_eos=True)
        parts = [engine.submit(p, sampling) for p in prompts]
        engine.run()
        engine.close()
    assert again.token_ids == generate(model, None, prompts[:2], max_new_tokens=6).token_ids
    assert [r.token_ids for r in parts] == generate(
        model, None, prompts, strategy="self-spec", exit_layer=2, sampling=sampling).token_ids
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in ref.sequences]
    # the caller's model is left whole
    assert model.layers[0].attn.num_heads == 4


def test_bad_tp_settings() -> None:
    cfg = ee_model("linear").config
    with pytest.raises(ConfigError, match=r"--tp 3: expected at most the model.s 2 key/value"):
        check_tp(cfg, 3)
    with pytest.raises(ConfigError, match="--tp runs --strategy"):
        check_strategy("ppd", {})
    with pytest.raises(ConfigError, match="--kv recompute"):
        check_strategy("early-exit", {"kv": "pipeline"})


def test_tp4_self_spec_with_gqa() -> None:
    from exitlm.config import ExitConfig, ModelConfig
    from exitlm.model.transformer import EarlyExitLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, dim=32, num_layers=4, num_heads=8, num_kv_heads=4,
                      hidden_dim=64, max_seq_len=96, exits=ExitConfig(layers=(2,), head="mlp"))
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
    prompts = random_prompts()
    kw = {"strategy": "self-spec", "exit_layer": 2, "max_new_tokens": 12, "ignore_eos": True}
    ref = generate(model, None, prompts, threads=1, **kw)
    with TPExecutor(model, 4) as ranks:
        got = generate(ranks, None, prompts, **kw)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in ref.sequences]


def test_unseeded_sampling_draws_one_seed_for_every_rank() -> None:
    """Sampling without ``--seed``: rank 0 draws the seed for all ranks. Before, each rank
    drew its own, fed its shard other tokens than its peers (nonsense text) and, on a model
    with an end token, stopped at another length and left its peers waiting."""
    from exitlm.infer.executors.tp import draw_seed

    torch.set_num_threads(1)
    model = ee_model("linear", eos=(3,))
    prompts = random_prompts()[:1]
    kw = {"temperature": 1.0, "max_new_tokens": 24}
    torch.manual_seed(11)
    with TPExecutor(model, 2, timeout_s=30.0) as ranks:
        got = generate(ranks, None, prompts, **kw)
    torch.manual_seed(11)
    seed = draw_seed()
    ref = generate(model, None, prompts, threads=1, seed=seed, **kw)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in ref.sequences]
