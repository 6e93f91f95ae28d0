"""A dead or stuck pipeline peer ends the step with a clear error within the timeout."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _dist import free_port
from _pp_util import SEQ, batches_of, build_model
from exitlm.comm.p2p import PipelineError
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.pipeline.engine import PipelineEngine


def _worker(rank: int, port: int, root: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    case = {"pp": 2}
    model = build_model(case)
    eng = PipelineEngine(model, ParallelConfig(pp=2, timeout_s=3.0),
                         ParallelDims.build(2, rank, 2), microbatches=2, slices=(SEQ,),
                         device=torch.device("cpu"))
    dist.barrier()
    if rank == 1:
        if mode == "dead":
            os._exit(3)  # dies without a word
        time.sleep(60)  # stuck
        os._exit(0)
    t0 = time.monotonic()
    batches = batches_of(case, 0, 2, model)
    try:
        eng.run(batches, {1: 0.5, 4: 1.0})
        msg = "no error"
    except PipelineError as err:
        msg = str(err)
    out = {"message": msg, "elapsed": time.monotonic() - t0}
    (Path(root) / f"{mode}.json").write_text(json.dumps(out))
    os._exit(0)


@pytest.mark.parametrize("mode", ["dead", "stuck"])
def test_peer_failure_raises_within_timeout(tmp_path: Path, mode: str) -> None:
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path), mode), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 60
    try:
        while not (tmp_path / f"{mode}.json").is_file():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 neither finished nor failed")
            time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    res = json.loads((tmp_path / f"{mode}.json").read_text())
    assert "rank 1" in res["message"], res
    assert "microbatch" in res["message"], res
    assert res["elapsed"] < 20, res
    if mode == "stuck":
        assert "parallel.timeout_s" in res["message"], res
    else:
        assert "die" in res["message"], res
