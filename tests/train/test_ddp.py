"""Two gloo processes (DDP, FSDP) match one process on the combined batch."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import free_port, run_processes
from _train_util import tiny_config
from exitlm.train.trainer import Trainer


def _worker(rank: int, world: int, port: int, root: str, parallel: str = "ddp",
            distill: float = 0.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        cfg = tiny_config(Path(root), parallel,
                          train={"batch_size": 2, "steps": 3, "grad_accum": 2,
                                 "parallel": parallel}, loss={"distill": distill})
        t = Trainer(cfg)
        recs = t.train()
        host = t.layout.host_model()
        params = ({} if host is None else
                  {n: p.detach().tolist() for n, p in host.named_parameters()})
        out = {"losses": [r["loss"] for r in recs],
               "exit1": [r["loss_1"] for r in recs], "params": params}
        (Path(root) / f"{parallel}{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, root: Path, parallel: str, timeout: float = 150.0,
           distill: float = 0.0) -> None:
    run_processes(_worker, (world, free_port(), str(root), parallel, distill), world, timeout,
                  "DDP workers")


@pytest.mark.parametrize(("parallel", "distill"), [("ddp", 0.0), ("fsdp", 0.0), ("ddp", 0.5)])
def test_two_processes_match_single_process(tmp_path: Path, parallel: str,
                                            distill: float) -> None:
    """(``loss.distill`` too: each replica's exits learn from its own final outputs.)"""
    _spawn(2, tmp_path, parallel, distill=distill)
    r0 = json.loads((tmp_path / f"{parallel}0.json").read_text())
    r1 = json.loads((tmp_path / f"{parallel}1.json").read_text())
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
    single = Trainer(tiny_config(tmp_path, "single",
                                 train={"batch_size": 4, "steps": 3, "grad_accum": 2},
                                 loss={"distill": distill}))
    recs = single.train()
    assert [r["loss"] for r in recs] == pytest.approx(r0["losses"], rel=1e-5)
    assert [r["loss_1"] for r in recs] == pytest.approx(r0["exit1"], rel=1e-5)
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(torch.tensor(r0["params"][name]), p.detach(),
                                   rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / parallel / "model" / "model.safetensors").is_file()


def _resume_worker(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        train = {"batch_size": 2, "steps": 4, "grad_accum": 1, "parallel": "fsdp",
                 "checkpoint_every": 2}
        straight = Trainer(tiny_config(Path(root), "straight", train=train)).train()
        Trainer(tiny_config(Path(root), "resumed", train=train)).train(until_step=2)
        resumed = Trainer(tiny_config(Path(root), "resumed", train=train), resume=True).train()
        out = {"straight": [r["loss"] for r in straight], "resumed": [r["loss"] for r in resumed]}
        (Path(root) / f"resume{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_fsdp_checkpoint_resume_reproduces_losses(tmp_path: Path) -> None:
    """FSDP gathers full tensors into the layout-independent checkpoint and re-shards them on
    resume; the resumed run continues the uninterrupted run's loss curve."""
    run_processes(_resume_worker, (2, free_port(), str(tmp_path)), 2, 150.0, "FSDP workers")
    r0 = json.loads((tmp_path / "resume0.json").read_text())
    assert len(r0["straight"]) == 4
    assert r0["resumed"] == pytest.approx(r0["straight"][2:], rel=1e-6)
    assert (tmp_path / "resumed" / "checkpoints" / "latest").is_file()
