"""Execute one training step's actions on one pipeline stage.

The backward step is EE-LLM's (Sec. 3.1, Eq. 2): stage ``i`` back-propagates

    L_i^aux = L_i + <g_i, x_i>

where ``L_i`` is the weighted sum of the exit losses computed on stage ``i``, ``x_i`` the
hidden states it sent forward and ``g_i = dL_{i+1}^aux / dx_i`` the gradient received back,
treated as a constant. ``torch.autograd.backward([L_i, x_i], [1, g_i])`` is exactly the
gradient of that sum, without materialising the inner product. Nothing beyond a standard
pipeline's messages is sent.

Exit heads may be *deferred* (EE-LLM App. A.2, Optimization 1): the forward step keeps only
the hidden state at the exit (already alive as part of the backbone's graph) and the exit's
logits and loss are computed at the start of the backward step, so exit logits
``(b, s, V)`` exist for one microbatch at a time instead of for every in-flight one.

Token slices (TeraPipe Sec. 3) run through :class:`~.slices.SliceKV`; their losses are
normalised by the whole microbatch's label count, so slicing changes no gradient.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from exitlm.comm.p2p import P2P, message_tag
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.plan.schedule import Action, PipelineSchedule
from exitlm.train.losses import lm_cross_entropy
from exitlm.train.parallel.memory import SavedBytes, param_storages
from exitlm.train.parallel.pipeline.slices import SliceKV
from exitlm.train.parallel.pipeline.stage import StageSpec


@dataclass
class Microbatch:
    """One microbatch's data, the same on every stage."""

    tokens: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T)
    active: Sequence[torch.Tensor | None] | None = None  # layer dropout rows, per layer


@dataclass
class _Slice:
    x_in: torch.Tensor | None = None
    out: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    deferred: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    ctx: StepContext | None = None
    act_bytes: int = 0
    counted: set[int] = field(default_factory=set)


@dataclass
class _State:
    count: torch.Tensor
    kv: SliceKV | None
    slices: dict[int, _Slice] = field(default_factory=dict)


@dataclass
class StepStats:
    """What one stage saw in one step."""

    exit_ce: dict[int, float] = field(default_factory=dict)
    """Sum over regular microbatches of each exit's mean cross-entropy (divide by M)."""
    busy_s: float = 0.0
    """Seconds spent computing (not waiting for peers)."""
    peak_activation_bytes: int = 0
    """Peak bytes saved for backward across in-flight microbatches (parameters excluded)."""


class StageExecutor:
    """Runs the actions of one stage for one step (see :func:`run_step`)."""

    def __init__(
        self,
        model: EarlyExitLM,
        spec: StageSpec,
        schedule: PipelineSchedule,
        p2p: P2P,
        stage_ranks: Sequence[int],
        *,
        deferred_exits: bool = True,
        ignore_index: int = -100,
        measure_memory: bool = False,
        seq_shards: int = 1,
    ) -> None:
        self.model = model
        self.spec = spec
        self.schedule = schedule
        self.p2p = p2p
        self.ranks = list(stage_ranks)
        self.deferred = deferred_exits
        self.ignore_index = ignore_index
        self.measure = measure_memory
        self.dim = model.config.dim
        self.seq_shards = seq_shards  # sequence parallelism: activations are sequence shards
        self.param_ptrs = param_storages(model)
        self.bounds = [0]
        for n in schedule.slices:
            self.bounds.append(self.bounds[-1] + n)

    # ----- one step ----------------------------------------------------------------------
    def run_step(
        self,
        batches: Sequence[Microbatch],
        weights: Mapping[int, float],
        scale: float,
    ) -> StepStats:
        """Run every action of this stage. ``weights``: 1-based layer -> loss weight (EE-LLM
        Eq. 1); every microbatch's loss is multiplied by ``scale`` (1 / microbatches)."""
        if len(batches) != self.schedule.num_microbatches:
            raise ValueError(f"the schedule has {self.schedule.num_microbatches} microbatches, "
                             f"got {len(batches)} batches")
        seq = int(batches[0].tokens.shape[1])
        if seq != self.bounds[-1]:
            raise ValueError(f"token slices {list(self.schedule.slices)} cover {self.bounds[-1]} "
                             f"tokens, the batch has {seq}")
        self.batches = batches
        self.weights = {k: float(w) for k, w in weights.items()
                        if k in self.spec.loss_layers and w != 0.0}
        self.scale = scale
        self.stats = StepStats()
        self.states: dict[int, _State] = {}
        self.live_bytes = 0
        for action in self.schedule.actions[self.spec.index]:
            if action.kind == "F":
                self._forward(action)
            else:
                self._backward(action)
        self.p2p.flush()
        leftover = [m for m, st in self.states.items() if st.slices]
        if leftover:
            raise RuntimeError(f"stage {self.spec.index}: microbatches {leftover} were never "
                               "back-propagated; the schedule is inconsistent")
        self.states = {}
        return self.stats

    # ----- forward -----------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        spec = self.spec
        k = spec.index
        route = self.schedule.routes[a.mb]
        mb = self.batches[a.mb]
        n_slices = len(self.schedule.slices)
        lo, hi = self.bounds[a.slice], self.bounds[a.slice + 1]
        st = self.states.get(a.mb)
        if st is None:
            count = (mb.labels != self.ignore_index).sum().clamp_min(1)
            st = self.states[a.mb] = _State(count, SliceKV() if n_slices > 1 else None)
        grad_here = route.backwards(k)
        x_in = None
        if not spec.first:
            x_in = self.p2p.recv(self._shape(a), self._act_dtype(),
                                 self.ranks[k - 1], message_tag(a.mb, a.slice, n_slices, False),
                                 f"activations of microbatch {a.mb} slice {a.slice}")
            if grad_here and k > route.bwd_first:
                x_in.requires_grad_()
        t0 = time.perf_counter()
        sl = _Slice(x_in=x_in)
        meter = SavedBytes(self.param_ptrs, sl.counted) if self.measure and grad_here else None
        with torch.set_grad_enabled(grad_here and torch.is_grad_enabled()):
            if meter is not None:
                meter.__enter__()
            try:
                out = self._stage_forward(a, mb, st, sl, lo, hi, x_in, grad_here)
            finally:
                if meter is not None:
                    meter.__exit__(None, None, None)
        if meter is not None:
            sl.act_bytes = meter.bytes
            self.live_bytes += meter.bytes
            self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes,
                                                   self.live_bytes)
        self.stats.busy_s += time.perf_counter() - t0
        if k < route.fwd_last:
            self.p2p.send(out, self.ranks[k + 1], message_tag(a.mb, a.slice, n_slices, False),
                          f"activations of microbatch {a.mb} slice {a.slice}")
            if route.backwards(k + 1) and grad_here:
                sl.out = out
        if grad_here:
            st.slices[a.slice] = sl

    def _stage_forward(self, a: Action, mb: Microbatch, st: _State, sl: _Slice, lo: int,
                       hi: int, x_in: torch.Tensor | None, grad_here: bool) -> torch.Tensor:
        spec, model = self.spec, self.model
        tokens = mb.tokens[:, lo:hi]
        positions = torch.arange(lo, hi, device=tokens.device).expand(tokens.shape[0], -1)
        if st.kv is not None:
            st.kv.begin(a.slice, hi - lo)
        ctx = model.context(positions, st.kv)  # type: ignore[arg-type]
        sl.ctx = ctx
        h_in = model.embed(tokens, positions) if spec.first else x_in
        assert h_in is not None
        labels = mb.labels[:, lo:hi]
        loss_layers = [layer for layer in spec.exits if layer in self.weights] if grad_here \
            else []
        kv: Any = st.kv
        for layer, h in model.walk(h_in, spec.start, spec.end, loss_layers, cache=kv,
                                   ctx=ctx, active=mb.active):
            if layer not in loss_layers:
                continue
            if self.deferred:
                sl.deferred.append((layer, h))
            else:
                logits = model.exit_logits(h, layer, cache=st.kv, ctx=ctx)  # type: ignore[arg-type]
                self._add_loss(sl, a.mb, layer, logits, labels, st.count)
        final = spec.num_layers
        if spec.last and grad_here and final in self.weights:
            self._add_loss(sl, a.mb, final, model.final_logits(h), labels, st.count)
        return h

    def _add_loss(self, sl: _Slice, mb: int, layer: int, logits: torch.Tensor,
                  labels: torch.Tensor, count: torch.Tensor) -> None:
        ce = lm_cross_entropy(logits, labels, self.ignore_index, count)
        term = ce * (self.weights[layer] * self.scale)
        sl.loss = term if sl.loss is None else sl.loss + term
        if self.schedule.routes[mb].kind == "regular":
            self.stats.exit_ce[layer] = self.stats.exit_ce.get(layer, 0.0) + float(ce.detach())

    def _act_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ----- backward ----------------------------------------------------------------------
    def _backward(self, a: Action) -> None:
        spec = self.spec
        k = spec.index
        route = self.schedule.routes[a.mb]
        n_slices = len(self.schedule.slices)
        st = self.states[a.mb]
        sl = st.slices.pop(a.slice)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if k < route.fwd_last:
            g = self.p2p.recv(self._shape(a), self._act_dtype(), self.ranks[k + 1],
                              message_tag(a.mb, a.slice, n_slices, True),
                              f"gradients of microbatch {a.mb} slice {a.slice}")
            if sl.out is not None and sl.out.requires_grad:
                roots.append(sl.out)  # <g_i, x_i> of EE-LLM Eq. 2b
                grads.append(g)
        t0 = time.perf_counter()
        mb = self.batches[a.mb]
        lo, hi = self.bounds[a.slice], self.bounds[a.slice + 1]
        meter = (SavedBytes(self.param_ptrs, set(sl.counted)) if self.measure and sl.deferred
                 else None)
        if meter is not None:
            meter.__enter__()
        try:
            for layer, h in sl.deferred:  # Optimization 1: exit forward in the backward step
                logits = self.model.exit_logits(h, layer, cache=st.kv, ctx=sl.ctx)  # type: ignore[arg-type]
                self._add_loss(sl, a.mb, layer, logits, mb.labels[:, lo:hi], st.count)
        finally:
            if meter is not None:
                meter.__exit__(None, None, None)
        if meter is not None:
            self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes,
                                                   self.live_bytes + meter.bytes)
        if sl.loss is not None and sl.loss.requires_grad:
            roots.append(sl.loss)
            grads.append(torch.ones_like(sl.loss))
        if st.kv is not None:
            r, g2 = st.kv.roots(a.slice)
            roots += r
            grads += g2
        if roots:
            torch.autograd.backward(roots, grads)
        if st.kv is not None:
            st.kv.harvest(a.slice)
            st.kv.release(a.slice)
        self.live_bytes -= sl.act_bytes
        self.stats.busy_s += time.perf_counter() - t0
        if k > route.bwd_first:
            x = sl.x_in
            gx = x.grad if x is not None and x.grad is not None else torch.zeros(
                self._shape(a), dtype=self._act_dtype(), device=self.p2p.device)
            self.p2p.send(gx, self.ranks[k - 1], message_tag(a.mb, a.slice, n_slices, True),
                          f"gradients of microbatch {a.mb} slice {a.slice}")
        if not st.slices and (st.kv is None or a.slice == 0):
            self.states.pop(a.mb, None)

    def _shape(self, a: Action) -> tuple[int, int, int]:
        """The activations this process sends / receives for an action: the slice's tokens,
        or this rank's sequence shard of them under sequence parallelism."""
        lo, hi = self.bounds[a.slice], self.bounds[a.slice + 1]
        return (int(self.batches[a.mb].tokens.shape[0]), (hi - lo) // self.seq_shards, self.dim)
