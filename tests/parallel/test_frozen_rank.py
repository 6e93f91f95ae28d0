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
from _jobs import job_config

from _dist import free_port
from exitlm.errors import ExitlmError
from exitlm.train.trainer import Trainer

TIMEOUT_S = 6.0


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
