"""Training runs (:class:`~exitlm.train.trainer.Trainer`) in groups of gloo processes.

A *job* is a dict: ``out`` (run directory under the root), ``parallel`` / ``train`` (config
sections over :data:`TRAIN`), ``resume``, ``until`` (stop after that step, as a crash
would), ``tag`` (name of the result file, default ``out``). Jobs run in sequence in the same
processes; rank 0 writes ``ROOT/<tag>.json`` with the step records' losses (total and per
exit) and the whole model's parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _dist import free_port, run_processes
from _train_util import tiny_config
from exitlm.train.trainer import Trainer

TRAIN = {"batch_size": 2, "steps": 4, "grad_accum": 3, "checkpoint_every": 2}


def job_config(root: Path, out: str, parallel: dict[str, Any] | None = None,
               train: dict[str, Any] | None = None) -> Any:
    return tiny_config(root, out, train={**TRAIN, **(train or {})}, parallel=parallel or {})


def _worker(rank: int, world: int, port: int, root: str, jobs: list[dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    try:
        for job in jobs:
            cfg = job_config(Path(root), job["out"], job.get("parallel"), job.get("train"))
            t = Trainer(cfg, resume=job.get("resume", False))
            recs = t.train(until_step=job.get("until"))
            host = t.layout.host_model()
            if rank == 0:
                out = {"losses": [r["loss"] for r in recs],
                       "exit1": [r.get("loss_1") for r in recs],
                       "records": recs,
                       "params": {n: p.detach().tolist() for n, p in host.named_parameters()}}
                tag = job.get("tag", job["out"])
                (Path(root) / f"{tag}.json").write_text(json.dumps(out))
            t.layout.close()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_jobs(world: int, root: Path, jobs: list[dict[str, Any]],
               timeout: float = 240.0) -> None:
    run_processes(_worker, (world, free_port(), str(root), jobs), world, timeout,
                  "training workers")


def same_params(result: dict[str, Any], model: torch.nn.Module, atol: float = 1e-5) -> None:
    """The weights a job ended with equal ``model``'s. Adam divides by the gradient's running
    RMS, so for a near-zero gradient fp32 differences in reduction order (tensor-parallel
    all-reduces sum in another order) become update-sized: such runs pass a larger ``atol``."""
    for name, p in model.named_parameters():
        torch.testing.assert_close(torch.tensor(result["params"][name]), p.detach(),
                                   rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def torchrun_train(root: Path, cfg: Any, overrides: list[str], timeout: float
                   ) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node 2 -m exitlm train --config <cfg> OVERRIDES`` as a user
    starts it (two processes, one thread each); returns the run's log records."""
    import yaml

    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "exitlm", "train", "--config", str(path),
         *overrides],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = Path(cfg.train.out_dir) / "log.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()]
