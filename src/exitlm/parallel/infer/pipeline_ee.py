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

Messages (all point-to-point, gloo, every receive waited on with a timeout, see
:class:`~exitlm.parallel.pipeline.p2p.P2P`), stage ``s`` -> ``s+1``:

* a command header, float64 ``[command, rows n, prompt length T, number of checks]``;
  ``STOP`` ends here (each stage passes it on and returns);
* the rows table, float64 ``(n, 5 [+ D])``: ``[slot id, position (prefill: prompt length),
  decided, forced, threshold]`` per row, followed on a ``STEP`` by the row's hidden state
  ``(D,)`` (exact in float64 for every model dtype);
* on a ``PREFILL`` only: the checked exits (long ``(checks,)``) and the prompts' hidden states
  ``(n, T, D)`` in the model's dtype (right-padded like the engine's prefill).

Stage ``s >= 1`` -> stage 0, once per step, only when stage ``s`` *can* decide something: some
row arrived undecided and either ``s`` is the last stage or it has a checked exit and one of
those rows may exit (threshold ``< 1``, not forced). Both ends know all this from the rows
table, so stage 0 reads replies from stages 1, 2, ... in order, never from "any source":

* float32 ``(u, 2)``: ``[decided, layer]`` for each of the ``u`` rows that arrived undecided,
  in row order, sent as soon as all of them are decided or after the stage's last checked
  exit (the last stage: after its final layer);
* when ``k > 0`` of them were decided here, their logits float32 ``(k, V)`` in row order.

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
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.decoder import Batch, Decoder, Emit, Seq, last_positions, prefill_hidden
from exitlm.infer.kv_recompute import EarlyExitStats
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.parallel.health import ParallelError
from exitlm.parallel.infer.launch import DEFAULT_TIMEOUT_S, Workers, leave_group, start_workers
from exitlm.parallel.pipeline.p2p import P2P

STOP, PREFILL, STEP = 0, 1, 2
_HDR, _ROWS, _CHECKS, _HIDDEN, _REPLY, _LOGITS = 11, 12, 13, 14, 15, 16
_HEADER = 4  # command, rows, prompt length, number of checks
_ROW = 5  # slot id, position or prompt length, decided, forced, threshold


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layer ranges ``[a, b)`` (0-based) of ``stages`` pipeline stages, as even as possible
    (earlier stages take the extra layers). Raises a :class:`ConfigError` naming ``--stages``
    when the model cannot be split that way."""
    if not 2 <= stages <= num_layers:
        raise ConfigError(f"--stages {stages}: expected 2 to {num_layers} pipeline stages "
                          f"(one process each, at least one of the model's {num_layers} "
                          "layers per stage)")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (i < extra) for i in range(stages)]
    ends = list(itertools.accumulate(sizes))
    return [(e - n, e) for e, n in zip(ends, sizes, strict=True)]


def _stage_checks(checks: tuple[int, ...], a: int, b: int, num_layers: int) -> tuple[int, ...]:
    """The checked exits (1-based) after a layer of ``[a, b)``: ``a < e <= b``, ``e < L``."""
    return tuple(e for e in checks if a < e <= b and e < num_layers)


@dataclass
class _Rows:
    """The rows table of one command (see the module docstring): per row, the sequence's slot
    id, the new token's position (a prefill: the prompt length), whether its token is already
    decided, whether it must go the full depth (``max_pending`` reached; every prompt) and its
    threshold."""

    slots: list[int]
    pos: list[int]
    decided: list[bool]
    force: list[bool]
    threshold: list[float]

    def __len__(self) -> int:
        return len(self.slots)

    def may_exit(self, i: int) -> bool:
        """Whether row ``i`` may leave at an early exit (EE-LLM Sec. 5.2 confidence)."""
        return not self.force[i] and self.threshold[i] < 1.0

    def to_tensor(self) -> torch.Tensor:
        cols = (self.slots, self.pos, self.decided, self.force, self.threshold)
        return torch.tensor(list(zip(*cols, strict=True)), dtype=torch.float64).reshape(-1, _ROW)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> _Rows:
        slots, pos, decided, force, thr = t[:, :_ROW].T.tolist()
        return cls([int(x) for x in slots], [int(x) for x in pos], [bool(x) for x in decided],
                   [bool(x) for x in force], thr)


def _replies(has_checks: bool, last: bool, rows: _Rows, undecided: list[int]) -> bool:
    """Whether a stage answers stage 0 this step: some row arrived ``undecided`` and the stage
    can decide one (the last stage decides all; another needs a checked exit and a row that
    may exit). Stage 0 and the stage evaluate this alike."""
    if not undecided:
        return False
    return last or (has_checks and any(rows.may_exit(i) for i in undecided))


def _exit_decisions(model: EarlyExitLM, h: torch.Tensor, layer: int, cache: KVCache,
                    ctx: StepContext, cand: list[int], thresholds: list[float]
                    ) -> tuple[list[int], torch.Tensor]:
    """The rows of ``cand`` whose exit ``layer`` is confident for the last position of ``h``
    ``(n, T, D)`` (maximum probability ``>=`` the row's threshold, EE-LLM Sec. 5.2), and their
    logits ``(k, V)``. A block head runs for every row whatever the decision: later tokens
    attend to its cache slot."""
    block = model.exit_route(layer).has_block
    if not cand:
        if block:
            model.exit_features(h, layer, cache=cache, ctx=ctx)
        return [], h.new_zeros(0, model.config.vocab_size)
    idx = torch.tensor(cand, device=h.device)
    if block:
        logits = model.exit_logits(h, layer, cache=cache, ctx=ctx)[idx, -1]
    else:
        logits = model.exit_logits(h[idx, -1], layer)
    conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()
    sel = [j for j, i in enumerate(cand) if conf[j] >= thresholds[i]]
    return [cand[j] for j in sel], logits[sel]


class _Links:
    """The transfers of one stage (the messages of the module docstring)."""

    def __init__(self, rank: int, world: int, timeout_s: float, model: EarlyExitLM) -> None:
        self.rank, self.world = rank, world
        self.p2p = P2P(timeout_s, torch.device("cpu"), setting="--dist-timeout")
        self.dim = model.config.dim
        self.vocab = model.config.vocab_size
        self.dtype = model.embed_tokens.weight.dtype

    def send_down(self, cmd: int, rows: _Rows, hidden: torch.Tensor,
                  checks: tuple[int, ...] = ()) -> None:
        """A ``STEP`` (``hidden`` ``(n, 1, D)`` rides in the rows table) or a ``PREFILL``
        (``hidden`` ``(n, T, D)`` and ``checks`` follow the table) to the next stage."""
        dst = self.rank + 1
        n, t = hidden.shape[0], hidden.shape[1]
        head = torch.tensor([cmd, n, t, len(checks)], dtype=torch.float64)
        self.p2p.send(head, dst, _HDR, "a command")
        table = rows.to_tensor()
        if cmd == STEP:
            table = torch.cat([table, hidden.detach().reshape(n, self.dim).double()], dim=1)
        self.p2p.send(table, dst, _ROWS, "the rows table")
        if cmd == PREFILL:
            if checks:
                self.p2p.send(torch.tensor(checks, dtype=torch.long), dst, _CHECKS,
                              "exit list")
            self.p2p.send(hidden.detach().cpu(), dst, _HIDDEN, "hidden states")

    def send_stop(self) -> None:
        self.p2p.send(torch.tensor([STOP, 0, 0, 0], dtype=torch.float64), self.rank + 1,
                      _HDR, "a command")

    def recv_command(self) -> tuple[int, int, int, int]:
        """``(command, rows, prompt length, number of checks)``. Waits as long as it takes:
        a server's pipeline idles between requests; stage 0 bounds every wait of its own, so
        a stalled stage is still found (by stage 0, which names it)."""
        head = self.p2p.recv((_HEADER,), torch.float64, self.rank - 1, _HDR, "the next command",
                             idle=True)
        cmd, n, t, n_checks = (int(x) for x in head.tolist())
        return cmd, n, t, n_checks

    def recv_rows(self, n: int, step: bool) -> tuple[_Rows, torch.Tensor | None]:
        """The rows table and, on a step, the hidden states ``(n, 1, D)`` it carries."""
        width = _ROW + (self.dim if step else 0)
        t = self.p2p.recv((n, width), torch.float64, self.rank - 1, _ROWS, "the rows table")
        hidden = t[:, _ROW:].to(self.dtype).reshape(n, 1, self.dim) if step else None
        return _Rows.from_tensor(t), hidden

    def recv_checks(self, n: int) -> tuple[int, ...]:
        if n == 0:
            return ()
        t = self.p2p.recv((n,), torch.long, self.rank - 1, _CHECKS, "exit list")
        return tuple(int(x) for x in t.tolist())

    def recv_hidden(self, n: int, length: int) -> torch.Tensor:
        return self.p2p.recv((n, length, self.dim), self.dtype, self.rank - 1, _HIDDEN,
                             "hidden states")

    def reply(self, layers: list[int], logits: list[torch.Tensor]) -> None:
        """Tell stage 0 which of the rows that arrived undecided this stage decided:
        ``layers[j]`` is row ``j``'s exit layer (0: not here); ``logits`` those rows' logits
        ``(V,)`` each, in order."""
        head = torch.tensor([[float(x > 0), float(x)] for x in layers], dtype=torch.float32)
        self.p2p.send(head.reshape(-1, 2), 0, _REPLY, "a decision")
        if logits:
            self.p2p.send(torch.stack(logits).float(), 0, _LOGITS, "the deciding logits")

    def recv_reply(self, stage: int, n: int) -> tuple[list[int], torch.Tensor]:
        """Stage ``stage``'s reply about ``n`` undecided rows: each row's exit layer (0: not
        decided there) and the logits ``(k, V)`` of the decided ones, in row order."""
        head = self.p2p.recv((n, 2), torch.float32, stage, _REPLY, f"stage {stage}'s decision")
        layers = [int(layer) if flag else 0 for flag, layer in head.tolist()]
        k = sum(x > 0 for x in layers)
        if not k:
            return layers, torch.zeros(0, self.vocab, dtype=self.dtype)
        logits = self.p2p.recv((k, self.vocab), torch.float32, stage, _LOGITS,
                               f"stage {stage}'s logits")
        return layers, logits.to(self.dtype)


class _StageRows:
    """A later stage's KV cache: one row per sequence, named by the slot id stage 0 gave it.

    A prefill appends rows; a step names the sequences it carries in the engine's row order,
    and the rows are reordered to match (rows of sequences that left are dropped), the way
    the engine's pool compacts (:meth:`~exitlm.model.kv_cache.KVCache.move_row`)."""

    def __init__(self, model: EarlyExitLM) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.order: list[int] = []

    def _reserve(self, rows: int, length: int) -> KVCache:
        if self.cache is None:
            self.cache = self.model.new_cache(rows, length)
        elif rows > self.cache.batch_size or length > self.cache.max_seq_len:
            cap = self.cache.max_seq_len
            self.cache.resize(max(rows, self.cache.batch_size),
                              max(length, 2 * cap) if length > cap else cap)
        return self.cache

    def admit(self, slots: list[int], length: int) -> KVCache:
        """Fresh rows for the prompts of ``slots`` (``length`` positions each, with room to
        grow), after the rows held."""
        m = len(self.order)
        cache = self._reserve(m + len(slots), 2 * length + 16)
        self.order += slots
        view = cache.rows(m, m + len(slots))
        view.crop(0)
        return view

    def arrange(self, slots: list[int], length: int) -> KVCache:
        """The rows of ``slots``, in that order, with room for ``length`` positions."""
        n = len(slots)
        if self.order[:n] != slots:
            where = {s: r for r, s in enumerate(self.order)}
            missing = [s for s in slots if s not in where]
            if missing:
                raise RuntimeError(f"pipeline protocol: step names slots {missing} that no "
                                   "prefill gave this stage")
            cache = self.cache
            assert cache is not None
            idx = torch.tensor([where[s] for s in slots])
            for t in (*cache.keys, *cache.values):
                t[:n] = t[idx]  # advanced indexing copies first: any permutation is safe
            cache.lengths[:n] = cache.lengths[idx].clone()
            cache.fill[:, :n] = cache.fill[:, idx].clone()
        self.order = list(slots)
        return self._reserve(n, length).rows(0, n)


def serve_stage(model: EarlyExitLM, rank: int, world: int,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run stage ``rank >= 1`` of a ``world``-stage pipeline until stage 0 says stop (the
    joined default group carries the transfers)."""
    a, b = stage_bounds(model.num_layers, world)[rank]
    last = rank == world - 1
    links = _Links(rank, world, timeout_s, model)
    held = _StageRows(model)
    checks: tuple[int, ...] = ()
    with torch.inference_mode():
        while True:
            cmd, n, length, n_checks = links.recv_command()
            if cmd == STOP:
                if not last:
                    links.send_stop()
                links.p2p.flush()
                return
            prefill = cmd == PREFILL
            rows, h = links.recv_rows(n, step=not prefill)
            if prefill:
                checks = links.recv_checks(n_checks)
                h = links.recv_hidden(n, length)
                cache = held.admit(rows.slots, length)
                positions = torch.arange(length).expand(n, length)
            else:
                assert h is not None
                cache = held.arrange(rows.slots, max(rows.pos) + 1)
                positions = torch.tensor(rows.pos)[:, None]
            h = _run_stage(model, links, rows, h, cache, positions, (a, b), last,
                           _stage_checks(checks, a, b, model.num_layers), prefill)
            if not last:
                links.send_down(cmd, rows, h, checks)
            if prefill:
                lens = torch.tensor(rows.pos)
                cache.lengths = lens
                cache.crop(lens)
            else:
                cache.lengths = positions[:, 0] + 1


def _run_stage(model: EarlyExitLM, links: _Links, rows: _Rows, h: torch.Tensor, cache: KVCache,
               positions: torch.Tensor, bounds: tuple[int, int], last: bool,
               stops: tuple[int, ...], prefill: bool) -> torch.Tensor:
    """Run one command's rows through this stage's layers ``[a, b)``: the rows that arrived
    undecided and may exit are checked at the stage's exits, the last stage decides the rest
    with the final layer, the decisions go to stage 0 (the reply of the module docstring) and
    are marked in ``rows``. Returns the hidden states after layer ``b``."""
    a, b = bounds
    ctx = model.context(positions, cache)
    undecided = [i for i in range(len(rows)) if not rows.decided[i]]
    owed = _replies(bool(stops), last, rows, undecided)
    layer_of: dict[int, int] = {}
    logits_of: dict[int, torch.Tensor] = {}

    def answer() -> None:
        links.reply([layer_of.get(i, 0) for i in undecided],
                    [logits_of[i] for i in undecided if i in logits_of])

    for layer, h_at in model.walk(h, a, b, stops, cache=cache, ctx=ctx):
        h = h_at
        if layer in stops:
            cand = ([i for i in undecided if i not in layer_of and rows.may_exit(i)]
                    if owed else [])
            got, logits = _exit_decisions(model, h, layer, cache, ctx, cand, rows.threshold)
            for j, i in enumerate(got):
                layer_of[i], logits_of[i] = layer, logits[j]
            if owed and (len(layer_of) == len(undecided) or (not last and layer == stops[-1])):
                answer()  # before the rest of the stage runs
                owed = False
    if owed:  # the last stage: the final layer decides the rest
        rest = [i for i in undecided if i not in layer_of]
        ends = torch.tensor(rows.pos) if prefill else torch.ones(len(rows), dtype=torch.long)
        idx = torch.tensor(rest, device=h.device)
        logits = model.final_logits(last_positions(h, ends)[idx])
        for j, i in enumerate(rest):
            layer_of[i], logits_of[i] = model.num_layers, logits[j]
        answer()
    for i in layer_of:
        rows.decided[i] = True
    return h


# ----- stage 0 ---------------------------------------------------------------------------------

class PipelineGroup:
    """Stage 0's handle on a running pipeline of ``stages`` processes (:func:`pipeline`)."""

    def __init__(self, model: EarlyExitLM, stages: int, timeout_s: float,
                 workers: Workers | None) -> None:
        self.model = model
        self.stages = stages
        self.bounds = stage_bounds(model.num_layers, stages)
        self.links = _Links(0, stages, timeout_s, model)
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
                    self.workers.join(self.links.p2p.timeout.total_seconds())
        except ParallelError:
            if error is None:
                raise  # else the error that brought us here is the one to report
        finally:
            if self.workers is not None:
                self.workers.kill()
                leave_group()


_ACTIVE: list[PipelineGroup] = []


def active_pipeline() -> PipelineGroup | None:
    """The pipeline opened by :func:`pipeline` around the current code, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _stage_main(rank: int, world: int, cfg: Any, tensors: dict[str, torch.Tensor],
                timeout_s: float) -> None:
    """Entry of a self-started stage: rebuild the model on stage 0's tensors, give it the
    decoding backend stage 0 has (the same kernels, so the same bits), and serve."""
    from exitlm.backend.cpu import prepare_for_decoding

    model = prepare_for_decoding(rebuild_model(cfg, tensors, "pipeline stage 0"))
    serve_stage(model, rank, world, timeout_s)


@contextlib.contextmanager
def pipeline(model: EarlyExitLM, stages: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
             threads: int = 1) -> Iterator[PipelineGroup]:
    """Start ``stages - 1`` stage processes holding ``model``'s weights (this process is
    stage 0) for the duration of the block; ``kv="pipeline"`` decoders inside it use them.

    Raises a :class:`ConfigError` before starting anything when ``stages`` does not fit."""
    stage_bounds(model.num_layers, stages)
    workers = start_workers(_stage_main, (model.config, model_tensors(model), timeout_s), stages,
                            timeout_s=timeout_s, threads=threads)
    with _registered(PipelineGroup(model, stages, timeout_s, workers)) as group:
        yield group


@contextlib.contextmanager
def joined_pipeline(model: EarlyExitLM, *, timeout_s: float = DEFAULT_TIMEOUT_S
                    ) -> Iterator[PipelineGroup]:
    """Stage 0 of a pipeline whose processes are already joined (torchrun: every rank ran
    ``exitlm generate``; ranks ``>= 1`` serve with :func:`serve_stage`)."""
    import torch.distributed as dist

    with _registered(PipelineGroup(model, dist.get_world_size(), timeout_s, None)) as group:
        yield group


@contextlib.contextmanager
def _registered(group: PipelineGroup) -> Iterator[PipelineGroup]:
    """``group`` is the active pipeline while the block runs, and is closed after it."""
    _ACTIVE.append(group)
    error: BaseException | None = None
    try:
        yield group
    except BaseException as err:
        error = err
        raise
    finally:
        _ACTIVE.remove(group)
        group.close(error)


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

    def __init__(self, model: EarlyExitLM, options: Any, checks: tuple[int, ...],
                 group: PipelineGroup | None = None) -> None:
        super().__init__(model, options)
        self.num_layers = model.num_layers
        self.checks = tuple(sorted(c for c in checks if 0 < c < model.num_layers))
        self.own: PipelineGroup | None = None
        if group is None:
            group = active_pipeline()
        if group is None:  # none around: start one for this decoder's lifetime
            ctx = pipeline(model, options.stages or 2)
            group = ctx.__enter__()
            self.own, self._ctx = group, ctx
        if group.model is not model:
            raise ConfigError("the running pipeline holds another model's weights; decode "
                              "with the model it was started with")
        if options.stages is not None and options.stages != group.stages:
            raise ConfigError(f"--stages {options.stages}: the running pipeline has "
                              f"{group.stages} stages")
        self.group = group
        self.end0 = group.bounds[0][1]
        self.checks0 = _stage_checks(self.checks, 0, self.end0, self.num_layers)
        self.deciding = [bool(_stage_checks(self.checks, a, b, self.num_layers))
                         for a, b in group.bounds]
        self._seqs: dict[Seq, _SeqState] = {}

    def resolved_options(self) -> dict[str, Any]:
        return {**super().resolved_options(), "exit_layers": list(self.checks),
                "stages": self.group.stages,
                "stage_layers": [[a + 1, b] for a, b in self.group.bounds]}

    def close(self) -> None:
        if self.own is not None:
            self.own = None
            self._ctx.__exit__(None, None, None)

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
        h, lens = prefill_hidden(self.model, batch, end=self.end0, exits=self.checks)
        n = len(batch)
        slots = self.group.new_slots(n)
        rows = _Rows(slots, [int(x) for x in lens], [False] * n, [True] * n, [1.0] * n)
        self.group.links.send_down(PREFILL, rows, h, self.checks)
        tokens: dict[int, int] = {}
        layers: dict[int, int] = {}
        self._decide_later(batch, rows, list(range(n)), tokens, layers)
        for seq, slot in zip(batch.seqs, slots, strict=True):
            self._seqs[seq] = _SeqState(slot)
        return [Emit([tokens[i]], [layers[i]], self.num_layers) for i in range(n)]

    def _step(self, batch: Batch) -> list[Emit]:
        model, cache, n = self.model, batch.cache, len(batch)
        states = self._running(batch)
        q = cache.lengths.clone()
        force = [st.pending >= s.options.max_pending
                 for st, s in zip(states, batch.seqs, strict=True)]
        for s, f in zip(batch.seqs, force, strict=True):
            s.stats.forced_full += int(f)  # type: ignore[attr-defined]
        rows = _Rows([st.slot for st in states], q.tolist(), [False] * n, force,
                     [s.options.threshold for s in batch.seqs])
        positions = q[:, None].to(self.device)
        ctx = model.context(positions, cache)
        h = model.embed(batch.lasts(self.device), positions)
        tokens: dict[int, int] = {}
        layers: dict[int, int] = {}
        for layer, h_at in model.walk(h, 0, self.end0, self.checks0, cache=cache, ctx=ctx):
            h = h_at
            if layer in self.checks0:
                cand = [i for i in range(n) if i not in layers and rows.may_exit(i)]
                got, logits = _exit_decisions(model, h, layer, cache, ctx, cand,
                                              rows.threshold)
                if got:  # decided now; this stage finishes these rows' tokens
                    for i, tok in zip(got, batch.choose(logits, got), strict=True):
                        tokens[i], layers[i] = tok, layer
        cache.lengths = q + 1
        for i in layers:
            rows.decided[i] = True
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

    def _decide_later(self, batch: Batch, rows: _Rows, undecided: list[int],
                      tokens: dict[int, int], layers: dict[int, int]) -> None:
        """Read the replies of stages 1, 2, ... (those that owe one, :func:`_replies`) until
        every row of ``undecided`` has its token; fill ``tokens`` and ``layers``."""
        last = self.group.stages - 1
        for stage in range(1, self.group.stages):
            if not _replies(self.deciding[stage], stage == last, rows, undecided):
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
