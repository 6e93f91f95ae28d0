"""``exitlm generate --tp T`` and ``--kv pipeline --stages P``: one call that decodes across
processes, self-started or under ``torchrun``.

* **self-started** (a plain ``exitlm generate``): the executor spawns its processes - ``T - 1``
  tensor-parallel followers (:class:`~exitlm.infer.executors.tp.TPExecutor`) or ``P - 1``
  later pipeline stages (:class:`~exitlm.infer.executors.pipeline.PipelineExecutor`) - and
  :func:`~exitlm.infer.api.generate` runs on it in this process.
* **torchrun** (``torchrun --nproc-per-node N -m exitlm generate ...``): every rank loads the
  model, rank 0's weights are broadcast (a preset's random weights differ per process), then
  rank 0 generates over a joined executor while the other ranks follow it (``--tp N``: they
  replay its engine, :func:`~exitlm.infer.executors.tp.follow_joined`; ``--kv pipeline``:
  they serve their stages). Rank 0 prints; the others return ``None``.
"""

from __future__ import annotations

from typing import Any, Literal

from exitlm.comm.launch import join_torchrun, leave_group, torchrun_world
from exitlm.config import ConfigError
from exitlm.infer.api import generate
from exitlm.infer.executor import Executor
from exitlm.infer.executors.pipeline import PipelineExecutor, serve_stage, stage_bounds
from exitlm.infer.executors.tp import TPExecutor, follow_joined
from exitlm.infer.executors.tp_shard import broadcast_weights, check_strategy
from exitlm.infer.result import GenerationResult
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.sharding import check_whole_heads
from exitlm.runtime import prepare

Mode = Literal["tp", "pipeline"]


def distributed_mode(tp: int, strategy: str, overrides: dict[str, Any]) -> Mode | None:
    """Which way a ``generate`` call runs across processes (``None``: in this one), with the
    flags checked against each other and against ``torchrun``'s process count."""
    pipeline = overrides.get("kv") == "pipeline"
    world = torchrun_world()
    if tp > 1 and pipeline:
        raise ConfigError("--tp and --kv pipeline do not combine: choose tensor parallelism "
                          "or pipeline stages")
    if tp > 1:
        check_strategy(strategy, overrides)
    if world > 1:
        if tp > 1 and tp != world:
            raise ConfigError(f"--tp {tp}: torchrun started {world} processes; expected "
                              f"--tp {world}")
        stages = overrides.get("stages")
        if pipeline and stages not in (None, world):
            raise ConfigError(f"--stages {stages}: torchrun started {world} processes; "
                              f"expected --stages {world}")
        if not (tp > 1 or pipeline):
            raise ConfigError(f"torchrun started {world} processes: expected --tp {world} or "
                              f"--strategy early-exit --kv pipeline --stages {world}")
    return "tp" if tp > 1 else "pipeline" if pipeline else None


def distributed_generate(mode: Mode, model: EarlyExitLM, tokenizer: Any, prompts: Any, *,
                         tp: int, strategy: str, timeout_s: float, threads: int,
                         stream: Any = None, **kwargs: Any) -> GenerationResult | None:
    """Decode ``prompts`` across processes as ``mode`` says (see the module docstring);
    ``kwargs`` are :func:`~exitlm.infer.api.generate`'s. ``None`` on ranks other than 0."""
    world = torchrun_world()
    if mode == "tp":
        check_whole_heads(model.config, tp)
    else:
        stage_bounds(model.num_layers, world if world > 1 else kwargs.get("stages") or 2)
    if world == 1:
        executor: Executor = (
            TPExecutor(model, tp, timeout_s=timeout_s, threads=threads) if mode == "tp"
            else PipelineExecutor(prepare(model), kwargs.get("stages") or 2,
                                  timeout_s=timeout_s, threads=threads))
        with executor:
            return generate(executor, tokenizer, prompts, strategy=strategy, stream=stream,
                            threads=threads, **kwargs)
    rank, world = join_torchrun(timeout_s)
    try:
        broadcast_weights(model)
        if mode == "tp":
            if rank > 0:
                follow_joined(model, tokenizer, rank, world, timeout_s)
                return None
            executor = TPExecutor(model, world, timeout_s=timeout_s, threads=threads,
                                  joined=True)
        else:
            if rank > 0:
                serve_stage(prepare(model), rank, world, timeout_s)
                return None
            kwargs = {**kwargs, "stages": world}
            executor = PipelineExecutor(prepare(model), world, timeout_s=timeout_s,
                                        threads=threads, joined=True)
        with executor:
            return generate(executor, tokenizer, prompts, strategy=strategy, stream=stream,
                            threads=threads, **kwargs)
    finally:
        leave_group()
