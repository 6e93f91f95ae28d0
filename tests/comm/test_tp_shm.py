"""The shared-memory collectives of tensor-parallel decoding (``reduce.c``,
:mod:`exitlm.comm.native_reduce`, :mod:`exitlm.comm.shm`) in real
processes: rank-order sums with the same bits on every rank, gathers, tensors larger than a
round, a peer that never comes or fails, and the set-up leaving no file behind; then
tensor-parallel decoding with a rank count that does not divide the heads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _byte_models import sharp_model
from _dist import free_port, run_processes
from _ee_models import random_prompts
from _native import needs_native
from exitlm.comm.launch import join_group
from exitlm.comm.shm import shm_reducer
from exitlm.config import ExitConfig, ModelConfig
from exitlm.infer import generate
from exitlm.infer.executors.tp import TPExecutor
from exitlm.infer.executors.tp_shard import shard_model
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.sharding import share as split

pytestmark = needs_native


def _part(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)


def _collectives(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        red = shm_reducer(rank, world, timeout_s=30.0, capacity=64)
        assert red is not None
        out: dict[str, object] = {}
        for n in (5, 64, 1000):  # within one round, exactly one, 16 rounds
            x = _part(rank, n)
            got = red.sum_(x.clone())
            out[f"sum{n}"] = got.tolist()
            out[f"gather{n}"] = red.gather(x.view(-1, 5) if n % 5 == 0 else x).tolist()
        # fp16 / bf16 partial sums and logits go through shared memory too (added in fp32)
        from exitlm.infer.executors import tp_shard as tp_decode

        def no_gloo(*_a: object, **_k: object) -> None:
            raise AssertionError("gloo used")

        dist.all_reduce, dist.all_gather = no_gloo, no_gloo  # type: ignore[assignment]
        for dtype in (torch.float16, torch.bfloat16):
            part = _part(rank, 40).clamp(-1e3, 1e3).to(dtype)
            summed = tp_decode._sum_over_group(part.clone(), red, None)
            out[f"sum_{dtype}"] = summed.float().tolist()
            got = tp_decode._gather_over_group(part, world, red, None)
            out[f"gather_{dtype}"] = [g.float().tolist() for g in got]
            assert all(g.dtype == dtype for g in got)
        # every rank is past the set-up once a collective ran: rank 0 removed the file
        out["file_left"] = os.path.exists(red.path)
        (Path(root) / f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_sums_are_rank_ordered_and_equal_on_every_rank(tmp_path: Path) -> None:
    world = 3
    run_processes(_collectives, (world, free_port(), str(tmp_path)), world,
                  what="shared-memory ranks")
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for n in (5, 64, 1000):
        parts = [_part(r, n) for r in range(world)]
        want = (parts[0] + parts[1]) + parts[2]  # rank order, as every rank adds
        for o in outs:
            assert o[f"sum{n}"] == want.tolist()  # bit for bit, on every rank
            stacked = torch.tensor(o[f"gather{n}"]).reshape(world, n)
            assert torch.equal(stacked, torch.stack(parts))
    for dtype in (torch.float16, torch.bfloat16):
        parts = [_part(r, 40).clamp(-1e3, 1e3).to(dtype) for r in range(world)]
        want = ((parts[0].float() + parts[1].float()) + parts[2].float()).to(dtype).float()
        for o in outs:
            assert o[f"sum_{dtype}"] == want.tolist()
            assert o[f"gather_{dtype}"] == [x.float().tolist() for x in parts]
    assert not any(o["file_left"] for o in outs)  # rank 0 removed the file after set-up


def _stalls(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        red = shm_reducer(rank, world, timeout_s=1.0)
        assert red is not None
        msgs = []
        if rank == 0:
            for _ in range(2):  # rank 1 first never comes, then marks itself failed
                try:
                    red.sum_(torch.ones(4))
                except RuntimeError as err:
                    msgs.append(str(err))
                # the abort must be what ends the second wait, however slow the machine
                red._region.timeout_s = 60.0
                dist.barrier()
        else:
            dist.barrier()  # rank 0 gave up waiting
            red.abort()
            dist.barrier()
        (Path(root) / f"{rank}.json").write_text(json.dumps(msgs))
    finally:
        dist.destroy_process_group()


def test_a_missing_or_failed_peer_is_an_error_not_a_hang(tmp_path: Path) -> None:
    run_processes(_stalls, (2, free_port(), str(tmp_path)), 2, what="shared-memory ranks",
                  timeout=120)
    msgs = json.loads((tmp_path / "0.json").read_text())
    assert msgs == ["a tensor-parallel peer did not reach the collective within 1 s",
                    "a tensor-parallel peer failed (it marked the shared collective aborted)"]


def _dies(rank: int, world: int, port: int, root: str) -> None:
    import time

    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    red = shm_reducer(rank, world, timeout_s=60.0)
    assert red is not None
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word: no abort, no collective
    t0 = time.monotonic()
    try:
        red.sum_(torch.ones(4))
        msg = "no error"
    except RuntimeError as err:
        msg = str(err)
    (Path(root) / "0.json").write_text(json.dumps([msg, time.monotonic() - t0]))
    os._exit(0)  # the group's peer is gone: skip its teardown


def test_a_killed_peer_is_noticed_before_the_timeout(tmp_path: Path) -> None:
    run_processes(_dies, (2, free_port(), str(tmp_path)), 2, what="shared-memory ranks",
                  timeout=120)
    msg, waited = json.loads((tmp_path / "0.json").read_text())
    assert msg == "a tensor-parallel peer's process exited"
    assert waited < 20  # not the 60 s timeout


def test_split_is_contiguous_and_covers() -> None:
    assert [split(3, r, 2) for r in range(2)] == [(0, 1), (1, 3)]
    assert [split(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [split(51, r, 2) for r in range(2)] == [(0, 25), (25, 51)]


def _uneven_model() -> EarlyExitLM:
    """SmolLM2's shape in miniature: 3 key/value heads of 2 query heads each, an MLP width
    that 2 does not divide, LayerSkip exits."""
    return sharp_model(ModelConfig(vocab_size=29, dim=36, num_layers=4, num_heads=6,
                                   num_kv_heads=3, hidden_dim=51, max_seq_len=96,
                                   exits=ExitConfig(every_layer=True, norm="final")))


CASES = [("ar", {}), ("early-exit", {"threshold": 0.6}),
         ("self-spec", {"exit_layer": 2, "num_speculations": 3})]


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_tp2_with_uneven_heads_equals_one_process(shm: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXITLM_TP_SHM", shm)  # inherited by the spawned rank
    torch.set_num_threads(1)
    model = _uneven_model()
    prompts = random_prompts()[:2]
    with TPExecutor(model, 2) as ranks:
        for strategy, kw in CASES:
            common = {"strategy": strategy, "max_new_tokens": 12, "ignore_eos": True, **kw}
            ref = generate(model, None, prompts, threads=1, **common)
            got = generate(ranks, None, prompts, **common)
            assert [s.token_ids for s in got.sequences] == [s.token_ids for s in ref.sequences]
            assert [s.exit_layers for s in got.sequences] == [s.exit_layers
                                                              for s in ref.sequences]


def _native_shard(rank: int, world: int, port: int, root: str) -> None:
    from exitlm.runtime import NativeRunner, prepare

    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        runner = prepare(shard_model(_uneven_model(), rank, world, timeout_s=30.0),
                         backend="native")
        assert isinstance(runner, NativeRunner)
        shard = runner.model
        attn = shard.layers[0].attn
        nb = runner.blocks[0]
        reducer = shard.output_layout.reducer  # type: ignore[union-attr]
        info = {"heads": [attn.num_heads, attn.num_kv_heads], "hidden": shard.layers[0].mlp.hidden,
                "native_reduces": nb is not None and nb.reducer is reducer is not None}
        res = generate(runner, None, [random_prompts()[0]], max_new_tokens=10, ignore_eos=True,
                       threads=1)
        info["tokens"] = res.sequences[0].token_ids
        (Path(root) / f"{rank}.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


def test_a_shards_block_is_one_native_call_with_its_sums(tmp_path: Path) -> None:
    """With the native kernels, a shard's blocks run ``block.c`` with the reducer (both sums
    inside the call), one sequence decodes through them, and the tokens are one process's."""
    run_processes(_native_shard, (2, free_port(), str(tmp_path)), 2, what="tensor-parallel ranks")
    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [i["heads"] for i in infos] == [[2, 1], [4, 2]]
    assert [i["hidden"] for i in infos] == [25, 26]
    assert all(i["native_reduces"] for i in infos)
    ref = generate(_uneven_model(), None, [random_prompts()[0]], max_new_tokens=10,
                   ignore_eos=True, threads=1)
    assert infos[0]["tokens"] == infos[1]["tokens"] == ref.sequences[0].token_ids
