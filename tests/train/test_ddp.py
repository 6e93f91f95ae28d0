"""Two gloo processes (DDP) match one process on the combined batch."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _train_util import tiny_config

from exitlm.train.trainer import Trainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        cfg = tiny_config(Path(root), "ddp", train={"batch_size": 2, "steps": 3, "grad_accum": 2})
        t = Trainer(cfg)
        recs = t.train()
        params = {n: p.detach().tolist() for n, p in t.model.named_parameters()}
        out = {"losses": [r["loss"] for r in recs],
               "exit1": [r["loss_1"] for r in recs], "params": params}
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, root: Path, timeout: float = 120.0) -> None:
    ctx = mp.start_processes(_worker, args=(world, _free_port(), str(root)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("DDP workers did not finish in time")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def test_two_process_ddp_matches_single_process(tmp_path: Path) -> None:
    _spawn(2, tmp_path)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["losses"] == r1["losses"]
    single = Trainer(tiny_config(tmp_path, "single",
                                 train={"batch_size": 4, "steps": 3, "grad_accum": 2}))
    recs = single.train()
    assert [r["loss"] for r in recs] == pytest.approx(r0["losses"], rel=1e-5)
    assert [r["loss_1"] for r in recs] == pytest.approx(r0["exit1"], rel=1e-5)
    for name, p in single.model.named_parameters():
        for params in (r0["params"], r1["params"]):
            torch.testing.assert_close(torch.tensor(params[name]), p.detach(),
                                       rtol=1e-4, atol=1e-5, msg=name)
