"""The CUDA runner: primitives captured once per shape as CUDA graphs and replayed.

On a GPU a small model's decoding step is bound by kernel launches, not by arithmetic: one
step of SmolLM2-135M is ~450 kernels (30 layers of norms, products, rotary, attention), each
costing the host a few microseconds to launch. A CUDA graph records the kernels once and
replays them with one launch (gpt-fast's ``decode_one_token`` under ``torch.compile(mode=
"reduce-overhead")`` does the same through the compiler; vLLM v1's model runner captures its
forward per batch size). :class:`GraphRunner` captures its *primitives* - never a strategy's
round - from the model's own modules, so nothing is compiled and the arithmetic is the eager
model's:

* :meth:`GraphRunner.chain` - ``n`` greedy steps through layers ``[0, depth)`` and the exit
  head, and optionally the last step's logits (a plain step, self-drafting, a PPD branch);
* :meth:`GraphRunner.layers` - layers ``[a, b)`` over up to :data:`MAX_GRAPH_POSITIONS`
  positions per row (verification, PPD's early part and rest);
* :meth:`GraphRunner.logits` - an exit's head over those positions.

A graph replays fixed kernels on fixed memory, so the captured code is written statically:

* positions are a device tensor, never read on the host: rotary tables are indexed on the
  device, keys/values are scattered to their positions (``WritePlan.index``), and attention
  reads the first ``S`` cache slots with a mask ``slot <= position``. ``S`` is the next power
  of two (at least 64) past the longest position, so a step reads at most twice the cache it
  needs and each sequence length reuses a handful of graphs;
* inputs are copied into buffers the graph owns; outputs are buffers the next replay of the
  same graph overwrites (the primitives return copies only where a caller keeps them);
* the host-side bookkeeping of the eager cache writes (``KVCache.fill``) is done after the
  replay.

Graphs replayed one after the other share one memory pool; a primitive called on another
CUDA stream than the runner's (PPD's branches, which run beside the main token) gets a private
pool, since graphs that run at the same time must not share one. Programs are keyed by shape
and by the storage of the cache they read and write; :meth:`GraphRunner.release` forgets a
cache's programs (the engine's pool calls it before it reallocates).

With ``capture=False`` the same static code runs eagerly on any device: the CPU tests check
it against the eager runner, so the GPU replays only what the CPU already verified. Anything
else - sampling picks, heads with a block of their own, prefills, KV recomputation - runs on
the eager runner's code.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exitlm.env import switched_off
from exitlm.model.kv_cache import KVCache, WritePlan
from exitlm.model.layers import attention_dtype
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.runtime.fused import FusedStep
from exitlm.runtime.runner import Chain, Pick, Runner

MIN_SLOTS = 64
"""The fewest cache slots a static primitive attends over (``S``, a power of two)."""
MAX_GRAPH_POSITIONS = 65
"""The most positions per row a captured :meth:`GraphRunner.layers` takes (verification of up
to 64 drafts); longer forwards (prefills) run eagerly."""
MAX_PROGRAMS = 64
"""The most captured graphs kept; the least recently used cache's are dropped beyond it."""

Body = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]


def graphs_wanted() -> bool:
    """Whether CUDA models decode through graphs (``EXITLM_CUDA_GRAPHS=0`` turns it off, as
    ``false`` / ``no`` / ``off`` do: :func:`exitlm.env.switched_off`)."""
    return not switched_off("EXITLM_CUDA_GRAPHS")


def attended_slots(last_position: int, capacity: int) -> int:
    """``S``: the slots a static primitive attends over when its longest position is
    ``last_position`` - the next power of two past it, at least :data:`MIN_SLOTS`, at most the
    cache's ``capacity``."""
    need = last_position + 1
    if need > capacity:
        raise ValueError(f"KV cache overflow: position {last_position} does not fit "
                         f"max_seq_len {capacity}")
    return min(capacity, max(MIN_SLOTS, 1 << (need - 1).bit_length()))


@dataclass
class _Program:
    """One captured graph: its input buffers, its output buffers and what it must keep alive
    (the cache and rotary tables whose memory it reads and writes)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    keep: tuple[object, ...] = ()


class GraphRunner(Runner):
    """Primitives as CUDA graphs (module docstring).

    Args:
        model: a CUDA model (any model with ``capture=False``). Its weights are read by the
            graphs in place: values may change, storage may not.
        capture: capture and replay graphs (CUDA only); ``False`` runs the static code eagerly.
        fuse: a ``torch.compile`` backend (:data:`~exitlm.runtime.fused.COMPILERS`) that
            compiles each layer's static step (:mod:`exitlm.runtime.fused`), captured inside
            the graphs; ``None``: the eager modules' kernels.

    Attributes:
        enabled: primitives use the static code only while this is true (benchmarks compare).
        fused: the compiled layer step, or ``None``.
        captures: graphs captured so far (a new shape or a new cache each).
        capture_s: the time those captures took (warm-up runs included).
    """

    kind = "graphs"

    def __init__(self, model: EarlyExitLM, *, capture: bool = True,
                 fuse: str | None = None) -> None:
        super().__init__(model)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        self.capture = capture
        self.enabled = True
        self.captures = 0
        self.capture_s = 0.0
        self.attn_dtype = attention_dtype(self.dtype, self.device)
        self._programs: OrderedDict[tuple[object, ...], _Program] = OrderedDict()
        self._pool: object = None
        self._stream = torch.cuda.current_stream(self.device) if capture else None
        self.fused = None if fuse is None else FusedStep(fuse)
        if fuse is not None:
            self.kind = "fused"

    # ----- what the engine asks --------------------------------------------------------------
    def release(self, cache: KVCache) -> None:
        """Forget the programs that read and write ``cache`` (about to be reallocated)."""
        ident = _cache_identity(cache)
        for key in [k for k in self._programs if k[0] == ident]:
            del self._programs[key]

    def close(self) -> None:
        """Drop every captured graph (and the memory pool they shared: a pool whose graphs
        are all gone is released, and its handle cannot be used again)."""
        self._programs.clear()
        self._pool = None

    # ----- primitives --------------------------------------------------------------------------
    def chain(self, tokens: torch.Tensor, cache: KVCache, n: int, depth: int, *,
              vocab: int | None = None, logits: bool = False, pick: Pick | None = None,
              stop_below: float | None = None) -> Chain:
        """The greedy chain as one program per shape ``(rows, n, depth, vocab, S)``: every
        step's embedding, layers, head and argmax without leaving the device (a chain that
        may stop early, ``stop_below``, runs eagerly)."""
        model = self.model
        if (not self.enabled or pick is not None or model.exit_route(depth).has_block
                or stop_below is not None):
            return super().chain(tokens, cache, n, depth, vocab=vocab, logits=logits,
                                 pick=pick, stop_below=stop_below)
        lengths = cache.lengths.clone()
        s = attended_slots(int(lengths.max()) + n, cache.max_seq_len)
        b = tokens.shape[0]
        ids = model.draft_ids(vocab) if n else None

        def body(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            base = x["positions"][:, None]  # (B, 1)
            tok = x["tokens"][:, None]
            hidden, chosen = [], []
            for j in range(n + 1):
                pos = base + j
                h = self._layers(self._embed(tok, pos), pos, cache, 0, depth, s)  # (B, 1, D)
                hidden.append(h)
                if j < n:
                    step = super(GraphRunner, self).logits(h, depth, vocab=vocab)[:, -1]
                    col = torch.argmax(step, dim=-1)[:, None]  # (B, 1)
                    tok = col if ids is None else ids[col]  # a ranked draft vocabulary
                    chosen.append(tok)
            out: tuple[torch.Tensor, ...] = (
                torch.cat(chosen, dim=1) if chosen else x["tokens"][:, None][:, :0],
                torch.cat(hidden, dim=1))
            if logits:
                out += (super(GraphRunner, self).logits(hidden[-1], depth)[:, -1],)
            return out

        inputs = {"tokens": tokens.to(self.device), "positions": lengths.to(self.device)}
        order = None if ids is None else ids.data_ptr()
        got = self._run(("chain", b, n, depth, vocab, order, logits, s), cache, inputs, body)
        _grow_fill(cache, 0, depth, lengths + n + 1)
        return Chain(got[0], got[1], got[2] if logits else None)

    def layers(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor | None,
               cache: KVCache | None, ctx: StepContext | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` as one program per shape ``(rows, positions, a, b, S)``;
        a forward without cache or over more than :data:`MAX_GRAPH_POSITIONS` positions per
        row (a prefill) runs eagerly."""
        if (not self.enabled or cache is None or positions is None
                or h.shape[1] > MAX_GRAPH_POSITIONS or end <= start):
            return super().layers(h, start, end, positions, cache, ctx)
        s = attended_slots(int(positions.max()), cache.max_seq_len)
        b, t = positions.shape

        def body(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return (self._layers(x["h"], x["positions"], cache, start, end, s),)

        inputs = {"h": h, "positions": positions.to(self.device)}
        (out,) = self._run(("layers", b, t, start, end, s), cache, inputs, body)
        _grow_fill(cache, start, end, positions.max(dim=1).values.cpu() + 1)
        return out

    def logits(self, h: torch.Tensor, layer: int, *, vocab: int | None = None,
               positions: torch.Tensor | None = None, cache: KVCache | None = None,
               ctx: StepContext | None = None, shared_ok: bool = False) -> torch.Tensor:
        """An exit's head as one program per shape; heads with a block of their own (which
        write a cache slot), and long inputs, run eagerly."""
        route = self.model.exit_route(layer, shared_ok=shared_ok)
        if (not self.enabled or route.has_block or h.dim() > 3
                or (h.dim() == 3 and h.shape[1] > MAX_GRAPH_POSITIONS)):
            return super().logits(h, layer, vocab=vocab, positions=positions, cache=cache,
                                  ctx=ctx, shared_ok=shared_ok)

        def body(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return (super(GraphRunner, self).logits(x["h"], layer, vocab=vocab,
                                                    shared_ok=shared_ok),)

        (out,) = self._run(("logits", tuple(h.shape), layer, vocab), None, {"h": h}, body)
        return out.clone() if self.capture else out  # callers may keep several heads' logits

    # ----- the static pieces --------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings without the host-side position check of
        :meth:`~exitlm.model.transformer.EarlyExitLM.embed` (positions stay on the device;
        the engine bounds them by the context)."""
        model = self.model
        h = model.embed_tokens(tokens)
        if model.embed_positions is not None:
            limit = model.config.max_seq_len - 1
            h = h + model.embed_positions(positions.clamp(max=limit))
        return h

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                end: int, slots: int) -> torch.Tensor:
        """Layers ``[start, end)`` at device ``positions`` ``(B, T)``: keys/values scattered to
        their positions, attention over the first ``slots`` cache slots, masked causally."""
        model = self.model
        rope = None
        if model.rope_inv_freq is not None:
            cos, ssin = model._rope_table(torch.tensor([slots - 1]), self.attn_dtype)
            rope = (cos[positions], ssin[positions])  # (B, T, 1, D)
        reach = torch.arange(slots, device=positions.device)
        mask = reach[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, T, S)
        if self.fused is not None:
            cos, ssin = (None, None) if rope is None else rope
            for i in range(start, end):  # one compiled program serves every layer
                h = self.fused(model.layers[i], h, cos, ssin, cache.keys[i][:, :, :slots],
                               cache.values[i][:, :, :slots], positions, mask)
            return h
        b, t = positions.shape
        # fill is the caller's: the eager write's host-side update is a no-op here
        plan = WritePlan(end=slots, start=-1, length=t, index=positions,
                         new_fill=torch.zeros(b, dtype=torch.long))
        ctx = StepContext(positions, rope, plan, mask)
        return model.run_layers(h, start, end, cache=cache, ctx=ctx)

    def _run(self, key: tuple[object, ...], cache: KVCache | None,
             inputs: dict[str, torch.Tensor], body: Body) -> tuple[torch.Tensor, ...]:
        """Run ``body`` on ``inputs``: eagerly, or by replaying the graph captured for
        ``key`` and this cache's storage (captured on first use)."""
        if not self.capture:
            return body(inputs)
        ident = None if cache is None else _cache_identity(cache)
        current = torch.cuda.current_stream(self.device)
        private = current != self._stream  # runs beside the runner's stream: a pool of its own
        full = (ident, *key, private)
        prog = self._programs.get(full)
        if prog is None:
            keep = () if cache is None else (cache.keys, cache.values)
            prog = self._capture(inputs, body, keep, private)
            self._programs[full] = prog
            while len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(full)
            for name, value in inputs.items():
                prog.inputs[name].copy_(value, non_blocking=True)
        prog.graph.replay()
        return prog.outputs

    def _capture(self, inputs: dict[str, torch.Tensor], body: Body, keep: tuple[object, ...],
                 private: bool) -> _Program:
        """Warm ``body`` up on a side stream (library handles, workspaces), then capture it.
        The warm-up computes the call for real; the replay that follows repeats it exactly
        (every program writes only the cache positions it then reads), so the result stands."""
        t0 = time.perf_counter()
        static = {k: v.clone() for k, v in inputs.items()}
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            body(static)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=None if private else self._pool):
            outputs = body(static)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        # the rotary tables it indexes: the model replaces (and frees) them when they grow
        tables = tuple(self.model._rope_cache.values())
        return _Program(graph, static, outputs, (*keep, tables))


def _cache_identity(cache: KVCache) -> tuple[object, ...]:
    """The storage a cache's programs write: its first slot's address and layout (a pool view
    of fewer rows shares it; a reallocated pool does not)."""
    k = cache.keys[0]
    return (k.data_ptr(), k.untyped_storage().nbytes(), k.stride(), cache.max_seq_len,
            len(cache.keys))


def _grow_fill(cache: KVCache, start: int, end: int, upto: torch.Tensor) -> None:
    """``fill`` of slots ``[start, end)`` at least ``upto`` ``(B,)`` (what the eager cache
    writes record)."""
    fill = cache.fill[start:end]
    torch.maximum(fill, upto[None, :], out=fill)


__all__ = ["MAX_GRAPH_POSITIONS", "GraphRunner", "attended_slots", "graphs_wanted"]
