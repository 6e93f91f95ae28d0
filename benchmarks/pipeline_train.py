"""Pipeline-parallel early-exit training on this CPU: the shape of EE-LLM Fig. 7 / Table 1.

``--pp`` gloo processes (one per stage, one thread each) train a small-but-not-tiny model
(default: debug preset with dim 256, 8 layers, vocab 8192, untied LM head, so the output
layer is a real share of the work) with exitlm's
:class:`~exitlm.train.parallel.pipeline.engine.PipelineEngine` (1F1B). Three measurements, all
taken in this run; every ratio compares numbers of this run:

1. **Exits** (EE-LLM Fig. 7, Table 1): 0, 1, 2, 3 minimalistic early exits (``linear`` head,
   own norm, *own* output embedding per exit: EE-LLM App. A.1's "same structure as the final
   output layer", so parameters grow with exits and no weight is shared across stages),
   added in EE-LLM Sec. 4's order - 1/4 depth, 1/2 depth, then the earliest layer (layer 1;
   exitlm has no exit before layer 1). Exits at a stage boundary run at the beginning of the
   next stage (Optimization 2). Each count runs with deferred exits on (Optimization 1:
   exit logits computed in the backward step) and off. Loss weights: 0.5 per exit, 1 final.
2. **vs torch.distributed.pipelining**: the same no-exit step (same split, same
   microbatches, mean cross-entropy) run by torch's ``Schedule1F1B``; ratio ours / torch.
3. **Token slicing** (TeraPipe): one sequence of ``--long-seq`` tokens, one microbatch,
   ``token_slices=1`` vs ``--slices`` equal slices; ratio sliced / unsliced.

Variants of one measurement are timed in interleaved rounds (the machine is shared; medians
are reported). A step is the engine's forward + backward of every microbatch plus gradient
synchronisation (no optimizer); its time is the slowest rank's wall time from a barrier to
the end of ``run``. Memory is measured in a separate first (warm-up) step with
``measure_memory=True`` (saved-tensor hooks), which is then switched off for timed steps.

    python benchmarks/pipeline_train.py                 # pp=2, 4 microbatches of 2 x 128, ~3 min
    python benchmarks/pipeline_train.py --pp 4
    python benchmarks/pipeline_train.py --microbatches 8 --long-seq 512
    python benchmarks/pipeline_train.py --quick         # smoke run, < 1 min

Output (one JSON object on stdout; progress on stderr):

* ``config``: sizes and settings of the run; ``exit_layers_order``: exits added one by one.
* ``exits``: one entry per (``num_exits``, ``deferred``):
  ``exit_layers`` (1-based), ``time_per_iter_s`` (median over timed steps),
  ``time_per_iter_all_s`` (every timed step), ``overhead_vs_no_exit`` (time / the median of
  the no-exit runs of the same rounds), ``max_peak_activation_bytes`` (over stages), and
  ``stages``: per stage ``layers`` ([start, end) 0-based slots), ``exits`` it computes,
  ``param_bytes`` (the trainable parameters it owns), ``resident_param_bytes`` (every
  parameter the process holds: ``prune_to_stage`` keeps frozen copies of the embedding,
  final norm and LM head on stages that do not use them), ``peak_activation_bytes`` (peak
  bytes autograd saved for backward over in-flight microbatches, parameters excluded:
  ``StepStats.peak_activation_bytes``), ``busy_s`` (median seconds computing, not waiting
  for peers: ``StepStats.busy_s``).
* ``vs_torch_pipelining``: ``ours_s``, ``torch_s`` (medians), ``ratio_ours_over_torch``
  (< 1: ours faster), ``ratio_ours_over_torch_min`` (ratio of the fastest steps: on a
  loaded machine noise only adds time), ``*_all_s`` (every step).
* ``token_slicing``: ``batch``, ``seq``, ``slices`` (lengths), ``unsliced_s``,
  ``sliced_s``, ``ratio_sliced_over_unsliced`` (< 1: slicing helps), ``..._min`` (fastest
  steps), ``*_all_s``.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
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
import torch.nn.functional as F

from exitlm.config import ExitConfig, ModelConfig, preset
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.pipeline.engine import PipelineEngine
from exitlm.train.parallel.pipeline.executor import Microbatch
from exitlm.train.parallel.pipeline.stage import StageModule, build_stages, prune_to_stage

CPU = torch.device("cpu")


def exit_order(layers: int) -> list[int]:
    """EE-LLM Sec. 4's order: 1/4 depth, 1/2 depth, the earliest layer, then more."""
    out: list[int] = []
    for c in (layers // 4, layers // 2, 1, 3 * layers // 4, *range(1, layers)):
        if 1 <= c < layers and c not in out:
            out.append(c)
    return out[:3]


def model_config(a: dict[str, Any], exits: tuple[int, ...]) -> ModelConfig:
    heads = max(1, a["dim"] // 64)
    return preset("debug", dim=a["dim"], num_layers=a["layers"], num_heads=heads,
                  num_kv_heads=heads, hidden_dim=a["hidden"], vocab_size=a["vocab"],
                  max_seq_len=max(a["seq"], a["long_seq"]), tie_embeddings=False,
                  exits=ExitConfig(layers=exits, head="linear", norm="own", output="own"))


def build(a: dict[str, Any], exits: tuple[int, ...]) -> EarlyExitLM:
    torch.manual_seed(0)
    return EarlyExitLM(model_config(a, exits)).train()


def make_batches(vocab: int, count: int, rows: int, seq: int, seed: int) -> list[Microbatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append(Microbatch(x[:, :-1], x[:, 1:]))
    return out


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-microbatch mean cross-entropy; the schedule's ``scale_grads`` divides by M."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


# ----- workers ------------------------------------------------------------------------------
class Runner:
    """Something that runs one training step on this rank and reports its stats."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.times: list[float] = []
        self.busy: list[float] = []
        self.info: dict[str, Any] = {}

    def step(self) -> float | None:  # returns busy seconds when known
        raise NotImplementedError

    def zero(self) -> None:
        raise NotImplementedError


class OursRunner(Runner):
    def __init__(self, name: str, a: dict[str, Any], grid: ParallelDims, exits: tuple[int, ...],
                 deferred: bool, batches: list[Microbatch], slices: tuple[int, ...]) -> None:
        super().__init__(name)
        self.model = build(a, exits)
        pc = ParallelConfig(pp=grid.pp, dp=1, schedule="1f1b", deferred_exits=deferred,
                            token_slices=slices)
        self.eng = PipelineEngine(self.model, pc, grid, microbatches=len(batches),
                                  slices=slices, device=CPU, measure_memory=True)
        self.batches = batches
        self.weights = {e: 0.5 for e in exits}
        self.weights[self.model.num_layers] = 1.0
        spec = self.eng.spec
        self.info = {"stage": spec.index, "layers": [spec.start, spec.end],
                     "exits": list(spec.exits),
                     "param_bytes": sum(p.numel() * p.element_size()
                                        for _, p in self.eng.named_parameters()
                                        if p.requires_grad),
                     "resident_param_bytes": sum(p.numel() * p.element_size()
                                                 for p in self.model.parameters())}

    def memory_step(self) -> None:
        """The warm-up step, with saved-tensor accounting on (then off for timed steps)."""
        self.eng.executor.measure = True
        stats = self.eng.run(self.batches, self.weights)
        self.info["peak_activation_bytes"] = stats.peak_activation_bytes
        self.eng.executor.measure = False
        self.zero()

    def step(self) -> float | None:
        return self.eng.run(self.batches, self.weights).busy_s

    def zero(self) -> None:
        self.model.zero_grad(set_to_none=True)


class TorchRunner(Runner):
    def __init__(self, name: str, a: dict[str, Any], grid: ParallelDims,
                 batches: list[Microbatch]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        super().__init__(name)
        self.model = build(a, ())
        self.spec = build_stages(self.model, grid.pp)[grid.stage]
        prune_to_stage(self.model, self.spec)
        stage = PipelineStage(StageModule(self.model, self.spec), grid.stage, grid.pp, CPU)
        self.sched = Schedule1F1B(stage, n_microbatches=len(batches), loss_fn=mean_ce,
                                  scale_grads=True)
        self.tokens = torch.cat([b.tokens for b in batches])  # (M*B, T), split back by torch
        self.labels = torch.cat([b.labels for b in batches])

    def step(self) -> float | None:
        if self.spec.first:
            self.sched.step(self.tokens, return_outputs=False)
        elif self.spec.last:
            self.sched.step(target=self.labels, return_outputs=False)
        else:
            self.sched.step(return_outputs=False)
        return None

    def zero(self) -> None:
        self.model.zero_grad(set_to_none=True)


def timed_rounds(runners: list[Runner], rounds: int, log: Any) -> None:
    """Round-robin over ``runners``: barrier, time one step, zero grads."""
    for r in range(rounds):
        for run in runners:
            dist.barrier()
            t0 = time.perf_counter()
            busy = run.step()
            run.times.append(time.perf_counter() - t0)
            if busy is not None:
                run.busy.append(busy)
            run.zero()
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{x.name} {x.times[-1]:.3f}s"
                                                    for x in runners))


def _worker(rank: int, world: int, port: int, a: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=a["timeout"]))

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[pipeline_train] {msg}", file=sys.stderr, flush=True)

    try:
        grid = ParallelDims.build(world, rank, a["pp"], 1)
        report: dict[str, Any] = {}
        # 1. exits x deferred (EE-LLM Fig. 7 / Table 1)
        batches = make_batches(a["vocab"], a["microbatches"], a["microbatch"], a["seq"], 1)
        order = exit_order(a["layers"])
        exit_runs: list[OursRunner] = []
        for k in range(len(order) + 1):
            for deferred in (True, False):
                exits = tuple(sorted(order[:k]))
                run = OursRunner(f"{k}ex-{'def' if deferred else 'eager'}", a, grid, exits,
                                 deferred, batches, (a["seq"],))
                run.info["exit_layers"] = list(exits)
                run.memory_step()
                exit_runs.append(run)
        log(f"exits: built and warmed {len(exit_runs)} variants")
        timed_rounds(list(exit_runs), a["steps"], log)
        report["exits"] = [{"name": r.name, "times": r.times, "busy": r.busy, **r.info}
                           for r in exit_runs]
        del exit_runs
        # 2. ours vs torch.distributed.pipelining, no exits
        ours = OursRunner("ours", a, grid, (), True, batches, (a["seq"],))
        ours.memory_step()
        theirs = TorchRunner("torch", a, grid, batches)
        for _ in range(a["warmup"]):
            theirs.step()
            theirs.zero()
        log("torch.distributed.pipelining: warmed")
        timed_rounds([ours, theirs], a["steps"], log)
        report["torch"] = {"ours": ours.times, "torch": theirs.times}
        del ours, theirs
        # 3. token slicing at batch 1, long sequence
        long = make_batches(a["vocab"], 1, 1, a["long_seq"], 2)
        lengths = ParallelConfig(token_slices=a["slices"]).slice_lengths(a["long_seq"])
        plain = OursRunner("unsliced", a, grid, (), True, long, (a["long_seq"],))
        sliced = OursRunner("sliced", a, grid, (), True, long, lengths)
        plain.memory_step()
        sliced.memory_step()
        log("token slicing: warmed")
        timed_rounds([plain, sliced], a["steps"], log)
        report["slicing"] = {"unsliced": plain.times, "sliced": sliced.times,
                             "lengths": list(lengths)}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, report)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ----- main ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(a: dict[str, Any], out: str) -> None:
    ctx = mp.start_processes(_worker, args=(a["pp"], _free_port(), a, out), nprocs=a["pp"],
                             join=False, start_method="spawn")
    deadline = time.monotonic() + a["timeout"]
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline workers did not finish in {a['timeout']} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _step_times(per_rank: list[list[float]]) -> list[float]:
    """A step lasts as long as its slowest rank."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def summarize(a: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    r3 = lambda x: float(f"{x:.4g}")  # noqa: E731  (4 significant digits)
    exits = []
    variants = [v["name"] for v in ranks[0]["exits"]]
    times = {n: _step_times([next(v for v in r["exits"] if v["name"] == n)["times"]
                             for r in ranks]) for n in variants}
    base = {True: _med(times["0ex-def"]), False: _med(times["0ex-eager"])}
    for i, n in enumerate(variants):
        stages = []
        for r in ranks:
            v = r["exits"][i]
            stages.append({"stage": v["stage"], "layers": v["layers"], "exits": v["exits"],
                           "param_bytes": v["param_bytes"],
                           "resident_param_bytes": v["resident_param_bytes"],
                           "peak_activation_bytes": v["peak_activation_bytes"],
                           "busy_s": r3(_med(v["busy"]))})
        v0 = ranks[0]["exits"][i]
        deferred = n.endswith("-def")
        t = _med(times[n])
        exits.append({"num_exits": len(v0["exit_layers"]), "exit_layers": v0["exit_layers"],
                      "deferred": deferred, "time_per_iter_s": r3(t),
                      "time_per_iter_all_s": [r3(x) for x in times[n]],
                      "overhead_vs_no_exit": round(t / base[deferred], 3),
                      "max_peak_activation_bytes": max(s["peak_activation_bytes"]
                                                       for s in stages),
                      "stages": stages})
    ours = _step_times([r["torch"]["ours"] for r in ranks])
    theirs = _step_times([r["torch"]["torch"] for r in ranks])
    plain = _step_times([r["slicing"]["unsliced"] for r in ranks])
    sliced = _step_times([r["slicing"]["sliced"] for r in ranks])
    return {
        "config": {"pp": a["pp"], "dim": a["dim"], "layers": a["layers"],
                   "heads": max(1, a["dim"] // 64), "hidden": a["hidden"], "vocab": a["vocab"],
                   "seq": a["seq"], "microbatch": a["microbatch"],
                   "microbatches": a["microbatches"], "timed_steps": a["steps"],
                   "schedule": "1f1b", "exit_layers_order": exit_order(a["layers"]),
                   "exit_head": "linear, own norm, own output embedding",
                   "threads_per_rank": 1, "quick": a["quick"], "torch": torch.__version__,
                   "machine": platform.platform()},
        "exits": exits,
        "vs_torch_pipelining": {"ours_s": r3(_med(ours)), "torch_s": r3(_med(theirs)),
                                "ratio_ours_over_torch": round(_med(ours) / _med(theirs), 3),
                                "ratio_ours_over_torch_min": round(min(ours) / min(theirs), 3),
                                "ours_all_s": [r3(x) for x in ours],
                                "torch_all_s": [r3(x) for x in theirs]},
        "token_slicing": {"batch": 1, "seq": a["long_seq"], "microbatches": 1,
                          "slices": ranks[0]["slicing"]["lengths"],
                          "unsliced_s": r3(_med(plain)), "sliced_s": r3(_med(sliced)),
                          "ratio_sliced_over_unsliced": round(_med(sliced) / _med(plain), 3),
                          "ratio_sliced_over_unsliced_min": round(min(sliced) / min(plain), 3),
                          "unsliced_all_s": [r3(x) for x in plain],
                          "sliced_all_s": [r3(x) for x in sliced]},
    }


def parse(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages = processes")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=0, help="MLP width (0: 8/3 x dim)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=2, help="rows per microbatch")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per step (M)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps (rounds) per variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed torch warm-up steps")
    ap.add_argument("--long-seq", type=int, default=1024, help="token-slicing sequence")
    ap.add_argument("--slices", type=int, default=4, help="equal token slices")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps (< 1 min)")
    a = vars(ap.parse_args(argv))
    if a["quick"]:
        a.update(dim=64, layers=max(4, a["pp"]), vocab=1024, seq=32,
                 microbatches=max(a["pp"], 2), steps=2, long_seq=64, timeout=300.0)
    if not a["hidden"]:
        a["hidden"] = int(a["dim"] * 8 / 3)
    if a["microbatches"] < a["pp"]:
        ap.error(f"--microbatches must be >= --pp ({a['pp']}): torch's Schedule1F1B needs it")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ranks.json")
        _spawn(a, out)
        ranks = json.loads(Path(out).read_text())
    res = summarize(a, ranks)
    res["config"]["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
