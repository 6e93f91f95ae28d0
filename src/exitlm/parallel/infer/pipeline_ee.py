"""Pipeline-based early-exit inference (EE-LLM Sec. 4, "pipeline-based inference", Fig. 10).

The model is split by layer range into ``P`` stages, one process each (:func:`stage_bounds`).
For every token, stage 0 runs its layers; a checked exit whose maximum probability reaches the
threshold decides the token at once. Either way the hidden state travels on to stage 1 with a
small signal saying whether the token was already decided, and every later stage runs it
through its layers, so **its KV cache is filled and nothing is ever recomputed**. A token
decided at stage 0 lets stage 0 start the next token while stages ``1..P-1`` are still busy with
the exited one: that overlap is where the latency goes (EE-LLM Fig. 10). A token not decided
at stage 0 is decided by the first later stage whose exit is confident (or by the final
layer); that stage sends its logits back to stage 0 and goes on.

Messages (all point-to-point, gloo, each waited on with a timeout, see
:class:`~exitlm.parallel.pipeline.p2p.P2P`):

* stage ``s`` -> ``s+1``: a header (command, position, decided, forced, threshold, number of
  checked exits), the checked exits (with a prefill) and the hidden state ``(1, T, D)``;
* stage ``s >= 1`` -> stage 0, for each token it received undecided: ``(decided, layer)`` and,
  when it decided, the exit's logits ``(1, V)``. Stage 0 reads these replies from stages
  1, 2, ... until one says decided, so no receive ever needs "any source".

**Same output as KV recomputation.** Stage 0 (:class:`PipelineDecoder`, a
:class:`~exitlm.infer.decoder.Decoder` run by the ordinary engine) applies the same exit rule as
:class:`~exitlm.infer.kv_recompute.RecomputeDecoder`: the first checked exit, in layer order,
whose confidence reaches the sequence's threshold, and a full-depth token after
``max_pending`` consecutive early exits (kept here so both strategies take the same
decisions, although nothing is pending). Every key/value a token attends to is the one the
full model computes in both, so with the same decisions the tokens are identical; the only
difference is fp32 summation order: recomputation runs an exited token's deep layers batched
with the next token (a 2..n-row product), the pipeline runs it alone (a one-row GEMV), so
deep keys/values may differ in the last bits. That can flip a decision only when an exit's
confidence lies within ~1e-6 of the threshold or two logits tie that closely (not seen in the
tests). Tokens are chosen on stage 0 with the request's own sampling and generator from the
deciding exit's logits, so sampling and log-probabilities work as in one process.

One sequence at a time (EE-LLM's pipeline inference is batch 1 too); the engine queues the
others. Each stage holds the whole model's weights but runs only its layers (the weights come
from one loaded model, so every stage computes with the same values).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.decoder import Batch, Decoder, Emit, prefill_hidden
from exitlm.infer.kv_recompute import EarlyExitStats
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.parallel.health import ParallelError
from exitlm.parallel.infer.launch import DEFAULT_TIMEOUT_S, Workers, leave_group, start_workers
from exitlm.parallel.pipeline.p2p import P2P

STOP, PREFILL, STEP = 0, 1, 2
_HDR, _CHECKS, _HIDDEN, _REPLY = 11, 12, 13, 14
_HEADER = 6  # command, position or prompt length, decided, forced, threshold, number of checks


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


def _confident(model: EarlyExitLM, h: torch.Tensor, layer: int, cache: KVCache,
               ctx: StepContext, may_exit: bool, threshold: float) -> torch.Tensor | None:
    """Exit ``layer``'s logits ``(1, V)`` for the last position of ``h`` when its maximum
    probability reaches ``threshold`` (EE-LLM Sec. 5.2 confidence), else ``None``. A block
    head runs for every token whatever the decision: later tokens attend to its cache slot."""
    if model.exit_route(layer).has_block:
        logits = model.exit_logits(h, layer, cache=cache, ctx=ctx)[:, -1]
    elif may_exit:
        logits = model.exit_logits(h[:, -1], layer)
    else:
        return None
    if not may_exit:
        return None
    conf = float(torch.softmax(logits.float(), dim=-1).amax())
    return logits if conf >= threshold else None


class _Links:
    """The transfers of one stage. Each token costs one message down the pipeline (a float64
    header - command, position, decided, forced, threshold, number of checks - followed by the
    hidden state, exact in float64 for every model dtype) and, from each stage that receives it
    undecided, one float32 reply to stage 0 (decided, layer, then the exit's logits). A
    prefill's header is followed by the exit list and the prompt's hidden states."""

    def __init__(self, rank: int, world: int, timeout_s: float, model: EarlyExitLM) -> None:
        self.rank, self.world = rank, world
        self.p2p = P2P(timeout_s, torch.device("cpu"), setting="--dist-timeout")
        self.dim = model.config.dim
        self.vocab = model.config.vocab_size
        self.dtype = model.embed_tokens.weight.dtype

    def send_down(self, header: list[float], hidden: torch.Tensor,
                  checks: tuple[int, ...] | None = None) -> None:
        """A step (``checks is None``: the one-token ``hidden`` rides in the message) or a
        prefill (header, then ``checks``, then ``hidden`` ``(1, T, D)``)."""
        dst = self.rank + 1
        msg = torch.zeros(_HEADER + self.dim, dtype=torch.float64)
        msg[:_HEADER] = torch.tensor(header, dtype=torch.float64)
        if checks is None:
            msg[_HEADER:] = hidden.detach().reshape(-1)
        self.p2p.send(msg, dst, _HDR, "a command")
        if checks is not None:
            self.p2p.send(torch.tensor(checks, dtype=torch.long), dst, _CHECKS, "exit list")
            self.p2p.send(hidden.detach().cpu(), dst, _HIDDEN, "hidden states")

    def send_stop(self) -> None:
        self.send_down([float(STOP)] + [0.0] * (_HEADER - 1), torch.zeros(self.dim))

    def recv_command(self) -> tuple[list[float], torch.Tensor]:
        """A header and the hidden state ``(1, 1, D)`` it carries (a step's)."""
        msg = self.p2p.recv((_HEADER + self.dim,), torch.float64, self.rank - 1, _HDR,
                            "the next command")
        return msg[:_HEADER].tolist(), msg[_HEADER:].to(self.dtype).reshape(1, 1, self.dim)

    def recv_checks(self, n: int) -> tuple[int, ...]:
        t = self.p2p.recv((n,), torch.long, self.rank - 1, _CHECKS, "exit list")
        return tuple(int(x) for x in t.tolist())

    def recv_hidden(self, length: int) -> torch.Tensor:
        return self.p2p.recv((1, length, self.dim), self.dtype, self.rank - 1, _HIDDEN,
                             "hidden states")

    def reply(self, layer: int, logits: torch.Tensor | None) -> None:
        """Tell stage 0 whether this stage decided the token (at ``layer``)."""
        msg = torch.zeros(2 + self.vocab, dtype=torch.float32)
        if logits is not None:
            msg[0], msg[1] = 1.0, float(layer)
            msg[2:] = logits.detach().reshape(-1)
        self.p2p.send(msg, 0, _REPLY, "a decision")

    def recv_reply(self, stage: int) -> tuple[int, torch.Tensor] | None:
        """Stage ``stage``'s reply: ``(layer, logits (1, V))`` if it decided, else ``None``."""
        msg = self.p2p.recv((2 + self.vocab,), torch.float32, stage, _REPLY,
                            f"stage {stage}'s decision")
        if not msg[0]:
            return None
        return int(msg[1]), msg[2:].to(self.dtype).reshape(1, self.vocab)


def serve_stage(model: EarlyExitLM, rank: int, world: int,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run stage ``rank >= 1`` of a ``world``-stage pipeline until stage 0 says stop (the
    joined default group carries the transfers)."""
    a, b = stage_bounds(model.num_layers, world)[rank]
    last = rank == world - 1
    links = _Links(rank, world, timeout_s, model)
    cache: KVCache | None = None
    checks: tuple[int, ...] = ()
    num_layers = model.num_layers
    with torch.inference_mode():
        while True:
            (cmd, pos, decided, force, threshold, n_checks), h = links.recv_command()
            if int(cmd) == STOP:
                if not last:
                    links.send_stop()
                links.p2p.flush()
                return
            prefill = int(cmd) == PREFILL
            if prefill:
                checks = links.recv_checks(int(n_checks))
                length = int(pos)
                h = links.recv_hidden(length)
                cache = _fresh_cache(model, cache, 2 * length + 16)
                positions = torch.arange(length)[None]
            else:
                assert cache is not None, "a decoding step before any prefill"
                length = 1
                positions = torch.tensor([[int(pos)]])
                if int(pos) >= cache.max_seq_len:
                    cache.resize(1, 2 * cache.max_seq_len)
            ctx = model.context(positions, cache)
            stops = _stage_checks(checks, a, b, num_layers)
            was_decided = bool(decided)
            may = not was_decided and not force and threshold < 1.0
            decided_here = False
            for layer, h_at in model.walk(h, a, b, stops, cache=cache, ctx=ctx):
                h = h_at
                if layer in stops:
                    logits = _confident(model, h, layer, cache, ctx, may and not decided_here,
                                        threshold)
                    if logits is not None:
                        links.reply(layer, logits)  # before the rest of the stage runs
                        decided_here = True
            if last and not (was_decided or decided_here):
                links.reply(num_layers, model.final_logits(h[:, -1]))
                decided_here = True
            if not last:
                links.send_down([cmd, pos, float(was_decided or decided_here), force,
                                 threshold, n_checks], h, checks if prefill else None)
            if not (was_decided or decided_here):
                links.reply(0, None)
            cache.lengths = positions[:, -1] + 1


def _fresh_cache(model: EarlyExitLM, cache: KVCache | None, capacity: int) -> KVCache:
    """An empty one-row cache of at least ``capacity`` positions (reusing ``cache``)."""
    if cache is None or cache.max_seq_len < capacity:
        return model.new_cache(1, capacity)
    cache.crop(0)
    return cache


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
        self.broken: ParallelError | None = None
        """The transfer error that broke the pipeline, if one did (:meth:`watch`)."""

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Run stage 0's transfers; a :class:`ParallelError` marks the pipeline broken, so
        :meth:`close` does not try to stop stages that cannot answer (and then report that
        instead of the stage that failed)."""
        try:
            yield
        except ParallelError as err:
            self.broken = self.broken or err
            raise

    def close(self, error: BaseException | None = None) -> None:
        """Stop every stage (and the self-started processes, leaving the group).

        ``error`` is the exception that ends the job, if one does. After a
        :class:`ParallelError` no stop message is sent: a stage stopped answering or died, and
        gloo closes every connection of a process once one of its transfers timed out, so
        another transfer would only fail again and hide the error that names the stage.
        Self-started stages are killed either way (``SIGKILL`` also ends a stopped process)."""
        if self.closed:
            return
        self.closed = True
        error = error or self.broken
        try:
            if not isinstance(error, ParallelError):
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
    """Entry of a self-started stage: rebuild the model from stage 0's tensors and serve."""
    model = EarlyExitLM(cfg).eval()
    _assign(model, tensors)
    serve_stage(model, rank, world, timeout_s)


def _tensors(model: EarlyExitLM) -> dict[str, torch.Tensor]:
    named = itertools.chain(model.named_parameters(remove_duplicate=False),
                            model.named_buffers(remove_duplicate=False))
    return {n: t.detach() for n, t in named}


def _assign(model: EarlyExitLM, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` (parameters and buffers by name) into ``model`` as they are."""
    for name, t in tensors.items():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        if attr in mod._parameters:
            mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t


@contextlib.contextmanager
def pipeline(model: EarlyExitLM, stages: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
             threads: int = 1) -> Iterator[PipelineGroup]:
    """Start ``stages - 1`` stage processes holding ``model``'s weights (this process is
    stage 0) for the duration of the block; ``kv="pipeline"`` decoders inside it use them.

    Raises a :class:`ConfigError` before starting anything when ``stages`` does not fit."""
    stage_bounds(model.num_layers, stages)
    workers = start_workers(_stage_main, (model.config, _tensors(model), timeout_s), stages,
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


class PipelineDecoder(Decoder):
    """Stage 0 of pipeline-based early-exit inference (see the module docstring): runs the
    first stage's layers, decides tokens at its exits, and waits for a later stage's decision
    only for tokens its exits did not decide."""

    name = "early-exit"
    stats_type = EarlyExitStats
    max_batch = 1

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
        self._pending = 0

    def resolved_options(self) -> dict[str, Any]:
        return {**super().resolved_options(), "exit_layers": list(self.checks),
                "stages": self.group.stages,
                "stage_layers": [[a + 1, b] for a, b in self.group.bounds]}

    def close(self) -> None:
        if self.own is not None:
            self.own = None
            self._ctx.__exit__(None, None, None)

    def prefill(self, batch: Batch) -> list[Emit]:
        with self.group.watch():
            return self._prefill(batch)

    def step(self, batch: Batch) -> list[Emit]:
        """Feed the newest token at ``cache.lengths``; choose the next one at the first checked
        exit (on any stage) confident enough, else at the final layer."""
        with self.group.watch():
            return self._step(batch)

    def _prefill(self, batch: Batch) -> list[Emit]:
        h, lens = prefill_hidden(self.model, batch, end=self.end0, exits=self.checks)
        length = int(lens[0])
        links = self.group.links
        links.send_down([float(PREFILL), float(length), 0.0, 1.0, 1.0, float(len(self.checks))],
                        h[:, :length], self.checks)
        layer, logits = self._wait_decision()
        self._pending = 0
        return [Emit(batch.choose(logits), [layer], self.num_layers)]

    def _step(self, batch: Batch) -> list[Emit]:
        seq, cache, model = batch.seqs[0], batch.cache, self.model
        opts = seq.options
        q = int(cache.lengths[0])
        force = self._pending >= opts.max_pending
        seq.stats.forced_full += int(force)  # type: ignore[attr-defined]
        may = opts.threshold < 1.0 and not force
        positions = torch.tensor([[q]], device=self.device)
        ctx = model.context(positions, cache)
        h = model.embed(batch.lasts(self.device), positions)
        decided: tuple[int, torch.Tensor] | None = None
        for layer, h_at in model.walk(h, 0, self.end0, self.checks0, cache=cache, ctx=ctx):
            h = h_at
            if layer in self.checks0:
                logits = _confident(model, h, layer, cache, ctx, may and decided is None,
                                    opts.threshold)
                if logits is not None:
                    decided = (layer, logits)
                    token = batch.choose(logits)  # decided now; this stage finishes the token
        cache.lengths = torch.tensor([q + 1])
        self.group.links.send_down([float(STEP), float(q), float(decided is not None),
                                    float(force), float(opts.threshold), 0.0], h)
        if decided is None:
            decided = self._wait_decision()
            token = batch.choose(decided[1])
        layer = decided[0]
        self._pending = 0 if layer == self.num_layers else self._pending + 1
        return [Emit(token, [layer], self.num_layers)]

    def _wait_decision(self) -> tuple[int, torch.Tensor]:
        """The decision of the first later stage that made one (every stage replies in turn)."""
        for stage in range(1, self.group.stages):
            got = self.group.links.recv_reply(stage)
            if got is not None:
                return got
        raise RuntimeError("the last stage did not decide the token")  # protocol violation
