"""The CPU runner on exitlm's native kernels: :class:`NativeRunner`.

A small model's decoding step on CPU is bound as much by Python and op dispatch as by the
weight products: through torch, each of a layer's ~15 small operations is a dispatch from
caches the previous multi-megabyte product flushed (~0.6 ms per layer of the embedded 30-layer
model, as much as the products). ``block.c`` computes a whole Llama-family block of one
sequence in one call (:class:`~exitlm.kernels.native_block.NativeBlock`), a run of blocks in one
call, and two primitives whole:

* :meth:`NativeRunner.chain` - embedding, layers and a greedy head per step, ``n`` steps, in
  one ``exitlm_chain`` call (a plain step, self-drafting, a PPD branch);
* :meth:`NativeRunner.segments` - one position's segments between exits over its pending
  positions, probed at every exit, in one ``exitlm_segments`` call.

Each takes one sequence (batch 1), rotary positions, float32 or float16 streams and heads
through the shared final norm and LM head; anything else - batches, sampling picks, heads of
their own, learned positions, hooks on the modules a call would skip - takes the eager
runner's code (:class:`~exitlm.runtime.runner.Runner`), with this runner's products
(:class:`~exitlm.runtime.products.Products`). Every row's arithmetic in ``block.c`` is fixed
whatever the number of rows, so a step and a verification of the same positions give the same
bits.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from exitlm.kernels import native
from exitlm.kernels.argmax import argmax
from exitlm.kernels.blas import BLAS, PLAIN_TENSORS
from exitlm.kernels.native_block import (
    Intact,
    LayerRun,
    NativeBlock,
    Scratch,
    build_native_block,
    chain,
    run_chain,
    segments,
    weight_struct,
)
from exitlm.kernels.quant import GROUP, ROW_THRESHOLD, QuantizedWeight
from exitlm.kernels.screen import (
    BUILD_TOKENS,
    GreedyScreen,
    QuantizedScreen,
    screen_for,
    screens_enabled,
    screens_head,
)
from exitlm.kernels.screen import MIN_ROWS as MIN_SCREEN_ROWS
from exitlm.model.kv_cache import KVCache
from exitlm.model.layers import Block, Linear, Norm
from exitlm.model.transformer import EarlyExitLM, StepContext
from exitlm.runtime.products import Products, head_modules
from exitlm.runtime.runner import Chain, Pick, Runner, Segments, commit_fill

NATIVE_ROWS = ROW_THRESHOLD - 1
"""The most positions of one sequence the native blocks run: every chunk the products compute
row-invariantly (fewer than :data:`~exitlm.kernels.quant.ROW_THRESHOLD` rows), so that
verification of up to 64 drafts and long KV recomputations round exactly like plain steps,
int8 activations included (:func:`~exitlm.kernels.native.int8_activations`)."""
NATIVE_PREFILL = {0: 16, 1: 24, 2: ROW_THRESHOLD, 3: ROW_THRESHOLD, 4: ROW_THRESHOLD,
                  5: ROW_THRESHOLD}
"""Prompts of fewer rows than this (prompts x padded length; by the blocks' weight format:
fp32, fp16, int8, int4; 4, 5: int4 in 16-row blocks) are prefilled through the native blocks in
one call
(:meth:`NativeRunner._prefill_walk`), longer ones through torch, whose GEMMs read each weight
once for all rows (one long prompt of quantized blocks: :data:`NATIVE_CHUNKED_PREFILL`).
Measured on a 2-core Sapphire Rapids VM, one thread, prefill time through the blocks against
torch: SmolLM2-135M fp32 4-8 positions 2.0x faster, 16 1.15x, 32 0.80x; fp16 1.5x, 1.24x,
0.94x; int8 1.7-2.4x at 4-95 positions; a 24-layer dim-256 model fp32 / fp16 2.4-2.9x at
4-16, 1.3x at 32, 0.95-1.05x at 48."""
NATIVE_CHUNKED_PREFILL = 640
"""One prompt of quantized blocks shorter than this, and too long for one call, is prefilled
through the blocks in chunks of :data:`NATIVE_ROWS` (:meth:`NativeRunner._chunked_walk`):
SmolLM2-135M, one thread, against torch's dequantize-and-GEMM: int8 120 positions 2.4x
faster, 250 1.6x, 400 1.3x, 800 0.99x, 1500 0.78x (the attention over the cache grows with
the position); int4 3.3x, 1.8x, 1.8x at 120-400."""
NATIVE_HEAD_ROWS = 64
"""The most rows of an output-embedding product the native kernels take (decoding steps,
verification, batches); longer ones (logits over whole sequences) take the products."""

_NATIVE_HEADS = {torch.float32: native.gemm_f32, torch.float16: native.gemm_f16}
_SCREENS: dict[int, tuple[weakref.ref[torch.Tensor], GreedyScreen | QuantizedScreen]] = {}
"""Each output embedding's screen (:meth:`NativeRunner.greedy`) by the ``id`` of its tensor (a
quantized weight's ``q``: its module builds a new ``QuantizedWeight`` per access), for as long as
that tensor lives: runners come and go with ``generate`` calls, the int8 copy takes ~0.1 s to
make. (Tensors compare elementwise, so they cannot be weak dictionary keys.)"""


def _screen_of(weight: torch.Tensor | QuantizedWeight, make: bool = True
               ) -> GreedyScreen | QuantizedScreen | None:
    """``weight``'s screen (:class:`QuantizedScreen` for a quantized weight), made (again, when
    ``make``) when it has none or was changed since."""
    anchor = weight.q if isinstance(weight, QuantizedWeight) else weight
    got = _SCREENS.get(id(anchor))
    if got is not None and got[0]() is anchor and got[1].current(weight):  # type: ignore[arg-type]
        return got[1]
    if not make:
        return None
    screen = screen_for(weight)
    if got is None or got[0]() is not anchor:
        weakref.finalize(anchor, _SCREENS.pop, id(anchor), None)
    _SCREENS[id(anchor)] = (weakref.ref(anchor), screen)
    return screen


def _deref(ref: weakref.ref) -> Any:
    return ref()


def _advance(cache: KVCache, start: int, end: int, ends: int | torch.Tensor) -> None:
    """Layers ``[start, end)`` now hold positions up to ``ends`` (one sequence) or
    ``ends[b]`` (row ``b`` of a batch) of ``cache``."""
    fill = cache.fill[start:end]
    if isinstance(ends, int):
        fill.clamp_(min=ends)
    else:
        torch.maximum(fill, ends[None, :], out=fill)


def _threads() -> int:
    return BLAS.threads_override or 1


class NativeRunner(Runner):
    """The runner of a CPU model on the native library ``lib`` (module docstring)."""

    kind = "native"

    def __init__(self, model: EarlyExitLM, lib: ctypes.CDLL, *, pack_rows: bool = False
                 ) -> None:
        # the native kernels read block and head weights by rows
        in_blocks = frozenset(id(m) for b in model.modules() if type(b) is Block
                              for m in b.modules())
        heads = frozenset(id(m) for m in head_modules(model))
        super().__init__(model, Products(model, pack_rows=pack_rows,
                                         row_major=in_blocks | heads))
        self.lib = lib
        self.scratch = Scratch()
        self.blocks: list[NativeBlock | None] = [
            build_native_block(lib, layer, self.scratch) if type(layer) is Block else None
            for layer in model.layers]
        self._runs: dict[tuple[int, int], tuple[LayerRun, list[Any], list[int], Intact]] = {}

    def enable_row_products(self, sequences: int = 1) -> None:
        """Packed copies only where eager products of several rows will run: outside the
        native blocks and heads (exit heads' own layers, layers without a native block). The
        blocks take one sequence's verification and recomputation chunks and the steps of
        batches, the native heads their output products, reading the weights as they are
        (packed copies of theirs would double the weight memory - 540 MB for SmolLM2 in fp32 -
        and take ~0.7 s at every engine's start, for the eager prefills of batches only)."""
        if self.products is None or (sequences <= 1 and all(self.blocks)):
            return
        inside = {id(m.weight) for nb in self.blocks if nb is not None
                  for m in nb.module.modules() if type(m) is Linear}
        # fp32 / fp16 output embeddings: read by the native heads (up to NATIVE_HEAD_ROWS
        # rows; the packed copies serve 2-32)
        heads = {id(w) for m in head_modules(self.model)
                 if isinstance(w := getattr(m, "weight", None), torch.Tensor)
                 and w.dtype in _NATIVE_HEADS}
        self.products.enable_rows(unpacked=frozenset(inside | heads))

    # ----- layers ------------------------------------------------------------------------------
    def layers(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor | None,
               cache: KVCache | None, ctx: StepContext | None = None) -> torch.Tensor:
        """Runs of consecutive native blocks in one call each (the other layers through the
        eager code): one sequence of 1..:data:`NATIVE_ROWS` consecutive positions, or a batch
        whose row ``b`` holds consecutive positions of cache row ``b`` (decoding steps and
        verification of several sequences, :data:`NATIVE_ROWS` rows in all: each row gets the
        bits of its sequence decoded alone); other inputs take the eager runner's."""
        call = None if end <= start else self._native_call(h, start, end, positions, cache)
        if call is None:
            return super().layers(h, start, end, positions, cache, ctx)
        assert cache is not None and positions is not None
        x, rope, p0, rows, ends = call
        run = self._intact_run(start, end, cache)
        if run is not None:  # the common case: nothing changed since the last step
            x = run_chain(run, x, rope, p0, _threads(), rows)
            _advance(cache, start, end, ends)
            return x.reshape(h.shape)
        i = start
        while i < end:
            j = i
            while j < end and self._serves(j, cache):
                j += 1
            if j > i:  # layers [i, j) in one call
                x = run_chain(self._layer_run(i, j, cache), x, rope, p0, _threads(), rows)
                _advance(cache, i, j, ends)
                i = j
            else:  # a layer the native block does not serve: the eager code, with its context
                if ctx is None:
                    ctx = self.context(positions, cache)
                x = self.model.run_layers(x.reshape(h.shape), i, i + 1, cache=cache,
                                          ctx=ctx).reshape(x.shape)
                i += 1
        return x.reshape(h.shape)

    def _native_call(self, h: torch.Tensor, start: int, end: int,
                     positions: torch.Tensor | None, cache: KVCache | None
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], int,
                                tuple[torch.Tensor, torch.Tensor] | None,
                                int | torch.Tensor] | None:
        """``(x, rope, p0, rows, ends)`` of a native call of layers ``[start, end)`` for
        ``h`` ``(B, T, D)`` - the stream as one sequence of rows ``(1, B * T, D)``, each
        row's rotary tables, the first position, :func:`run_chain`'s ``rows`` for a batch
        (else None) and the fill after the call (per cache row for a batch) - or None when
        the native blocks cannot take it (see :meth:`layers`)."""
        b, t = h.shape[0], h.shape[1]
        if (cache is None or positions is None or cache.batch_size != b
                or not 1 <= b * t <= NATIVE_ROWS or positions.shape != (b, t)
                or (h.dtype is not torch.float32 and h.dtype is not torch.float16)
                or not h.is_cpu or torch.is_grad_enabled() or h.requires_grad
                or self.model.rope_inv_freq is None):
            return None
        if b == 1:
            p0 = int(positions[0, 0])
            if p0 < 0 or p0 + t > cache.max_seq_len:
                return None  # the eager code raises the cache's own error
            if t > 1 and not torch.equal(positions[0], torch.arange(p0, p0 + t)):
                return None
            tables = self._tables(p0 + t - 1)
            if tables is None:
                return None
            return h, (tables[0][p0 : p0 + t], tables[1][p0 : p0 + t]), p0, None, p0 + t
        pos = positions.to(device="cpu", dtype=torch.int64)
        first = pos[:, :1]
        if t > 1 and not torch.equal(pos, first + torch.arange(t)):
            return None
        last = int(pos[:, -1].max())
        if int(first.min()) < 0 or last >= cache.max_seq_len:
            return None
        # every layer's keys and values rows the same distance apart (a spliced cache may mix)
        strides = {u.stride(0) for u in (*cache.keys[start:end], *cache.values[start:end])}
        tables = self._tables(last)
        if len(strides) != 1 or tables is None:
            return None
        flat = pos.reshape(-1).contiguous()
        offsets = (torch.arange(b, dtype=torch.int64) * strides.pop()).repeat_interleave(t)
        return (h.reshape(1, b * t, h.shape[-1]), (tables[0][flat], tables[1][flat]), 0,
                (flat, offsets), pos[:, -1] + 1)

    def _prefill_walk(self, h: torch.Tensor, end: int, exits: Sequence[int],
                      positions: torch.Tensor, cache: KVCache
                      ) -> Iterator[tuple[int, torch.Tensor, StepContext]]:
        """Short prompts (fewer rows, prompts x padded length, than :data:`NATIVE_PREFILL`
        gives for the blocks' weights) through :meth:`layers`, whose runs of native blocks
        take them in one call - each prompt's positions with the bits it gets alone (the
        padding's rows are computed too and dropped); one longer prompt of quantized blocks in
        chunks (:meth:`_chunked_walk`) while it ends before :data:`NATIVE_CHUNKED_PREFILL`
        (a part of a prompt prefilled in parts counts the positions before it: the blocks'
        attention reads them all); other prompts: the eager code."""
        formats = {nb.structs[0].fmt for nb in self.blocks if nb is not None}
        rows = min((NATIVE_PREFILL.get(f, 0) for f in formats), default=0)
        if cache.batch_size == h.shape[0] and h.shape[0] * h.shape[1] < rows:
            return self.walk(h, 0, end, exits, positions, cache)
        if (h.shape[0] == cache.batch_size == 1 and rows > NATIVE_ROWS
                and int(positions[0, -1]) + 1 < NATIVE_CHUNKED_PREFILL):  # the prompt so far
            return self._chunked_walk(h, end, exits, positions, cache)
        return super()._prefill_walk(h, end, exits, positions, cache)

    def _chunked_walk(self, h: torch.Tensor, end: int, exits: Sequence[int],
                      positions: torch.Tensor, cache: KVCache
                      ) -> Iterator[tuple[int, torch.Tensor, StepContext]]:
        """One long prompt of quantized blocks (which beat torch's dequantize-and-GEMM at
        every row count they take) in chunks of :data:`NATIVE_ROWS` positions, each attending
        to the chunks before it in the cache: the states at every stop, concatenated."""
        stops = sorted({s for s in exits if 0 < s <= end} | {end})
        got: dict[int, list[torch.Tensor]] = {s: [] for s in stops}
        for c in range(0, h.shape[1], NATIVE_ROWS):
            part = slice(c, c + NATIVE_ROWS)
            for stop, h_at, _ in self.walk(h[:, part], 0, end, exits, positions[:, part], cache):
                got[stop].append(h_at)
        ctx = self.context(positions, cache)
        for stop in stops:
            yield stop, torch.cat(got[stop], 1), ctx

    def _serves(self, layer: int, cache: KVCache) -> bool:
        nb = self.blocks[layer]
        if nb is None:
            return False
        # the module dict directly: ModuleList.__getitem__ costs more than the checks below
        block = self.model.layers._modules.get(str(layer))
        if block is None or block._forward_hooks or block._forward_pre_hooks:
            return False
        if not nb.serves(block, cache, layer):
            if not nb.moved(block):
                return False
            # another layer module, or weights moved to other storage (shared memory): a new
            # call for them
            nb = self.blocks[layer] = build_native_block(self.lib, block, self.scratch)
            return nb is not None and nb.serves(block, cache, layer)
        return True

    def _chain_blocks(self, end: int, cache: KVCache) -> LayerRun | None:
        """The native calls of layers ``[0, end)`` on ``cache``, or None unless every one
        serves it."""
        run = self._intact_run(0, end, cache)
        if run is not None:
            return run
        if not all(self._serves(i, cache) for i in range(end)):
            return None
        return self._layer_run(0, end, cache)

    def _intact_run(self, a: int, b: int, cache: KVCache) -> LayerRun | None:
        """The run made before for layers ``[a, b)`` (:meth:`_layer_run`) if it still holds:
        the same cache tensors at the same addresses, the same native blocks, and its blocks'
        :class:`Intact` checks pass - one check for the whole run instead of :meth:`_serves`
        layer by layer (~200 us a step on a 24-layer model). Else None: the caller checks
        layer by layer (which rebuilds what moved)."""
        got = self._runs.get((a, b))
        if got is None:
            return None
        run, refs, ptrs, intact = got
        tensors = [*cache.keys[a:b], *cache.values[a:b]]
        if not (all(map(operator.is_, map(_deref, refs), tensors))
                and list(map(torch.Tensor.data_ptr, tensors)) == ptrs
                and all(map(operator.is_, run.blocks, self.blocks[a:b])) and intact()):
            return None
        return run

    def _layer_run(self, a: int, b: int, cache: KVCache) -> LayerRun:
        """Layers ``[a, b)`` (each served) writing ``cache``'s row 0: the one made for them
        before while the same blocks write the same cache tensors at the same addresses
        (a decoding step would otherwise rebuild ~50 structs and tensor views)."""
        run = self._intact_run(a, b, cache)
        if run is not None:
            return run
        tensors = [*cache.keys[a:b], *cache.values[a:b]]
        blocks = self.blocks[a:b]
        run = LayerRun(blocks,  # type: ignore[arg-type]
                       [(k[0], v[0]) for k, v in zip(cache.keys[a:b], cache.values[a:b],
                                                     strict=True)])
        # what _serves checked besides each block's own Intact: the layer modules themselves
        layers = self.model.layers._modules
        intact = Intact(children=((layers, str(i), layers.get(str(i))) for i in range(a, b)),
                        hooked=(layers[str(i)] for i in range(a, b)))
        for nb in blocks:
            intact = intact + nb.intact  # type: ignore[union-attr]
        if len(self._runs) >= 32:  # ranges and caches come and go
            self._runs.clear()
        self._runs[(a, b)] = (run, [weakref.ref(t) for t in tensors],
                              [t.data_ptr() for t in tensors], intact)
        return run

    def _tables(self, last: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The float32 rotary tables ``(N, 1, hd)`` covering position ``last``."""
        cos, ssin = self.model._rope_table(torch.tensor(last), torch.float32)
        if not (cos.is_contiguous() and ssin.is_contiguous()):
            return None
        return cos, ssin

    # ----- heads -------------------------------------------------------------------------------
    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Output products through exitlm's kernels: fp32/fp16 embeddings read row after row
        (SmolLM2's tied 49152 x 576: fp32 ~39 GB/s against ~34 for OpenBLAS' GEMV, fp16 ~40
        against ~24 for torch's), every row the same bits whatever the number of rows;
        quantized ones through theirs, with int8 activations when the native blocks take them
        (:func:`~exitlm.kernels.native.int8_activations`: every head of this runner rounds as
        ``block.c``'s draft chains and segments do, and plain steps as verification rows);
        longer products through the packed kernels."""
        if self.model.output_layout is not None:
            return self.model.output_layout.project(h, weight)
        if isinstance(weight, QuantizedWeight):
            return weight.linear(h, _threads(), int8_activations=native.int8_activations())
        if (weight.dtype in _NATIVE_HEADS and h.dtype is weight.dtype and h.is_cpu
                and weight.is_cpu and weight.is_contiguous() and not torch.is_grad_enabled()
                and h.numel() <= NATIVE_HEAD_ROWS * h.shape[-1]):
            flat = h.reshape(-1, h.shape[-1]).float()
            out = _NATIVE_HEADS[weight.dtype](flat, weight.detach(), _threads())
            return out.to(h.dtype).reshape(*h.shape[:-1], weight.shape[0])
        return super().project(h, weight)

    def supports(self, feature: str) -> bool:
        """As the eager runner's; ``argmax`` while greedy screens are on (:meth:`greedy`)."""
        if feature == "argmax":
            return screens_enabled()
        return super().supports(feature)

    def greedy(self, h: torch.Tensor, layer: int, *, positions: torch.Tensor | None = None,
               cache: KVCache | None = None, ahead: int = 0) -> list[int]:
        """The exit's argmax tokens through a :class:`~exitlm.kernels.screen.GreedyScreen` of
        its fp32 or fp16 output embedding (an int8 copy and an error bound: the same tokens as the
        argmax of :meth:`logits`, a quarter of the head's bytes read) or a
        :class:`~exitlm.kernels.screen.QuantizedScreen` of an int4 one while int8 activations
        are off (its integer product with int8 activations and an error bound; with them on,
        that integer product is the head's own and its argmax is taken directly); other heads,
        and rows the screens cannot decide, through the logits."""
        model = self.model
        if (not screens_enabled() or model.output_layout is not None or not h.is_cpu
                or torch.is_grad_enabled() or h.shape[0] > NATIVE_HEAD_ROWS):
            return super().greedy(h, layer, positions=positions, cache=cache, ahead=ahead)
        feats, weight = model.exit_features(h[:, -1:], layer, positions, cache, None,
                                            ops=self.products)
        plain = (type(weight) in PLAIN_TENSORS and screens_head(weight)
                 and feats.dtype is weight.dtype and weight.is_cpu and weight.is_contiguous()
                 and weight.shape[0] >= MIN_SCREEN_ROWS and weight.shape[1] % GROUP == 0)
        quantized = (isinstance(weight, QuantizedWeight) and not native.int8_activations()
                     and screens_head(weight)
                     and feats.dtype is torch.float32 and weight.q.is_cpu
                     and weight.shape[0] >= MIN_SCREEN_ROWS)
        screen = _screen_of(weight, make=ahead >= BUILD_TOKENS) if plain or quantized else None
        if screen is not None:
            flat = feats.reshape(-1, feats.shape[-1]).float().contiguous()
            tokens = screen.argmax(flat, weight if isinstance(weight, QuantizedWeight)
                                   else weight.detach(), _threads())
            if tokens is not None:
                return tokens
        return argmax(self.project(feats, weight)[:, -1]).tolist()

    def _shared_head(self, vocab: int
                     ) -> tuple[torch.Tensor, float, tuple[Any, tuple[torch.Tensor, ...]]] | None:
        """The final RMSNorm's weight in fp32 and eps, and the native description of the
        first ``vocab`` rows of the output embedding; None for what the native calls do not
        take (another norm, hooks on it, a bf16 head, a sharded head). A float16 model's head
        computes its norm and logits in fp32 from the fp16 state: its drafts' tokens are the
        eager chain's (which rounds both to fp16) except where two logits tie in fp16."""
        model = self.model
        norm = model.norm
        if (type(norm) is not Norm or norm.kind != "rmsnorm" or norm._forward_hooks
                or norm._forward_pre_hooks or model.output_layout is not None):
            return None
        w_norm = norm._parameters["weight"]
        if (w_norm is None or w_norm.dtype not in (torch.float32, torch.float16)
                or not w_norm.is_cpu):
            return None
        if w_norm.dtype is torch.float16:
            w_norm = w_norm.detach().float()
        weight = model.output_embedding()
        if isinstance(weight, QuantizedWeight):
            weight.kernel_packed()  # (made once: its slices below are views of it)
        # a ranked draft vocabulary gathers its rows; the first ids are a view of them
        ranked = model.draft_ids(vocab) is not None
        head = weight_struct(self._head_rows(weight, vocab) if ranked else weight[:vocab])
        if head is None:
            return None
        return w_norm, norm.eps, head

    def _native_steps(self, exits: Sequence[int], cache: KVCache, positions: int) -> bool:
        """Whether the native chain and segment calls take these exits and this cache: rotary
        positions, every exit through the final norm and LM head (no head of its own), one
        sequence with room for ``positions``, no gradient."""
        model = self.model
        if torch.is_grad_enabled() or model.rope_inv_freq is None:
            return False
        if model.embed_positions is not None:
            return False
        if any(model.exit_route(e).head is not None for e in exits):
            return False
        return cache.batch_size == 1 and positions <= cache.max_seq_len

    # ----- chains ------------------------------------------------------------------------------
    def chain(self, tokens: torch.Tensor, cache: KVCache, n: int, depth: int, *,
              vocab: int | None = None, logits: bool = False, pick: Pick | None = None,
              stop_below: float | None = None) -> Chain:
        """One greedy sequence's chain in one native call (``exitlm_chain``); the last step's
        logits, when asked for, through :meth:`logits`. The tokens are those of the eager
        chain except where two logits tie within the last bits (the call's norm sums in
        another order; so may a confidence compared with ``stop_below``); the hidden states
        are the same bits."""
        got = None
        if tokens.shape[0] == 1 and pick is None:
            got = self._native_chain(int(tokens[0]), cache, n, depth, vocab, stop_below)
        if got is None:
            return super().chain(tokens, cache, n, depth, vocab=vocab, logits=logits, pick=pick,
                                 stop_below=stop_below)
        steps, hidden = got
        n = steps.shape[0]
        hidden = hidden[None]
        if hidden.dtype != self.dtype:
            hidden = hidden.to(self.dtype)
        last = None
        if logits:  # (an exit block, never in a call with drafts, writes its slot here)
            pos = (cache.lengths[:1] + n)[:, None]
            last = self.logits(hidden[:, -1:], depth, positions=pos, cache=cache)[:, 0]
        return Chain(steps[None], hidden, last)

    def _native_chain(self, token: int, cache: KVCache, n: int, depth: int,
                      vocab: int | None, stop_below: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        model = self.model
        start = int(cache.lengths[0])
        if n < 0 or not self._native_steps((depth,) if n else (), cache, start + n + 1):
            return None
        head = None
        w_norm, eps = None, 0.0
        if n:
            shared = self._shared_head(vocab or model.config.vocab_size)
            if shared is None:
                return None
            w_norm, eps, head = shared
        embed = weight_struct(model.embed_tokens.weight, lookup=True)
        if embed is None or (embed[0].fmt == 1) != (self.dtype is torch.float16):
            return None  # (the call rounds its stream to float16 after a float16 embedding)
        if model.embed_tokens._forward_hooks or model.embed_tokens._forward_pre_hooks:
            return None
        run = self._chain_blocks(depth, cache)
        tables = self._tables(start + n)
        if run is None or tables is None:
            return None
        ids = model.draft_ids(vocab) if n else None
        if ids is not None and ids.dtype != torch.int64:
            return None
        out = chain(run, token, n, tables, start, embed,  # type: ignore[arg-type]
                    w_norm, eps, head, _threads(),
                    None if ids is None else ids.contiguous(), stop_below if n else None)
        fill = cache.fill[:depth]
        fill.clamp_(min=start + out[0].shape[0] + 1)
        return out

    # ----- segments ----------------------------------------------------------------------------
    def segments(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                 bounds: Sequence[int], thresholds: Sequence[float | None]) -> Segments:
        """One sequence's segments in one native call (``exitlm_segments``), where it takes
        them: float32 states, exits through the shared head, at most :data:`NATIVE_ROWS`
        positions per segment. Keys/values and states get the bits of the eager segments; the
        confidence is summed in another order than torch's softmax, so an exit decision can
        differ only where a confidence lies within rounding of its threshold."""
        got = self._native_segments(tokens, hidden, cache, list(bounds), thresholds)
        if got is None:
            return super().segments(tokens, hidden, cache, bounds, thresholds)
        return got

    def _native_segments(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                         bounds: list[int], thresholds: Sequence[float | None]
                         ) -> Segments | None:
        model = self.model
        if tokens.shape[0] != 1 or hidden.dtype is not torch.float32:
            return None
        q = int(cache.lengths[0])
        row = hidden[0]
        if not (row.is_contiguous() and row.shape[0] > q and not row.requires_grad):
            return None
        starts = [int(cache.fill[a, 0]) for a in bounds[:-1]]
        if q - min(starts) + 1 > NATIVE_ROWS:  # as many rows as the native layers take
            return None
        if not self._native_steps(bounds[1:-1], cache, q + 1):
            return None
        shared = self._shared_head(model.config.vocab_size)
        run = self._chain_blocks(model.num_layers, cache)
        tables = self._tables(q)
        if shared is None or run is None or tables is None:
            return None
        fill_old = cache.fill.clone()
        row[q] = self.embed(tokens[:, None], torch.tensor([[q]]))[0, 0]
        w_norm, eps, head = shared
        ran, stopped, exit_logits = segments(
            run, row, q, starts, bounds, thresholds[0], tables, w_norm, eps,
            head, _threads())  # type: ignore[arg-type]
        evals = recomputed = 0
        for a, e, s in zip(bounds[:ran], bounds[1 : ran + 1], starts, strict=False):
            m = q - s + 1
            evals += (e - a) * m
            recomputed += (e - a) * (m - 1)
        if stopped:
            exit_at, out = stopped, exit_logits
        else:
            exit_at, out = model.num_layers, self.logits(row[q][None], model.num_layers)[0]
        assert out is not None
        commit_fill(cache, fill_old, torch.tensor([q]), [exit_at], {})
        return Segments([exit_at], out[None], [evals], [recomputed])
