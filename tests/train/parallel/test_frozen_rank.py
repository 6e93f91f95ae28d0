"""A frozen rank (``SIGSTOP``) under DDP, a pipeline and tensor parallelism ends the step on
the other rank with an error naming it, within ``parallel.timeout_s`` (plus the heartbeat's
few seconds to be sure it is silent)."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _dist import free_port
from _jobs import job_config
from exitlm.errors import ExitlmError
from exitlm.train.trainer import Trainer

TIMEOUT_S = 4.0


def _worker(rank: int, port: int, root: str, parallel: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    cfg = job_config(Path(root), "run", {**parallel, "timeout_s": TIMEOUT_S},
                     {"steps": 4, "checkpoint_every": 0})
    t = Trainer(cfg)
    t.train(until_step=1)
    t.layout.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, holding its sockets, silent
    t0 = time.monotonic()
    try:
        t.train()
        msg = "no error"
    except ExitlmError as err:
        msg = str(err)
    out = {"message": msg, "elapsed": time.monotonic() - t0}
    (Path(root) / "result.json").write_text(json.dumps(out))
    os._exit(0)  # the groups are broken: no orderly shutdown


@pytest.mark.parametrize("parallel", [{}, {"pp": 2}, {"tp": 2}], ids=["ddp", "pipeline", "tp"])
def test_frozen_rank_is_named_within_the_timeout(tmp_path: Path,
                                                 parallel: dict[str, Any]) -> None:
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path), parallel), nprocs=2,
                             join=False, start_method="spawn")
    result = tmp_path / "result.json"
    deadline = time.monotonic() + 150
    try:
        while not result.is_file():
            if time.monotonic() > deadline or not ctx.processes[0].is_alive():
                raise TimeoutError("rank 0 neither finished nor failed")
            time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a stopped process
    res = json.loads(result.read_text())
    assert "rank 1 stopped responding" in res["message"], res
    assert "parallel.timeout_s" in res["message"], res
    assert res["elapsed"] < TIMEOUT_S + 8, res


def _slow_rank0(rank: int, port: int, root: str) -> None:
    from exitlm.train.parallel.dims import ParallelDims
    from exitlm.train.parallel.groups import ProcessGroups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    groups = ProcessGroups.for_dims(ParallelDims.build(2, rank), torch.device("cpu"), 1.5)
    if rank == 0:
        time.sleep(4.0)  # longer than timeout_s: tokenizing, evaluating, writing
    groups.wait_for_rank0("waiting for rank 0")
    (Path(root) / f"done{rank}").write_text("ok")
    groups.barrier()
    dist.destroy_process_group()


def test_waiting_for_slow_rank0_outlasts_the_timeout(tmp_path: Path) -> None:
    """Work only rank 0 does (data preparation, evaluation, checkpoint writing) may take longer
    than ``parallel.timeout_s``: the others wait as long as rank 0's heartbeat moves."""
    from _dist import run_processes

    run_processes(_slow_rank0, (free_port(), str(tmp_path)), 2, 60.0, "slow rank 0")
    assert (tmp_path / "done0").is_file() and (tmp_path / "done1").is_file()
