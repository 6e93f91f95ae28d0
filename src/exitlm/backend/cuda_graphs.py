"""Decoding steps captured once as CUDA graphs and replayed: :class:`StaticSteps`.

On a GPU a small model's decoding step is bound by kernel launches, not by arithmetic: one
step of SmolLM2-135M is ~450 kernels (30 layers of norms, products, rotary, attention), each
costing the host a few microseconds to launch. A CUDA graph records the whole step once and
replays it with one launch (gpt-fast's ``decode_one_token`` under ``torch.compile(mode=
"reduce-overhead")`` does the same through the compiler; here the graphs are captured
directly from the model's own modules, so nothing is compiled and the arithmetic is the
eager model's).

A graph replays fixed kernels on fixed memory, so a *static* step is written differently
from the eager one (:meth:`~exitlm.model.transformer.EarlyExitLM.context`):

* positions are a device tensor, never read on the host: rotary tables are indexed on the
  device, keys/values are scattered to their positions (``WritePlan.index``), and attention
  reads the first ``S`` cache slots with a mask ``slot <= position``. ``S`` is the next
  power of two (at least 64) past the longest position, so a step reads at most twice the
  cache it needs and each sequence length reuses a handful of graphs;
* inputs are copied into buffers the graph owns, and outputs are buffers the next replay
  overwrites (callers read them before the next call);
* the host-side bookkeeping the eager cache writes do (``KVCache.fill``) is done by the
  caller after the replay.

Three programs cover the decoding loop's hot paths, each one graph per shape (rows, draft
length, ``S``):

* :meth:`StaticSteps.step` - a plain or fixed-exit step (embedding, layers ``1..e``, exit
  ``e``'s logits): autoregressive decoding, LayerSkip's fixed exit;
* :meth:`StaticSteps.spec_round` - one whole greedy round of self-speculative decoding
  (LayerSkip Sec. 4.3): ``n`` drafts through layers ``1..E`` and exit ``E`` (Sec. 4.3.1),
  then layers ``E+1..L`` over the exit-query cache (Sec. 4.3.2-4.3.3) and the final layer's
  argmax; the host then only compares tokens (one device-to-host copy per round);
* :meth:`StaticSteps.ppd_step` - one token of Predictive Pipelined Decoding (PPD Alg. 2) from
  one host thread: the early part and its top-k, each branch on its own CUDA stream, the main
  token's remaining layers beside them.

With ``capture=False`` the same static code runs eagerly (any device): the CPU tests check
it against the eager model, so the GPU replays only what the CPU already verified.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from exitlm.model.kv_cache import KVCache, WritePlan
from exitlm.model.layers import attention_dtype
from exitlm.model.transformer import EarlyExitLM, StepContext

MIN_SLOTS = 64
"""The fewest cache slots a static step attends over (``S``, a power of two)."""

Body = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]


def graphs_wanted() -> bool:
    """Whether CUDA models decode through graphs (``EXITLM_CUDA_GRAPHS=0`` turns it off)."""
    return os.environ.get("EXITLM_CUDA_GRAPHS", "1") != "0"


def attended_slots(last_position: int, capacity: int) -> int:
    """``S``: the slots a static step attends over when its longest position is
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


@dataclass
class StaticSteps:
    """The static decoding programs of one model (see the module docstring).

    Attributes:
        model: the model (its weights are read by the graphs in place: values may change,
            storage may not - a moved or cast model needs a new instance).
        capture: capture CUDA graphs and replay them (CUDA only); ``False`` runs the static
            code eagerly.
        enabled: decoders use the programs only while this is true (benchmarks compare).
        captures: how many graphs were captured (a new shape or a new cache each).
        capture_s: the time those captures took (warm-up run included).
    """

    model: EarlyExitLM
    capture: bool = True
    enabled: bool = True
    captures: int = 0
    capture_s: float = 0.0
    _programs: dict[tuple[object, ...], _Program] = field(default_factory=dict)
    _cache_id: tuple[object, ...] | None = None
    _pool: object = None
    _buffers: dict[tuple[object, ...], dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ref = self.model.embed_tokens.weight
        if self.capture and ref.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {ref.device}")
        self.device = ref.device
        self.attn_dtype = attention_dtype(ref.dtype, ref.device)
        self.weights = _weights(self.model)

    # ----- what a decoder asks -------------------------------------------------------------
    def serves_exit(self, layer: int) -> bool:
        """Whether exit ``layer``'s logits need no cache of their own (no block head)."""
        return not self.model.exit_route(layer).has_block

    def step(self, tokens: torch.Tensor, cache: KVCache, depth: int) -> torch.Tensor:
        """Logits ``(B, V)`` of exit ``depth`` for ``tokens`` ``(B,)`` fed at positions
        ``cache.lengths``; writes their keys/values in layers ``1..depth`` and updates
        ``fill`` (``lengths`` is the caller's). The result is overwritten by the next call."""
        model = self.model
        lengths = cache.lengths.clone()
        s = attended_slots(int(lengths.max()), cache.max_seq_len)
        b = tokens.shape[0]

        def body(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            pos = x["positions"][:, None]  # (B, 1)
            h = self._embed(x["tokens"][:, None], pos)
            h = self._layers(h, pos, cache, 0, depth, s)
            return (model.exit_logits(h, depth)[:, -1],)

        inputs = {"tokens": tokens.to(self.device), "positions": lengths.to(self.device)}
        (logits,) = self._run(("step", b, depth, s), cache, inputs, body)
        _grow_fill(cache, 0, depth, lengths + 1)
        return logits

    def spec_round(self, tokens: torch.Tensor, cache: KVCache, n: int, exit_layer: int,
                   draft_head: Callable[[torch.Tensor], torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy self-speculative round for every row (LayerSkip Sec. 4.3): from
        ``tokens`` ``(B,)`` at positions ``cache.lengths``, ``n`` greedy drafts through
        layers ``1..E`` and ``draft_head`` (exit ``E``'s logits of a hidden state), then
        layers ``E+1..L`` over the ``n + 1`` exit queries and the final layer's argmax.

        Returns drafts ``(B, n)`` and the final layer's tokens ``(B, n + 1)`` (overwritten by
        the next call). Every layer's keys/values of positions ``lengths .. lengths + n`` are
        written and ``fill`` updated; accepting and rolling back is the caller's."""
        model, e, num_layers = self.model, exit_layer, self.model.num_layers
        lengths = cache.lengths.clone()
        s = attended_slots(int(lengths.max()) + n, cache.max_seq_len)
        b = tokens.shape[0]

        def body(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            base = x["positions"][:, None]  # (B, 1)
            tok = x["tokens"][:, None]
            queries, drafts = [], []
            for j in range(n + 1):
                pos = base + j
                h = self._layers(self._embed(tok, pos), pos, cache, 0, e, s)  # (B, 1, D)
                queries.append(h)
                if j < n:
                    tok = torch.argmax(draft_head(h)[:, -1], dim=-1)[:, None]  # (B, 1)
                    drafts.append(tok)
            pos = base + torch.arange(n + 1, device=base.device)[None, :]  # (B, n+1)
            hv = self._layers(torch.cat(queries, dim=1), pos, cache, e, num_layers, s)
            target = torch.argmax(model.final_logits(hv), dim=-1)  # (B, n+1)
            out = torch.cat(drafts, dim=1) if drafts else target[:, :0]
            return out, target

        inputs = {"tokens": tokens.to(self.device), "positions": lengths.to(self.device)}
        drafts, target = self._run(("round", b, n, e, s), cache, inputs, body)
        _grow_fill(cache, 0, num_layers, lengths + n + 1)
        return drafts, target

    def ppd_step(self, token: int, main: KVCache, branches: list[KVCache],
                 carried: torch.Tensor | None, ppd_layer: int,
                 head: Callable[[torch.Tensor], torch.Tensor],
                 streams: list[torch.cuda.Stream] | None
                 ) -> tuple[int, list[int], list[torch.Tensor]]:
        """One token of Predictive Pipelined Decoding (PPD Alg. 2) from one host thread.

        ``token`` at position ``p = main.lengths[0]`` runs to layer ``d_bar = ppd_layer`` -
        from the first layer, or from layer ``m = d - d_bar`` on ``carried`` (line 12) - and
        exit ``d_bar``'s top-``k`` (``k = len(branches)``) become the candidates (lines
        14-16), all without leaving the device. Then candidate ``j`` runs at ``p + 1`` through
        layers ``[0, m)`` on ``branches[j]`` (lines 17-29), each on ``streams[j]``, while the
        main token's layers ``[d_bar, d)`` and the final argmax run on the current stream;
        one copy brings the token and the candidates to the host. Graph replays are
        asynchronous, so the branches really overlap the main token (no Python thread, no
        GIL hand-off: the threads of the eager path serialise on the GIL).

        Returns the final layer's token, the candidates and each branch's hidden state
        ``(1, 1, D)`` (buffers the next call overwrites). Main's keys/values of position
        ``p`` are written in every layer (with ``carried``, layers ``< m`` hold the winning
        branch's, copied by the caller), each branch's of ``p + 1`` in layers ``< m``."""
        model = self.model
        d = model.num_layers
        m, k = d - ppd_layer, len(branches)
        p = int(main.lengths[0])
        s = attended_slots(p + 1, min(main.max_seq_len, *(c.max_seq_len for c in branches)))
        buf = self._ppd_buffers(k)
        buf["pos"].copy_(torch.tensor([p]))
        if carried is None:  # line 10: from the first layer
            buf["tok"].copy_(torch.tensor([token]))
            start, first = 0, lambda ps: self._embed(buf["tok"][:, None], ps)
        else:  # line 12: the confirmed branch's state after layer m
            buf["carried"].copy_(carried)
            start, first = m, lambda ps: buf["carried"]

        def early(_: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            ps = buf["pos"][:, None]
            h = self._layers(first(ps), ps, main, start, ppd_layer, s)
            buf["hm"].copy_(h)
            buf["cands"].copy_(torch.topk(head(h)[0, -1], k).indices)
            return ()

        self._run(("ppd_early", start, ppd_layer, k, s), main, {}, early)
        if carried is None:  # the branches attend to main's new entry in their layers
            for c in branches:
                c.copy_from(main, m, p)
        current = torch.cuda.current_stream(self.device) if streams is not None else None
        for j, c in enumerate(branches):
            def branch(_: dict[str, torch.Tensor], j: int = j, c: KVCache = c
                       ) -> tuple[torch.Tensor, ...]:
                ps = buf["pos"][:, None] + 1
                h = self._layers(self._embed(buf["cands"][j:j + 1][:, None], ps), ps, c, 0, m, s)
                buf["states"][j].copy_(h)
                return ()

            key = ("ppd_branch", j, m, k, s, _cache_identity(c), streams is not None)
            if streams is None:
                self._run(key, main, {}, branch, (c.keys, c.values))
                continue
            streams[j].wait_stream(current)
            with torch.cuda.stream(streams[j]):  # beside the main token: memory of its own
                self._run(key, main, {}, branch, (c.keys, c.values), private=True)

        def rest(_: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            ps = buf["pos"][:, None]
            h = self._layers(buf["hm"], ps, main, ppd_layer, d, s)
            buf["x"].copy_(torch.argmax(model.final_logits(h)[:, -1], dim=-1))
            return ()

        self._run(("ppd_rest", ppd_layer, k, s), main, {}, rest)
        if streams is not None:
            for st in streams[:k]:
                current.wait_stream(st)
        got = torch.cat((buf["x"], buf["cands"])).tolist()  # the one copy to the host
        _grow_fill(main, 0, d, torch.tensor([p + 1]))
        for c in branches:
            _grow_fill(c, 0, m, torch.tensor([p + 2]))
        return got[0], got[1:], [buf["states"][j] for j in range(k)]

    def _ppd_buffers(self, k: int) -> dict[str, torch.Tensor]:
        """PPD's device buffers for ``k`` branches (made once: graphs read them in place)."""
        got = self._buffers.get(("ppd", k))
        if got is None:
            dim, dev = self.model.config.dim, self.device
            dt = self.model.embed_tokens.weight.dtype
            got = {"pos": torch.zeros(1, dtype=torch.long, device=dev),
                   "tok": torch.zeros(1, dtype=torch.long, device=dev),
                   "x": torch.zeros(1, dtype=torch.long, device=dev),
                   "cands": torch.zeros(k, dtype=torch.long, device=dev),
                   "carried": torch.zeros(1, 1, dim, dtype=dt, device=dev),
                   "hm": torch.zeros(1, 1, dim, dtype=dt, device=dev),
                   "states": torch.zeros(k, 1, 1, dim, dtype=dt, device=dev)}
            self._buffers[("ppd", k)] = got
        return got

    # ----- the static pieces ---------------------------------------------------------------
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
        b, t = positions.shape
        # fill is the caller's: the eager write's host-side update is a no-op here
        plan = WritePlan(end=slots, start=-1, length=t, index=positions,
                         new_fill=torch.zeros(b, dtype=torch.long))
        reach = torch.arange(slots, device=positions.device)
        mask = reach[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, T, S)
        ctx = StepContext(positions, rope, plan, mask)
        return model.run_layers(h, start, end, cache=cache, ctx=ctx)

    def reset(self) -> None:
        """Drop every captured graph (and the memory pool they shared: a pool whose graphs
        are all gone is released, and its handle cannot be used again)."""
        self._programs.clear()
        self._pool = None

    def _run(self, key: tuple[object, ...], cache: KVCache, inputs: dict[str, torch.Tensor],
             body: Body, keep: tuple[object, ...] = (), *, private: bool = False
             ) -> tuple[torch.Tensor, ...]:
        """Run ``body`` on ``inputs``: eagerly, or by replaying the graph captured for
        ``key`` and this cache's storage (captured on first use). Graphs share one memory
        pool, which is safe only for graphs that never run at the same time; one that runs
        beside others (a PPD branch on its own stream) takes a ``private`` pool."""
        if not self.capture:
            return body(inputs)
        ident = _cache_identity(cache)
        if ident != self._cache_id:  # the pool was reallocated: its graphs point at old memory
            self.reset()
            self._cache_id = ident
        full = (*key, cache.batch_size)
        prog = self._programs.get(full)
        if prog is None:
            prog = self._capture(inputs, body, (cache.keys, cache.values, *keep), private)
            self._programs[full] = prog
        else:
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
    """The storage a cache's graphs write: its first slot's address and layout (a pool view
    of fewer rows shares it; a reallocated pool does not)."""
    k = cache.keys[0]
    return (k.data_ptr(), k.untyped_storage().nbytes(), k.stride(), cache.max_seq_len,
            len(cache.keys))


def _weights(model: nn.Module) -> tuple[int, torch.dtype]:
    """Where the model's weights live (its embedding's address and dtype): a moved or cast
    model has other storage, which graphs captured before do not read."""
    ref = model.embed_tokens.weight  # type: ignore[union-attr]
    return ref.data_ptr(), ref.dtype


def _grow_fill(cache: KVCache, start: int, end: int, upto: torch.Tensor) -> None:
    """``fill`` of slots ``[start, end)`` at least ``upto`` ``(B,)`` (what the eager cache
    writes record)."""
    fill = cache.fill[start:end]
    torch.maximum(fill, upto[None, :], out=fill)


def static_steps(model: nn.Module) -> StaticSteps | None:
    """The model's static programs when decoders should use them (``None``: eager)."""
    steps = model.__dict__.get("_static_steps")
    if steps is None or not steps.enabled:
        return None
    if _weights(model) != steps.weights:  # moved or cast since: the graphs read the old
        return None
    return steps


def use_static_steps(model: EarlyExitLM, *, capture: bool | None = None) -> StaticSteps:
    """Give ``model`` static decoding programs (captured as CUDA graphs on a CUDA model unless
    ``capture`` is false); decoders use them from the next step on. Returns them."""
    ref = model.embed_tokens.weight
    if capture is None:
        capture = ref.device.type == "cuda"
    steps = model.__dict__.get("_static_steps")
    if steps is not None and steps.weights == _weights(model) and steps.capture == capture:
        return steps  # prepared again (more options): the graphs still serve
    steps = StaticSteps(model, capture=capture)
    model._static_steps = steps  # type: ignore[assignment]
    return steps


def set_cuda_graphs(model: nn.Module, enabled: bool) -> None:
    """Turn a prepared CUDA model's graphs on or off (benchmarks compare both)."""
    steps = model.__dict__.get("_static_steps")
    if steps is not None:
        steps.enabled = enabled
