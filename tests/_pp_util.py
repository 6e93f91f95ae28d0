"""Multi-process pipeline runs and their single-process references (gloo on CPU).

A *case* is a dict: ``pp``, ``dp``, ``tp``, ``sp`` (sequence parallelism), ``schedule``,
``deferred``, ``placement``, ``slices``, ``fill``, ``fill_microbatches``, ``ratio``,
``boundaries``, ``microbatches``, ``exits`` (ExitConfig fields), ``model`` (ModelConfig
overrides), ``preset``, ``weights`` (layer -> w), ``dropout`` (p_max), ``flat`` (run through
:func:`exitlm.train.parallel.layout.parallelize` without a pipeline: tensor x data parallelism).
Every process builds the same model and data from seeds; each rank's gradients (whole
tensors: tensor-parallel shards are gathered) go to ``ROOT/<case>/rank<r>.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from _dist import free_port, run_processes
from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.train.layer_dropout import LayerDropout
from exitlm.train.losses import multi_exit_loss
from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
from exitlm.train.parallel.groups import ProcessGroups
from exitlm.train.parallel.layout import Layout, PipelineLayout, parallelize
from exitlm.train.parallel.pipeline.engine import PipelineEngine
from exitlm.train.parallel.pipeline.executor import Microbatch
from exitlm.train.parallel.pipeline.stage import build_stages, stage_parameter_names
from exitlm.train.parallel.tensor import local

SEQ = 12
BATCH = 2


def build_model(case: dict[str, Any]) -> EarlyExitLM:
    over = {"dim": 32, "num_heads": 2, "num_kv_heads": 2, "hidden_dim": 64, "vocab_size": 64,
            **case.get("model", {})}
    if case.get("tp", 1) > 1:  # GQA: query heads and key/value heads split over the shards
        over.update(num_heads=4, num_kv_heads=2 if case["tp"] == 2 else 4)
    over.update(case.get("model", {}))
    cfg = preset(case.get("preset", "debug"),
                 exits=ExitConfig(**case.get("exits", {"layers": (1, 2, 3)})), **over)
    torch.manual_seed(1234)
    return EarlyExitLM(cfg)


def pcfg_of(case: dict[str, Any]) -> ParallelConfig:
    return ParallelConfig(
        pp=case.get("pp", 1), dp=case.get("dp", 1), schedule=case.get("schedule", "1f1b"),
        deferred_exits=case.get("deferred", True), exit_placement=case.get("placement", "next"),
        bubble_fill=case.get("fill", "none"), fill_microbatches=case.get("fill_microbatches"),
        backward_forward_ratio=case.get("ratio", 2.0), boundaries=tuple(case.get("boundaries", ())),
        token_slices=tuple(case["slices"]) if "slices" in case else 1,
        tp=case.get("tp", 1), sequence_parallel=case.get("sp", False), timeout_s=60.0,
    )


def weights_of(case: dict[str, Any], model: EarlyExitLM) -> dict[int, float]:
    if "weights" in case:
        return {int(k): float(v) for k, v in case["weights"].items()}
    L = model.num_layers
    w = {layer: 0.1 * (i + 2) for i, layer in enumerate(model.config.exit_layers)}
    w[L] = 1.0
    return w


def batches_of(case: dict[str, Any], replica: int, count: int, model: EarlyExitLM
               ) -> list[Microbatch]:
    g = torch.Generator().manual_seed(99 + 1000 * replica)
    out = []
    drop = LayerDropout(p_max=case["dropout"]) if case.get("dropout") else None
    for m in range(count):
        x = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=g)
        active = None if drop is None else drop.sample(BATCH, model.num_layers, 5, 10, m)
        out.append(Microbatch(x[:, :-1], x[:, 1:], active))
    return out


def _layout(case: dict[str, Any], model: EarlyExitLM, pc: ParallelConfig, dims: ParallelDims
            ) -> Layout:
    groups = ProcessGroups.for_dims(dims, torch.device("cpu"), pc.timeout_s)
    if case.get("flat"):
        return parallelize(model, groups, pc, microbatches=case.get("microbatches", 3),
                           seq_len=SEQ)
    return PipelineLayout(model, groups, pc, pc.slice_lengths(SEQ),
                          microbatches=case.get("microbatches", 3))


def _worker(rank: int, world: int, port: int, root: str, cases: list[dict[str, Any]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        for case in cases:
            model = build_model(case)
            pc = pcfg_of(case)
            dims = ParallelDims.build(world, rank, pc.pp, pc.dp, pc.tp)
            lay = _layout(case, model, pc, dims)
            batches = batches_of(case, dims.replica, lay.microbatches, model)
            weights = weights_of(case, model)
            res = lay.forward_backward(batches, weights)
            grads = {n: _full(lay, n, p.grad if p.grad is not None else torch.zeros_like(p))
                     for n, p in lay.named_parameters() if p.requires_grad}
            d = Path(root) / case["name"]
            d.mkdir(parents=True, exist_ok=True)
            save_file(grads, str(d / f"rank{rank}.safetensors"))
            routes = ([r.kind for r in lay.engine.schedule.routes]
                      if isinstance(lay, PipelineLayout) else [])
            vocab = None
            if case.get("flat") and lay.tp is not None:  # logits exist as vocabulary shards
                with torch.no_grad():
                    h = model.embed(batches[0].tokens)
                    vocab = int(local(model.exit_logits(h, model.num_layers)).shape[-1])
            (d / f"rank{rank}.json").write_text(json.dumps(
                {"stage": dims.stage, "replica": dims.replica, "tp_rank": dims.tp_rank,
                 "losses": {str(k): v for k, v in res.exit_losses.items()},
                 "routes": routes, "local_vocab": vocab}))
            lay.close()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _full(lay: Layout, name: str, t: torch.Tensor) -> torch.Tensor:
    """The whole gradient ``name`` (gathered over the tensor-parallel group)."""
    return (lay.tp.full(name, t) if lay.tp is not None else t.detach()).contiguous()


def spawn(world: int, root: Path, cases: list[dict[str, Any]], timeout: float = 240.0) -> None:
    run_processes(_worker, (world, free_port(), str(root), cases), world, timeout,
                  "pipeline workers")


def reference_grads(case: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Single-process gradients of sum_m sum_i w_i L_i(m) / M, averaged over replicas, plus
    App. C.2's partial contributions of bubble-filling microbatches (masked per stage)."""
    model = build_model(case)
    pc = pcfg_of(case)
    solo = dataclasses.replace(pc, tp=1, sequence_parallel=False)  # routes only
    probe = PipelineEngine(build_model(case), solo, ParallelDims.build(pc.pp, 0, pc.pp),
                           microbatches=case.get("microbatches", 3),
                           slices=pc.slice_lengths(SEQ), device=torch.device("cpu"))
    routes = probe.schedule.routes
    specs = build_stages(model, pc.pp, pc.boundaries, pc.exit_placement)
    stage_names = [stage_parameter_names(model, s) for s in specs]
    weights = weights_of(case, model)
    M = case.get("microbatches", 3)
    dp = pc.dp or 1
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    ce_sum: dict[int, float] = {}
    for r in range(dp):
        batches = batches_of(case, r, len(routes), model)
        for route, mb in zip(routes, batches, strict=True):
            model.zero_grad(set_to_none=True)
            if route.kind == "fill1":
                layers = [k for s in specs[: route.fwd_last + 1] for k in s.loss_layers]
                w = {k: v for k, v in weights.items() if k in layers}
            else:
                w = weights
            if not w:
                continue
            res = multi_exit_loss(model, mb.tokens, mb.labels, w, active=mb.active)
            (res.total / M).backward()
            if route.kind == "regular":
                for k, v in res.per_exit.items():
                    ce_sum[k] = ce_sum.get(k, 0.0) + float(v) / (M * dp)
            keep: set[str] = set()
            for s in range(route.bwd_first, route.fwd_last + 1):
                keep |= stage_names[s]
            for n, p in model.named_parameters():
                if p.grad is not None and n in keep:
                    total[n] += p.grad / dp
    return total, ce_sum


def check_case(root: Path, case: dict[str, Any], world: int) -> None:
    from safetensors.torch import load_file

    ref, ce = reference_grads(case)
    d = root / case["name"]
    seen: set[str] = set()
    for rank in range(world):
        got = load_file(str(d / f"rank{rank}.safetensors"))
        info = json.loads((d / f"rank{rank}.json").read_text())
        assert got, f"{case['name']}: rank {rank} holds no trainable parameter"
        for name, g in got.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=2e-6,
                                       msg=lambda m, n=name, r=rank: f"{case['name']} rank {r} "
                                       f"{n}: {m}")
            seen.add(name)
        if info["local_vocab"] is not None:
            assert info["local_vocab"] == 64 // case["tp"], info  # never the full vocabulary
        if case.get("fill", "none") != "none":
            assert any(k != "regular" for k in info["routes"]), "no bubble-filling microbatch"
        for k, v in ce.items():
            assert abs(info["losses"][str(k)] - v) < 1e-4 * max(1.0, abs(v)), (case["name"], k)
    missing = sorted(n for n in ref if n not in seen)
    assert not missing, f"{case['name']}: no stage holds {missing}"
