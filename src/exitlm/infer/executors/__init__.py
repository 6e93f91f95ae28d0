"""The process topologies an engine's decoder runs on (:class:`~exitlm.infer.executor.Executor`
implementations) and the choice among them (:func:`executor_for`).

* the local executor (:class:`~exitlm.infer.executor.Executor`): this process only;
* :class:`~exitlm.infer.executors.pipeline.PipelineExecutor` - pipeline-based early-exit
  inference: the model split by layer range into stages, one process each; an exited token is
  decided at once while the later stages keep running it to fill their KV caches (EE-LLM
  Sec. 4, Fig. 10; :mod:`.pipeline_stage` runs the later stages);
* :class:`~exitlm.infer.executors.tp.TPExecutor` - tensor parallelism (Megatron-LM's layout,
  EE-LLM Sec. 3.1): every rank holds a shard (:mod:`.tp_shard`) and replays this engine's
  steps;
* :class:`~exitlm.infer.executors.ppd_worker.BranchWorkerExecutor` - PPD's branches in a
  worker process (CPU).

Processes are started and joined by :mod:`exitlm.comm`. The model itself never imports
``torch.distributed``; everything here wraps a built model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exitlm.config import ConfigError
from exitlm.infer.executor import Executor
from exitlm.infer.executors.pipeline import PipelineExecutor
from exitlm.infer.executors.ppd_worker import BranchWorkerExecutor
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner

if TYPE_CHECKING:
    from exitlm.infer.strategies import Strategy

__all__ = ["BranchWorkerExecutor", "Executor", "PipelineExecutor", "executor_for"]


def executor_for(target: EarlyExitLM | Runner | Executor, strategy: Strategy, options: Any
                 ) -> Executor:
    """The executor an engine runs on: ``target`` itself when it is one; otherwise, on the
    target's runner (prepared here for a model), the topology the strategy's options ask
    for - pipeline stages for ``early-exit`` with ``kv='pipeline'``, a PPD branch worker for
    ``ppd_workers='process'`` - or this process alone. (Tensor parallelism is the caller's
    choice: :class:`~exitlm.infer.executors.tp.TPExecutor`.)"""
    if isinstance(target, Executor):
        return target
    if not isinstance(target, Runner | EarlyExitLM):
        raise ConfigError(f"model: expected an EarlyExitLM (exitlm.io.load_model(name).model), "
                          f"a Runner or an Executor, got {type(target).__name__}")
    runner = target if isinstance(target, Runner) else prepare(target)
    if strategy.name == "early-exit" and getattr(options, "kv", None) == "pipeline":
        return PipelineExecutor(runner, options.stages or 2)
    if strategy.name == "ppd" and getattr(options, "ppd_workers", None) == "process":
        return BranchWorkerExecutor(runner)
    return Executor(runner)
