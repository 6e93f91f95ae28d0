"""Pipeline-based early-exit inference (EE-LLM Sec. 4, "pipeline-based inference", Fig. 10).

The model is split by layer range into ``P`` stages, one process each (:func:`stage_bounds`).
For every token, stage 0 runs its layers; a checked exit whose maximum probability reaches the
threshold decides the token at once. Either way the hidden state travels on to stage 1 with a
flag saying whether the token was already decided, and every later stage runs it through its
layers, so **its KV cache is filled and nothing is ever recomputed**. A token decided at stage
0 lets stage 0 start the next token while stages ``1..P-1`` are still busy with the exited
one: that overlap is where the latency goes (EE-LLM Fig. 10). A token not decided at stage 0
is decided by the first later stage whose exit is confident (or by the final layer); that
stage sends its logits back to stage 0 and goes on.

**Batches.** EE-LLM describes batch 1; here a step carries every running sequence (the
engine's continuous batching, :mod:`exitlm.infer.engine`). Each row has its own position,
threshold, forced-full flag and *decided* flag: a row whose token stage 0 decided is done for
stage 0, the others wait for a later stage's reply, and stage 0 starts the next step once
every row has its token. Every stage runs every row through its layers, decided or not. The
later stages keep one KV-cache row per sequence, named by a *slot id* that stage 0 gives the
sequence at its prefill; each step lists the slot ids in the engine's row order, and a stage
reorders its rows to match when sequences have left (:class:`_StageRows`), so the engine may
compact its pool as it likes.

The messages between stages, the later stages' loop and their KV rows live in
:mod:`exitlm.infer.executors.pipeline_stage`; this module is stage 0.

**Same output as KV recomputation.** Stage 0 (:class:`PipelineDecoder`, a
:class:`~exitlm.infer.decoder.Decoder` run by the ordinary engine) applies the same exit rule as
:class:`~exitlm.infer.kv_recompute.RecomputeDecoder`, row by row: the first checked exit, in
layer order, whose confidence reaches the sequence's threshold, and a full-depth token after
``max_pending`` consecutive early exits (kept here so both strategies take the same
decisions, although nothing is pending). Every key/value a token attends to is the one the
full model computes in both, so with the same decisions the tokens are identical. The stage
processes get the decoding backend stage 0 has: for one sequence of stock Llama-family blocks
on CPU both methods run the native row-invariant blocks (recomputation's 2..n-row chunks give
each row the bits a one-row step gives; quantized weights round their activations alike), so
even the last bits agree. Batches of several sequences and other blocks (GPT-2 family) keep
fp32 summation-order differences: recomputation runs an exited token's deep layers batched
with the next token (more rows per product, left-padded rows), the pipeline runs one row per
sequence, so deep keys/values may differ in the last bits. That can flip a decision only when
an exit's confidence lies within ~1e-6 of the threshold or two logits tie that closely (not
seen in the tests). Tokens are chosen on stage 0 with the request's own sampling and
generator from the deciding exit's logits, so sampling and log-probabilities work as in one
process. Each stage holds the whole model's weights but runs only its layers (the weights
come from one loaded model, so every stage computes with the same values).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from exitlm.comm.health import ParallelError
from exitlm.comm.launch import DEFAULT_TIMEOUT_S, Workers, leave_group, start_workers
from exitlm.config import ConfigError
from exitlm.infer.decoder import Batch, Decoder, Emit, Seq, prefill_hidden
from exitlm.infer.early_exit import resolve_checks
from exitlm.infer.executor import Executor
from exitlm.infer.executors.pipeline_stage import (
    PREFILL,
    STEP,
    Links,
    Rows,
    owes_reply,
    serve_stage,
    stage_bounds,
    stage_checks,
)
from exitlm.infer.kv_recompute import EarlyExitStats
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner

if TYPE_CHECKING:
    from exitlm.infer.strategies import Strategy

__all__ = ["PipelineDecoder", "PipelineExecutor", "PipelineGroup", "serve_stage",
           "stage_bounds"]



STOP_GRACE_S = 30.0
"""How long an orderly stop waits for the stage processes to exit (at least; never less than
the transfer timeout) before killing them."""

class PipelineGroup:
    """Stage 0's handle on a running pipeline of ``stages`` processes (:func:`pipeline`)."""

    def __init__(self, model: EarlyExitLM, stages: int, timeout_s: float,
                 workers: Workers | None) -> None:
        self.model = model
        self.stages = stages
        self.bounds = stage_bounds(model.num_layers, stages)
        self.links = Links(0, stages, timeout_s, model)
        self.workers = workers
        self.closed = False
        self.broken: BaseException | None = None
        """The error that interrupted a decoder call, if one did (:meth:`watch`)."""
        self._slots = itertools.count()

    def new_slots(self, n: int) -> list[int]:
        """``n`` slot ids never given before on this pipeline (every decoder that uses it
        draws from here, so a later decoder's sequences never meet an earlier one's rows)."""
        return [next(self._slots) for _ in range(n)]

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Run one of stage 0's decoder calls. An error inside leaves the stages out of step
        with stage 0 (messages half exchanged), so it marks the pipeline broken: later calls
        raise at once, and after a :class:`ParallelError` :meth:`close` does not try to stop
        stages that cannot answer (and then report that instead of the stage that failed)."""
        if self.broken is not None:
            raise ParallelError(f"the decoding pipeline is out of step since an earlier "
                                f"failure ({self.broken}); start a new one")
        try:
            yield
        except ParallelError as err:
            stopped = self.workers.stopped() if self.workers is not None else []
            if not stopped:
                self.broken = err
                raise
            # the rank waited on may only be waiting for a stopped one before it
            names = ", ".join(f"rank {r} (stopped)" for r in stopped)
            self.broken = ParallelError(f"{err}; {names}", hint=err.hint)
            raise self.broken from err
        except BaseException as err:
            self.broken = err
            raise

    def close(self, error: BaseException | None = None) -> None:
        """Stop every stage (and the self-started processes, leaving the group).

        ``error`` is the exception that ends the job, if one does. After a
        :class:`ParallelError`, or when a decoder call broke off (:meth:`watch`), no stop
        message is sent: a stage stopped answering or died, and gloo closes every connection
        of a process once one of its transfers timed out, so another transfer would only fail
        again and hide the error that names the stage; or the stages wait for messages that
        will not come. Self-started stages are killed either way (``SIGKILL`` also ends a
        stopped process)."""
        if self.closed:
            return
        self.closed = True
        orderly = self.broken is None and not isinstance(error, ParallelError)
        error = error or self.broken
        try:
            if orderly:
                self.links.send_stop()
                self.links.p2p.flush()
                if self.workers is not None:
                    # stages that got the stop message are exiting; on a loaded machine that
                    # can outlast a short transfer timeout, so give them at least STOP_GRACE_S
                    self.workers.join(max(self.links.p2p.timeout.total_seconds(), STOP_GRACE_S))
        except ParallelError:
            if error is None:
                raise  # else the error that brought us here is the one to report
        finally:
            if self.workers is not None:
                self.workers.kill()
                leave_group()


def _stage_main(rank: int, world: int, cfg: Any, tensors: dict[str, torch.Tensor],
                timeout_s: float) -> None:
    """Entry of a self-started stage: rebuild the model on stage 0's tensors, give it the
    runner stage 0 has (the same kernels, so the same bits), and serve."""
    serve_stage(prepare(rebuild_model(cfg, tensors, "pipeline stage 0")), rank, world,
                timeout_s)


class PipelineExecutor(Executor):
    """Pipeline-based early-exit inference's processes (EE-LLM Sec. 4): this process is
    stage 0 (its :attr:`runner` holds the whole model and runs the first stage's layers),
    ``stages - 1`` more hold the model's weights and run theirs (:func:`serve_stage`).

    Self-started (the default: spawned here, ``threads`` each, stopped by :meth:`close`) or
    ``joined`` (``torchrun`` started them: ranks ``>= 1`` run :func:`serve_stage`). The
    engines built on it, one after the other, decode ``early-exit`` with ``kv='pipeline'``
    (:class:`PipelineDecoder`); an error inside a step leaves the stages out of step with
    stage 0, so it is fatal (:attr:`fatal_failures`)."""

    name = "pipeline"
    fatal_failures = True

    def __init__(self, runner: Runner, stages: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads: int = 1, joined: bool = False) -> None:
        super().__init__(runner)
        stage_bounds(runner.num_layers, stages)  # a ConfigError before anything starts
        self.stages = stages
        model = runner.model
        workers = None
        if not joined:
            workers = start_workers(_stage_main, (model.config, model_tensors(model), timeout_s),
                                    stages, timeout_s=timeout_s, threads=threads)
        self.group = PipelineGroup(model, stages, timeout_s, workers)

    def decoder(self, strategy: Strategy, options: Any) -> Decoder:
        if strategy.name != "early-exit" or getattr(options, "kv", None) != "pipeline":
            raise ConfigError(f"the decoding pipeline runs --strategy early-exit --kv pipeline, "
                              f"not --strategy {strategy.name}")
        if options.stages is not None and options.stages != self.stages:
            raise ConfigError(f"--stages {options.stages}: the running pipeline has "
                              f"{self.stages} stages")
        return PipelineDecoder(self.runner, options, resolve_checks(self.runner.model, options),
                               self.group)

    def close(self, error: BaseException | None = None) -> None:
        self.group.close(error)


@dataclass
class _SeqState:
    """What stage 0 keeps of a running sequence: the slot id naming its rows on the later
    stages, and its consecutive early exits (EE-LLM App. D.3's ``max_pending``)."""

    slot: int
    pending: int = 0


class PipelineDecoder(Decoder):
    """Stage 0 of pipeline-based early-exit inference (see the module docstring): runs the
    first stage's layers for every row, decides tokens at its exits, and waits for a later
    stage's decision only for the rows its exits did not decide.

    The engine must step every running sequence in each call (it does): a sequence missing
    from a step has left, and its rows on the later stages are dropped."""

    name = "early-exit"
    stats_type = EarlyExitStats
    fills_in_parts = False  # a prompt's parts would have to travel down the stages too

    def __init__(self, runner: Runner, options: Any, checks: tuple[int, ...],
                 group: PipelineGroup) -> None:
        super().__init__(runner, options)
        model = runner.model
        self.num_layers = model.num_layers
        self.checks = tuple(sorted(c for c in checks if 0 < c < model.num_layers))
        if group.model is not model:
            raise ConfigError("the running pipeline holds another model's weights; decode "
                              "with the model it was started with")
        self.group = group
        self.end0 = group.bounds[0][1]
        self.checks0 = stage_checks(self.checks, 0, self.end0, self.num_layers)
        self.deciding = [bool(stage_checks(self.checks, a, b, self.num_layers))
                         for a, b in group.bounds]
        self._seqs: dict[Seq, _SeqState] = {}

    def resolved_options(self) -> dict[str, Any]:
        return {**super().resolved_options(), "exit_layers": list(self.checks),
                "stages": self.group.stages,
                "stage_layers": [[a + 1, b] for a, b in self.group.bounds]}

    def prefill(self, batch: Batch) -> list[Emit]:
        """Run the prompts through every stage; the last one decides each first token."""
        with self.group.watch():
            return self._prefill(batch)

    def step(self, batch: Batch) -> list[Emit]:
        """Feed each sequence's newest token at ``cache.lengths``; choose the next one at the
        first checked exit (on any stage) confident enough for that sequence, else at the
        final layer."""
        with self.group.watch():
            return self._step(batch)

    def _prefill(self, batch: Batch) -> list[Emit]:
        h, lens = prefill_hidden(self.runner, batch, end=self.end0, exits=self.checks)
        n = len(batch)
        slots = self.group.new_slots(n)
        rows = Rows(slots, [int(x) for x in lens], [False] * n, [True] * n, [1.0] * n)
        self.group.links.settle()
        self.group.links.send_down(PREFILL, rows, h, self.checks)
        tokens: dict[int, int] = {}
        layers: dict[int, int] = {}
        self._decide_later(batch, rows, list(range(n)), tokens, layers)
        for seq, slot in zip(batch.seqs, slots, strict=True):
            self._seqs[seq] = _SeqState(slot)
        return [Emit([tokens[i]], [layers[i]], self.num_layers) for i in range(n)]

    def _step(self, batch: Batch) -> list[Emit]:
        runner, cache, n = self.runner, batch.cache, len(batch)
        states = self._running(batch)
        q = cache.lengths.clone()
        force = [st.pending >= s.options.max_pending
                 for st, s in zip(states, batch.seqs, strict=True)]
        for s, f in zip(batch.seqs, force, strict=True):
            s.stats.forced_full += int(f)  # type: ignore[attr-defined]
        rows = Rows([st.slot for st in states], q.tolist(), [False] * n, force,
                     [s.options.threshold_for(runner.model.config) for s in batch.seqs])
        positions = q[:, None].to(self.device)
        h = runner.embed(batch.lasts(self.device), positions)
        tokens: dict[int, int] = {}
        layers: dict[int, int] = {}
        for layer, h_at, ctx in runner.walk(h, 0, self.end0, self.checks0, positions, cache):
            h = h_at
            if layer in self.checks0:
                asked = [rows.threshold[i] if i not in layers and rows.may_exit(i) else None
                         for i in range(n)]
                got, logits = runner.probe(h, layer, asked, cache=cache, ctx=ctx)
                if got:  # decided now; this stage finishes these rows' tokens
                    for i, tok in zip(got, batch.choose(logits, got), strict=True):
                        tokens[i], layers[i] = tok, layer
        cache.lengths = q + 1
        for i in layers:
            rows.decided[i] = True
        self.group.links.settle()
        self.group.links.send_down(STEP, rows, h)
        self._decide_later(batch, rows, [i for i in range(n) if i not in layers], tokens,
                           layers)
        for i, st in enumerate(states):
            st.pending = 0 if layers[i] == self.num_layers else st.pending + 1
        return [Emit([tokens[i]], [layers[i]], self.num_layers) for i in range(n)]

    def _running(self, batch: Batch) -> list[_SeqState]:
        """The states of ``batch``'s sequences, in row order; sequences no longer running are
        forgotten (the stages drop their rows when this step names the ones it carries)."""
        missing = [i for i, s in enumerate(batch.seqs) if s not in self._seqs]
        if missing:
            raise RuntimeError(f"pipeline decoder: rows {missing} were never prefilled")
        self._seqs = {s: self._seqs[s] for s in batch.seqs}
        return [self._seqs[s] for s in batch.seqs]

    def _decide_later(self, batch: Batch, rows: Rows, undecided: list[int],
                      tokens: dict[int, int], layers: dict[int, int]) -> None:
        """Read the replies of stages 1, 2, ... (those that owe one, :func:`owes_reply`) until
        every row of ``undecided`` has its token; fill ``tokens`` and ``layers``."""
        last = self.group.stages - 1
        for stage in range(1, self.group.stages):
            if not owes_reply(self.deciding[stage], stage == last, rows, undecided):
                continue
            got, logits = self.group.links.recv_reply(stage, len(undecided))
            decided = [i for i, layer in zip(undecided, got, strict=True) if layer]
            if decided:
                for i, tok in zip(decided, batch.choose(logits, decided), strict=True):
                    tokens[i] = tok
                for i, layer in zip(undecided, got, strict=True):
                    if layer:
                        layers[i] = layer
            undecided = [i for i, layer in zip(undecided, got, strict=True) if not layer]
        if undecided:  # a protocol violation
            raise RuntimeError(f"pipeline: the last stage left rows {undecided} undecided")
