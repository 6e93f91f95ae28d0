"""Tensor-parallel early-exit training: step time and per-rank memory at tp=1 and tp=2.

``tp`` processes (gloo on CPU, one thread each; NCCL with ``--device cuda``, one GPU each)
train the same model through :func:`exitlm.train.parallel.layout.parallelize` - the path
``exitlm train parallel.tp=T`` takes - with and without early exits, and with sequence
parallelism on and off. Default model: debug preset with dim 256, 8 layers, 4 query / 2
key-value heads, MLP width 1024, vocabulary 8192, untied LM head; the exits are EE-LLM's
minimalistic ones (own norm, *own* ``V x D`` output matrix each) at 1/4 and 1/2 depth, so
they are a real share of the work (EE-LLM Sec. 3.2 / App. A.1).

Per variant (tp, sequence_parallel, exits):

* ``time_per_step_s``: median over timed steps of the slowest rank's time for one step's
  forward + backward of every microbatch with gradient synchronisation
  (``Layout.forward_backward``, no optimizer), from a barrier;
* per rank: ``param_bytes`` (the parameters this process holds: its shards),
  ``exit_param_bytes`` (of them, the exit heads'), ``activation_bytes`` (bytes autograd
  saved for backward in one microbatch's forward and loss, parameters excluded: EE-LLM
  App. A.3.2's activation memory; DTensors count their local shard);
* ``exit_share``: the exits' share of step time and activation memory (the variant with
  exits minus the one without, over the one with) and of parameter bytes.

And ``tp2_over_tp1``: per-rank parameter and activation bytes and step time at tp=2 over
tp=1 (same exits, sequence parallelism off and on).

    python benchmarks/tp_train.py                  # ~2-4 min on 2 shared cores
    python benchmarks/tp_train.py --quick          # smoke run, < 1 min
    python benchmarks/tp_train.py --device cuda    # NCCL, one GPU per process (needs 2)

Output: one JSON object on stdout; progress on stderr. Timings on a shared CPU are noisy
(variants run in interleaved rounds; medians are reported); memory is exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exitlm.config import ExitConfig, preset
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.layout import Layout, parallelize
from exitlm.train.parallel.memory import SavedBytes, param_storages
from exitlm.train.parallel.pipeline.executor import Microbatch
from exitlm.train.parallel.tensor import local


def build(a: dict[str, Any], exits: tuple[int, ...], device: torch.device) -> EarlyExitLM:
    cfg = preset("debug", dim=a["dim"], num_layers=a["layers"], num_heads=a["heads"],
                 num_kv_heads=a["kv_heads"], hidden_dim=a["hidden"], vocab_size=a["vocab"],
                 max_seq_len=a["seq"], tie_embeddings=False,
                 exits=ExitConfig(layers=exits, head="linear", norm="own", output="own"))
    torch.manual_seed(0)
    return EarlyExitLM(cfg).to(device).train()


def exit_layers(layers: int, count: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, layers // 4), max(1, layers // 2)}))[:count]


def batches_of(a: dict[str, Any], device: torch.device) -> list[Microbatch]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(a["microbatches"]):
        x = torch.randint(0, a["vocab"], (a["microbatch"], a["seq"] + 1), generator=g)
        out.append(Microbatch(x[:, :-1].to(device), x[:, 1:].to(device)))
    return out


def weights_of(model: EarlyExitLM) -> dict[int, float]:
    w = {k: 0.5 for k in model.config.exit_layers}
    w[model.num_layers] = 1.0
    return w


def activation_bytes(lay: Layout, mb: Microbatch, weights: dict[int, float]) -> int:
    """Bytes saved for backward by one microbatch's forward and losses (then released)."""
    meter = SavedBytes(param_storages(lay.model))
    with lay.loss_context(), meter:
        loss, _ = lay.module(mb.tokens, mb.labels, weights, None)
    del loss
    return meter.bytes


class Variant:
    def __init__(self, a: dict[str, Any], groups: ProcessGroups, exits: int, sp: bool) -> None:
        self.exits, self.sp = exits, sp
        self.name = f"exits={exits} sp={sp}"
        layers = exit_layers(a["layers"], exits)
        model = build(a, layers, groups.device)
        pc = ParallelConfig(tp=groups.dims.tp, sequence_parallel=sp)
        self.layout = parallelize(model, groups, pc, microbatches=a["microbatches"],
                                  seq_len=a["seq"])
        self.batches = batches_of(a, groups.device)
        self.weights = weights_of(model)
        params = self.layout.named_parameters()
        size = {n: local(p).numel() * p.element_size() for n, p in params}
        self.info = {
            "exit_layers": list(layers),
            "param_bytes": sum(size.values()),
            "exit_param_bytes": sum(v for n, v in size.items() if n.startswith("exits.")),
            "activation_bytes": activation_bytes(self.layout, self.batches[0], self.weights),
        }
        self.times: list[float] = []

    def step(self) -> None:
        self.layout.forward_backward(self.batches, self.weights)
        self.layout.model.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, port: int, a: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    cuda = a["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=a["timeout"]))
    try:
        groups = ProcessGroups.for_dims(ParallelDims.build(world, rank, tp=world), device,
                                        a["timeout"])
        sps = (False, True) if world > 1 else (False,)
        runs = [Variant(a, groups, exits, sp) for sp in sps for exits in (0, 2)]
        for _ in range(a["warmup"]):
            for v in runs:
                v.step()
        for r in range(a["steps"]):
            for v in runs:
                groups.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                v.step()
                if cuda:
                    torch.cuda.synchronize()
                v.times.append(time.perf_counter() - t0)
            if rank == 0:
                print(f"[tp_train] tp={world} round {r + 1}/{a['steps']}: " + ", ".join(
                    f"{v.name} {v.times[-1]:.3f}s" for v in runs), file=sys.stderr, flush=True)
        report = [{"exits": v.exits, "sp": v.sp, "times": v.times, **v.info} for v in runs]
        parts = [report]
        if world > 1:
            parts = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(parts, report)
        if rank == 0:
            Path(out).write_text(json.dumps(parts))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(a: dict[str, Any], world: int, out: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.start_processes(_worker, args=(world, port, a, out), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + a["timeout"]
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tp={world} workers did not finish in {a['timeout']} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def summarize(per_tp: dict[int, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    runs = []
    for tp, ranks in per_tp.items():
        for i, first in enumerate(ranks[0]):
            step = [max(r[i]["times"][s] for r in ranks) for s in range(len(first["times"]))]
            runs.append({
                "tp": tp, "sequence_parallel": first["sp"], "exits": first["exits"],
                "exit_layers": first["exit_layers"],
                "time_per_step_s": statistics.median(step), "time_all_s": step,
                "ranks": [{"rank": k, "param_bytes": r[i]["param_bytes"],
                           "exit_param_bytes": r[i]["exit_param_bytes"],
                           "activation_bytes": r[i]["activation_bytes"]}
                          for k, r in enumerate(ranks)],
            })

    def find(tp: int, sp: bool, exits: int) -> dict[str, Any] | None:
        return next((r for r in runs if (r["tp"], r["sequence_parallel"], r["exits"])
                     == (tp, sp, exits)), None)

    for r in runs:
        base = find(r["tp"], r["sequence_parallel"], 0)
        if r["exits"] and base is not None:
            rank0, base0 = r["ranks"][0], base["ranks"][0]
            r["exit_share"] = {
                "time": 1 - base["time_per_step_s"] / r["time_per_step_s"],
                "activation": 1 - base0["activation_bytes"] / rank0["activation_bytes"],
                "params": rank0["exit_param_bytes"] / rank0["param_bytes"],
            }
    ratios = []
    for r in runs:
        one = find(1, False, r["exits"])
        if r["tp"] > 1 and one is not None:
            ratios.append({
                "tp": r["tp"], "sequence_parallel": r["sequence_parallel"],
                "exits": r["exits"],
                "param_bytes_per_rank": r["ranks"][0]["param_bytes"] / one["ranks"][0][
                    "param_bytes"],
                "activation_bytes_per_rank": r["ranks"][0]["activation_bytes"] / one["ranks"][
                    0]["activation_bytes"],
                "time_per_step": r["time_per_step_s"] / one["time_per_step_s"],
            })
    return {"runs": runs, "tp2_over_tp1": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared to 1")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 step: a smoke run")
    args = ap.parse_args()
    a = {k.replace("-", "_"): v for k, v in vars(args).items()}
    if args.quick:
        a.update(dim=64, layers=4, hidden=128, vocab=512, seq=32, steps=1, warmup=0)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--device cuda --tp {args.tp} needs {args.tp} GPUs, this machine "
                         f"has {torch.cuda.device_count()}")
    per_tp = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, args.tp):
            out = str(Path(tmp) / f"tp{world}.json")
            _spawn(a, world, out)
            per_tp[world] = json.loads(Path(out).read_text())
    result = {"config": {**a, "torch": torch.__version__, "machine": platform.machine(),
                         "backend": "nccl" if args.device == "cuda" else "gloo"},
              **summarize(per_tp)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
