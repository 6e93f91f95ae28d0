"""The lean per-layer decoding step for the stock Llama-family block: :class:`LeanBlock`,
and runs of such blocks in one native call: :class:`LeanLM`.

With the native library (:mod:`exitlm.backend.native`) the whole block runs in one call of
``block.c`` (:mod:`exitlm.backend.native_block`) for fp32, fp16-stored, int8 and int4
weights; the torch step below is the fallback for fp32 weights without it.

Each GEMV of a decoding step streams megabytes of weights and flushes the caches, so every
small op after it runs cold: the non-GEMV part of a batch-1 fp32 step was ~14 ms of ~45 ms
at 1 thread with the general modules, ~10 ms with this step (README "Performance"). It calls
no sub-modules, spells RMSNorm out bit-identically with half the dispatches and sends its
products straight to numpy's OpenBLAS; the same step runs the 2-16-token chunks of one
sequence (self-speculative verification, KV recomputation), with their mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from exitlm.backend.blas import BLAS, PLAIN_TENSORS
from exitlm.backend.linear import FastLinear, linear
from exitlm.backend.native_block import (
    NativeBlock,
    build_native_block,
    draft_greedy,
    early_exit_step,
    run_chain,
    weight_struct,
)
from exitlm.backend.quant import ROW_THRESHOLD
from exitlm.model.kv_cache import KVCache, WritePlan
from exitlm.model.layers import MLP, Attention, Block, Norm, apply_rope
from exitlm.model.transformer import EarlyExitLM, StepContext

LEAN_ROWS = 16
"""The most tokens of one sequence that :meth:`LeanBlock.decode_step` runs (verification of
up to 15 drafts); longer chunks (prefills) take the general path."""
NATIVE_ROWS = ROW_THRESHOLD - 1
"""The most tokens of one sequence the native block runs: every chunk the products would
compute row-invariantly (fewer than :data:`~exitlm.backend.quant.ROW_THRESHOLD` rows), so
that verification of up to 64 drafts and long KV recomputations round exactly like plain
steps, int8 activations included (:func:`~exitlm.backend.native.int8_activations`)."""


def native_step(h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None, plan: WritePlan | None, mask: torch.Tensor | None
                ) -> bool:
    """Whether a forward of ``h`` can take the native blocks: one sequence, a cache write
    without row index, 1 row without mask or 2..:data:`NATIVE_ROWS` with one (always causal
    over the cache slots: EarlyExitLM.context), an fp32 or fp16 stream on the CPU, no
    gradient. (The torch lean step has the same conditions with up to :data:`LEAN_ROWS`
    fp32 rows.)"""
    return (
        plan is not None and cache is not None and rope is not None and plan.index is None
        and h.shape[0] == 1 and h.shape[1] <= NATIVE_ROWS
        and (mask is None) == (h.shape[1] == 1)
        and (h.dtype is torch.float32 or h.dtype is torch.float16) and h.is_cpu
        and not torch.is_grad_enabled() and not h.requires_grad
    )


def lean_capable(block: Block) -> bool:
    """Whether :class:`LeanBlock`'s step computes exactly what ``block``'s sub-modules would:
    the stock Llama-family modules (RMSNorm, rotary attention, SwiGLU, no biases) with
    :class:`~exitlm.backend.linear.FastLinear` layers holding plain fp32 CPU weights, and
    numpy's OpenBLAS found."""
    mods = block._modules
    attn, mlp, n1, n2 = mods["attn"], mods["mlp"], mods["norm_attn"], mods["norm_mlp"]
    if (
        not BLAS.enabled
        or type(attn) is not Attention or type(mlp) is not MLP
        or type(n1) is not Norm or type(n2) is not Norm
        or n1.kind != "rmsnorm" or n2.kind != "rmsnorm"
        or not mlp.gated or mlp.act is not F.silu or not attn.use_rope
    ):
        return False
    lins = (attn.wqkv, attn.wo, mlp.w_in, mlp.w_out)
    return all(
        type(lin) is FastLinear and lin.bias is None and type(lin.weight) in PLAIN_TENSORS
        and lin.weight.dtype is torch.float32 and lin.weight.is_cpu
        for lin in lins
    )


def _rms_norm_fp32(h: torch.Tensor, norm: Norm) -> torch.Tensor:
    """``F.rms_norm`` of fp32 ``h`` with ``norm``'s weight, spelled out: the same operations
    in the same order as ATen's composite kernel (bit-identical results), with half of its
    dispatches, which shows when a decoding step runs it from cold caches."""
    var = torch.mean(h * h, -1, keepdim=True)
    return h * torch.rsqrt(var + norm.eps) * norm._parameters["weight"]


class LeanBlock(Block):
    """A :class:`~exitlm.model.layers.Block` that decodes one sequence's next token(s)
    through :meth:`decode_step`; everything else (batches, prefills, training, hooks on its
    sub-modules) goes through the block's general code.

    :func:`~exitlm.backend.cpu.prepare_for_decoding` gives blocks this class in place (their
    ``__class__``: same module, same children and parameters) when :func:`lean_capable`
    says so. Hooks registered on the block itself run as before; a block whose attention,
    MLP, norms or linear layers carry forward hooks takes the general path, so those run too.
    Hooks registered globally (``torch.nn.modules.module.register_module_forward_hook``) do
    not see the sub-module calls the lean step leaves out: prepare_for_decoding is for
    inference.
    """

    native: NativeBlock | None = None
    """This block's native call (set by :func:`~exitlm.backend.cpu.prepare_for_decoding`)."""

    def __getstate__(self) -> dict[str, object]:
        # copies point at their own weights: they get a native call when prepared again
        state = self.__dict__.copy()
        state.pop("native", None)
        return state

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        slot: int,
        plan: WritePlan | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # the native block (fp32/fp16), else the torch lean step (fp32, up to 16 rows)
        if native_step(h, rope, cache, plan, mask):
            assert cache is not None and plan is not None and rope is not None
            nb = self.native
            serves = nb is not None and nb.serves(self, cache, slot)
            if nb is not None and not serves and nb.moved():
                # weights moved to other storage (shared memory): point a new call at them
                nb = self.native = build_native_block(nb.lib, self, nb.scratch)
                serves = nb is not None and nb.serves(self, cache, slot)
            if serves:
                assert nb is not None
                out = nb(h, rope, cache.keys[slot][0], cache.values[slot][0], plan.start,
                         BLAS.threads_override or 1)
                fill = cache.fill[slot]
                torch.maximum(fill, plan.new_fill, out=fill)
                return out
            parts = (self._parts() if h.dtype is torch.float32 and h.shape[1] <= LEAN_ROWS
                     else None)
            if parts is not None:
                return self.decode_step(parts, h, rope, cache, slot, plan, mask)
        return super().forward(h, rope, cache, slot, plan, mask)

    def _parts(self) -> tuple | None:
        """The sub-modules :meth:`decode_step` uses, or None when one was replaced since
        :func:`lean_capable` (not a :class:`FastLinear` any more, a non-fp32 weight) or
        carries forward hooks. Reads the modules' dicts directly: this runs for every layer
        of every decoding step."""
        mods = self._modules
        attn, mlp, n1, n2 = mods["attn"], mods["mlp"], mods["norm_attn"], mods["norm_mlp"]
        am, mm = attn._modules, mlp._modules
        lins = (am["wqkv"], am["wo"], mm["w_in"], mm["w_out"])
        for m in (attn, mlp, n1, n2, *lins):
            if m._forward_hooks or m._forward_pre_hooks:
                return None
        for lin in lins:
            if type(lin) is not FastLinear or lin._parameters["weight"].dtype is not torch.float32:
                return None
        return (attn, mlp, n1, n2, *lins)

    def decode_step(
        self,
        parts: tuple,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        slot: int,
        plan: WritePlan,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence's next token(s) (fp32, CPU): the same operations as the sub-modules,
        with their products straight through numpy and none of their general-case code.

        One row is a decoding step (no mask: it attends to every filled slot); 2 to
        :data:`LEAN_ROWS` rows are a verification or KV-recomputation chunk (with its mask;
        products through :func:`~exitlm.backend.linear.linear` with each layer's packed copy,
        as the layers themselves would). Every layer of every step pays this code's cost,
        from caches that the previous multi-megabyte product just flushed, so fewer calls
        measurably matter (README "Performance")."""
        attn, mlp, n1, n2, l_qkv, l_o, l_in, l_out = parts
        nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        m = h.shape[1]
        if m == 1:
            vec = BLAS.vector

            def mm(x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
                return vec(x, lin._parameters["weight"])
        else:
            def mm(x: torch.Tensor, lin: FastLinear) -> torch.Tensor:
                return linear(x, lin._parameters["weight"], None, lin.pack)
        BLAS.sync_threads()
        x = _rms_norm_fp32(h, n1)
        qkv = mm(x, l_qkv).view(1, m, nh + 2 * nkv, d)
        qk = apply_rope(qkv[:, :, : nh + nkv], *rope)
        q = qk[:, :, :nh].transpose(1, 2)
        k, v = cache.write(
            slot, qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + nkv :].transpose(1, 2), plan
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
        if m > 1:  # (1, H, m, D) -> (1, m, H*D); one row's layout is that already
            out = out.transpose(1, 2).reshape(1, m, nh * d)
        h = h + mm(out, l_o).view(h.shape)
        x = _rms_norm_fp32(h, n2)
        y = mm(x, l_in)
        hidden = mlp.hidden
        return h + mm(F.silu(y[..., :hidden]) * y[..., hidden:], l_out).view(h.shape)


class LeanLM(EarlyExitLM):
    """An :class:`~exitlm.model.transformer.EarlyExitLM` whose :meth:`run_layers` hands a
    run of consecutive native blocks of one fp32 or fp16 sequence to one native call
    (:func:`~exitlm.backend.native_block.run_chain`) instead of calling the layers one by
    one: the per-layer Python of :class:`LeanBlock` (~15 us: module call, checks, argument
    marshalling) is as much as a small model's layer computes (the 8-layer, dim-128
    ``scratch-layerskip``: ~25 us per layer, ~10 us of it in C). The chain computes every
    layer with the function a single block call uses (an fp16 stream rounded to fp16 between
    layers, as the single calls return it), so the bits are the same.

    :func:`~exitlm.backend.cpu.prepare_for_decoding` gives a model this class in place (its
    ``__class__``). Anything the chain does not take - layer dropout, batches, more than
    :data:`NATIVE_ROWS` positions, other dtypes, a block with hooks of its own or without a
    native call that serves this cache - goes through the layers as before. Like the
    sub-module calls of a lean block, the block calls a chain leaves out are not seen by
    hooks registered globally (``register_module_forward_hook``).
    """

    def run_layers(self, h: torch.Tensor, start: int, end: int,
                   positions: torch.Tensor | None = None, cache: KVCache | None = None,
                   ctx: StepContext | None = None,
                   active: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        if (
            end - start > 1 and active is None and ctx is not None
            and start >= 0 and end <= self.config.num_layers
            and native_step(h, ctx.rope, cache, ctx.plan, ctx.mask)
        ):
            assert cache is not None and ctx.plan is not None and ctx.rope is not None
            chain = self._chain(start, end, cache)
            if chain is not None:
                out = run_chain(chain[0], h, ctx.rope, chain[1], ctx.plan.start,
                                BLAS.threads_override or 1)
                fill = cache.fill[start:end]  # (layers, 1): what each block's write records
                torch.maximum(fill, ctx.plan.new_fill, out=fill)
                return out
        return super().run_layers(h, start, end, positions, cache, ctx, active)

    def draft_greedy(self, token: int, n: int, exit_layer: int, cache: KVCache, start: int,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy self-drafting of one sequence in one native call (LayerSkip Sec. 4.3.1;
        :func:`~exitlm.backend.native_block.draft_greedy`): from ``token`` at position
        ``start``, ``n`` drafts through layers ``1..exit_layer``, the final norm and the first
        ``vocab`` rows of the output embedding (the shared LM head LayerSkip exits through),
        writing those layers' cache at ``start .. start + n``. Returns the drafts ``(n,)``
        and the exit queries ``(n + 1, D)``, or None when the call does not take this model
        or cache (then draft step by step): a float32 stream (fp32, int8 or int4 weights)
        with rotary positions, an exit without a head of its own, an RMSNorm final norm, a
        token embedding exitlm's kernels read, no hooks on the modules the call replaces,
        one sequence, no gradient.

        The drafts are what the step-by-step loop picks except where two logits tie within
        the last bits: the norm's sum runs in another order than torch's mean. The exit
        queries (the chain, the embedding) are the same bits."""
        if n < 0 or not self._native_exits((exit_layer,), cache, start + n + 1):
            return None
        shared = self._shared_head(vocab)
        if shared is None:
            return None
        w_norm, eps, head = shared
        return self._embed_and_chain(token, n, exit_layer, cache, start, w_norm, eps, head)

    def step_hidden(self, token: int, end: int, cache: KVCache, start: int
                    ) -> torch.Tensor | None:
        """One plain decoding step of one sequence up to layer ``end`` in one native call:
        ``token``'s embedding at position ``start`` through layers ``1..end`` (writing their
        cache), returned ``(1, 1, D)`` for the caller's exit or final head - the bits of
        ``run_layers(embed(token), 0, end)``, without its Python per call (context,
        embedding, chain). None where :meth:`draft_greedy`'s conditions (except those of the
        head) do not hold."""
        if not self._native_exits((), cache, start + 1):
            return None
        got = self._embed_and_chain(token, 0, end, cache, start, None, 0.0, None)
        return None if got is None else got[1][None]

    def _embed_and_chain(self, token: int, n: int, end: int, cache: KVCache, start: int,
                         w_norm: torch.Tensor | None, eps: float, head: Any
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`~exitlm.backend.native_block.draft_greedy` over layers ``[0, end)``, with
        the checks of the embedding, the chain and the rotary tables, and the cache's fill."""
        embed = weight_struct(self.embed_tokens.weight)
        if embed is None or embed[0].fmt == 1:
            return None  # float16 models keep a float16 stream
        if self.embed_tokens._forward_hooks or self.embed_tokens._forward_pre_hooks:
            return None
        chain = self._chain(0, end, cache)
        tables = self._tables(start + n)
        if chain is None or tables is None:
            return None
        out = draft_greedy(chain[0], chain[1], token, n, tables, start, embed, w_norm, eps, head,
                           BLAS.threads_override or 1)
        fill = cache.fill[:end]
        fill.clamp_(min=start + n + 1)
        return out

    def early_exit_step(self, hidden: torch.Tensor, q: int, starts: list[int],
                        bounds: list[int], threshold: float | None, cache: KVCache
                        ) -> tuple[int, int, int] | None:
        """One step of confidence early exit with KV recomputation (EE-LLM Sec. 4, App. D.3)
        for one sequence in one native call
        (:func:`~exitlm.backend.native_block.early_exit_step`): segment ``i`` runs layers
        ``bounds[i] .. bounds[i+1]`` over positions ``starts[i] .. q`` of ``hidden``
        ``(capacity, D)`` (each position's state at the depth it reached) in place; after
        each early exit the new token leaves when the exit's maximum probability reaches
        ``threshold`` (None: it may not). Returns (segments run, exit layer or 0, token), or
        None when the call does not take this model or cache (then the decoder runs the
        segments itself): the conditions of :meth:`draft_greedy` for every exit in
        ``bounds`` and a float32 ``hidden``. Keys/values and ``hidden`` get the bits the
        segment-by-segment decoder writes; the confidence is summed in another order than
        torch's softmax, so an exit decision can differ only where a confidence lies within
        rounding of the threshold."""
        if not (hidden.dtype is torch.float32 and hidden.is_contiguous() and hidden.dim() == 2
                and hidden.shape[0] > q and not hidden.requires_grad):
            return None
        if q - min(starts) + 1 > NATIVE_ROWS:  # as many rows as run_layers runs natively
            return None
        if not self._native_exits(bounds[1:-1], cache, q + 1):
            return None
        shared = self._shared_head(self.config.vocab_size)
        chain = self._chain(0, self.config.num_layers, cache)
        tables = self._tables(q)
        if shared is None or chain is None or tables is None:
            return None
        w_norm, eps, head = shared
        return early_exit_step(chain[0], chain[1], hidden, q, starts, bounds, threshold,
                               tables, w_norm, eps, head, BLAS.threads_override or 1)

    def _native_exits(self, exits: Sequence[int], cache: KVCache, positions: int) -> bool:
        """Whether the native steps take these exits and this cache: rotary positions, every
        exit through the final norm and LM head (no head of its own), no learned positions,
        one sequence with room for ``positions``, no gradient."""
        if torch.is_grad_enabled() or self.rope_inv_freq is None:
            return False
        if self.embed_positions is not None:
            return False
        if any(self.exit_route(e).head is not None for e in exits):
            return False
        keys = cache.keys
        return bool(keys) and keys[0].shape[0] == 1 and positions <= keys[0].shape[2]

    def _shared_head(self, vocab: int
                     ) -> tuple[torch.Tensor, float, tuple[Any, tuple[torch.Tensor, ...]]] | None:
        """The final RMSNorm's fp32 weight and eps, and the native description of the first
        ``vocab`` rows of the output embedding; None for what the native steps do not take
        (another norm, hooks on it, an fp16 or bf16 head)."""
        norm = self.norm
        if type(norm) is not Norm or norm.kind != "rmsnorm":
            return None
        if norm._forward_hooks or norm._forward_pre_hooks:
            return None
        w_norm = norm._parameters["weight"]
        if w_norm is None or w_norm.dtype is not torch.float32 or not w_norm.is_cpu:
            return None
        head = weight_struct(self.output_embedding()[:vocab])
        if head is None or head[0].fmt == 1:
            return None
        return w_norm, norm.eps, head

    def _tables(self, last: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The float32 rotary tables (one row per position) covering position ``last``."""
        cos, ssin = self._rope_table(torch.tensor(last), torch.float32)
        if not (cos.is_contiguous() and ssin.is_contiguous()):
            return None
        return cos, ssin

    def _chain(self, start: int, end: int, cache: KVCache
               ) -> tuple[list[NativeBlock], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The native calls of layers ``[start, end)`` and their cache rows, or None unless
        every one is a hook-free :class:`LeanBlock` whose native call serves ``cache``."""
        layers = self.layers._modules
        blocks: list[NativeBlock] = []
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(start, end):
            layer = layers[str(i)]
            if type(layer) is not LeanBlock or layer._forward_hooks or layer._forward_pre_hooks:
                return None
            nb = layer.native
            if nb is None or not nb.serves(layer, cache, i):
                return None
            blocks.append(nb)
            rows.append((cache.keys[i][0], cache.values[i][0]))
        return blocks, rows
