"""The shared-memory channels between pipeline stages (``channel.c``,
:mod:`exitlm.comm.native_channel`, :func:`exitlm.comm.shm.shm_channels`,
:mod:`exitlm.comm.shm_p2p`) in real processes: bytes arrive whole and in order,
also messages many times the ring's size; a wait ends on its deadline, on an aborting peer
and on a killed one; an idle receiver sleeps instead of spinning; the set-up leaves no file
behind; and the pipeline decodes the same over shared memory and over gloo."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import free_port, run_processes
from _ee_models import ee_model, random_prompts
from _native import needs_native
from exitlm.comm.launch import join_group
from exitlm.comm.native_channel import DEAD, PEER, TIMEOUT, ChannelError
from exitlm.comm.p2p import P2P
from exitlm.comm.shm import pipeline_pairs, shm_channels
from exitlm.comm.shm_p2p import ChannelP2P
from exitlm.infer import generate
from exitlm.infer.executors.pipeline import PipelineExecutor
from exitlm.runtime import prepare

pytestmark = needs_native

CAP = 4096  # a small ring: the large messages below go through in hundreds of pieces


def _message(i: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(i), dtype=torch.float64)


def _traffic(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        ends = shm_channels(rank, world, capacity=CAP)
        assert ends is not None
        assert set(ends) == {p for p in pipeline_pairs(world) if rank in p}
        sizes = (1, 37, CAP // 8, 50_000)  # bytes: 8, 296, exactly the ring, 100 rings
        out: dict[str, object] = {}
        if rank == 0:  # every rank has mapped the file: rank 0 has removed it
            out["file_left"] = any(n.startswith(f"exitlm-pp-{os.getpid()}-")
                                   for n in os.listdir(ends[(0, 1)].path.parent))
            for i, n in enumerate(sizes):
                ends[(0, 1)].send(_message(i, n), 30.0)
            out["back"] = all(
                torch.equal(ends[(s, 0)].recv((n,), torch.float64, 30.0),
                            _message(100 * s + i, n))
                for s in range(1, world) for i, n in enumerate(sizes))
        else:
            first = 0 if rank == 1 else 10  # what stage rank - 1 sent down
            out["down"] = all(
                torch.equal(ends[(rank - 1, rank)].recv((n,), torch.float64, 30.0),
                            _message(first + i, n)) for i, n in enumerate(sizes))
            if rank + 1 < world:
                for i, n in enumerate(sizes):
                    ends[(rank, rank + 1)].send(_message(10 + i, n), 30.0)
            for i, n in enumerate(sizes):
                ends[(rank, 0)].send(_message(100 * rank + i, n), 30.0)
        (Path(root) / f"{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_messages_arrive_whole_and_in_order(tmp_path: Path) -> None:
    """Three stages: every stage's channel to the next and back to stage 0, messages from
    8 bytes to 100 times the ring, each bit for bit; no file left under /dev/shm."""
    world = 3
    run_processes(_traffic, (world, free_port(), str(tmp_path)), world, what="channel ranks")
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    assert outs[0]["back"] is True
    assert outs[1]["down"] is True and outs[2]["down"] is True
    assert outs[0]["file_left"] is False


def _failures(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    ends = shm_channels(rank, world, capacity=CAP)
    assert ends is not None
    out: dict[str, object] = {}
    if rank == 0:
        t0 = time.monotonic()
        try:  # nothing comes: the deadline ends the wait
            ends[(1, 0)].recv((4,), torch.float64, 0.3)
        except ChannelError as err:
            out["timeout"] = [err.code, time.monotonic() - t0]
        dist.barrier()  # rank 1 aborts its end after this
        try:
            ends[(1, 0)].recv((4,), torch.float64, 60.0)
        except ChannelError as err:
            out["abort"] = err.code
        dist.barrier()  # rank 1 exits without a word after this
        t0 = time.monotonic()
        try:  # a send larger than the ring blocks until the dead receiver is noticed
            ends[(0, 1)].send(torch.zeros(4 * CAP, dtype=torch.uint8), 60.0)
        except ChannelError as err:
            out["dead"] = [err.code, time.monotonic() - t0]
        (Path(root) / "0.json").write_text(json.dumps(out))
        os._exit(0)  # the group's peer is gone: skip its teardown
    dist.barrier()
    ends[(1, 0)].abort()
    dist.barrier()
    os._exit(0)


def test_deadline_abort_and_dead_peer_end_a_wait(tmp_path: Path) -> None:
    run_processes(_failures, (2, free_port(), str(tmp_path)), 2, what="channel ranks",
                  timeout=120)
    out = json.loads((tmp_path / "0.json").read_text())
    code, waited = out["timeout"]
    assert code == TIMEOUT and 0.25 < waited < 10
    assert out["abort"] == PEER
    code, waited = out["dead"]
    assert code == DEAD and waited < 20  # not the 60 s deadline


def _idle(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port, 60.0)
    try:
        ends = shm_channels(rank, world)
        assert ends is not None
        dist.barrier()
        if rank == 0:
            time.sleep(1.5)
            ends[(0, 1)].send(torch.tensor([time.monotonic()], dtype=torch.float64), 5.0)
        else:
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            sent = ends[(0, 1)].recv((1,), torch.float64, None)  # no deadline
            late = time.monotonic() - float(sent[0])
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            used = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            (Path(root) / "1.json").write_text(json.dumps([used, late]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_idle_receiver_sleeps(tmp_path: Path) -> None:
    """A stage waiting for its next command (a server's pipeline idles for hours) must not
    spin on its core: 1.5 s of waiting costs a small fraction of a second of CPU, and the
    message still wakes it within milliseconds."""
    run_processes(_idle, (2, free_port(), str(tmp_path)), 2, what="channel ranks")
    used, late = json.loads((tmp_path / "1.json").read_text())
    assert used < 0.5, f"the idle receiver used {used:.2f} s of CPU in 1.5 s"
    assert late < 0.5


def test_pipeline_decodes_alike_over_shared_memory_and_gloo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages of one machine talk through channels by default; ``EXITLM_SHM=0`` keeps gloo;
    both give KV recomputation's tokens and exit layers."""
    torch.set_num_threads(1)
    model = ee_model("linear")
    torch.manual_seed(3)
    prompts = random_prompts()
    kw = {"strategy": "early-exit", "threshold": 0.5, "max_new_tokens": 16, "ignore_eos": True,
          "threads": 1}
    with torch.inference_mode():
        ref = generate(model, None, prompts, **kw)
        want = [(s.token_ids, s.exit_layers) for s in ref.sequences]
        for shm, transport in (("1", ChannelP2P), ("0", P2P)):
            monkeypatch.setenv("EXITLM_SHM", shm)  # inherited by the spawned stages
            with PipelineExecutor(prepare(model), 3) as pipe:
                assert isinstance(pipe.group.links.p2p, transport)
                got = generate(pipe, None, prompts, kv="pipeline", **kw)
            assert [(s.token_ids, s.exit_layers) for s in got.sequences] == want, shm
    assert any(layer < model.num_layers for _, layers in want for layer in layers)
