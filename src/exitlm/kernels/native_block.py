"""A whole Llama-family block in one native call (``block.c``), for decoding steps.

Decoding one token through torch runs ~15 small operations per layer besides the weight
products, each a dispatch from caches that the previous product flushed: on the embedded
30-layer model that overhead measured ~19 ms of a ~54 ms token (0.6 ms per layer, as much as
the fp32 products themselves). :class:`NativeBlock` hands a block's RMSNorms, q/k/v product,
rotary embedding, cache write, grouped-query attention, output product, SwiGLU MLP and both
residuals to ``exitlm_llama_block`` in one call.

It takes one sequence (batch 1) and ``1..MAX_ROWS`` consecutive positions written to a
contiguous float32 cache range, i.e. decoding steps and the verification / recomputation
chunks of the early-exit decoders; prefills and padded batches keep the torch path. Each
row's arithmetic is fixed whatever the number of rows (see ``block.c``), so plain decoding and
verification agree bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import operator
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from exitlm.kernels import abi
from exitlm.kernels.quant import QuantizedWeight
from exitlm.kernels.quantized import QuantizedLinear
from exitlm.model.layers import MLP, Attention, Linear, Norm

MAX_ROWS = 16
"""The most positions one native block call takes (verification of up to 15 drafts)."""

_FORMATS = {"int8": 2, "int4": 3}
# exitlm_weight.fmt of int4 in 16-row blocks (exitlm_gemm_q4p); + 1 with float16 scales
_FORMAT_Q4_PACKED = 4


_Weight, _Dims, _Layer = abi.Weight, abi.BlockDims, abi.Layer


def weight_struct(w: Any, *, lookup: bool = False
                  ) -> tuple[_Weight, tuple[torch.Tensor, ...]] | None:
    """The native description of a linear weight (and the tensors it points into), or None
    for a layout the kernels do not take. int4 weights as their copy in 16-row blocks
    (:meth:`QuantizedWeight.kernel_packed`, format 4) where there is one, unless ``lookup``:
    an embedding whose rows the call reads (the plain layout)."""
    if isinstance(w, QuantizedWeight):
        parts = (w.q, w.scales) + (() if w.mins is None else (w.mins,))
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in parts):
            return None
        n, k = w.shape
        packed = None if lookup else w.kernel_packed()
        if packed is not None:
            qp, sp, mp = packed
            fmt = _FORMAT_Q4_PACKED + (sp.dtype is torch.float16)
            return _Weight(fmt, n, k, qp.data_ptr(), sp.data_ptr(),
                           0 if mp is None else mp.data_ptr()), tuple(
                               t for t in packed if t is not None)
        mins = w.kernel_mins()  # (None for int8 and Q4_0: the kernels compute -8 * scales)
        mins = 0 if mins is None else mins.data_ptr()
        return _Weight(_FORMATS[w.kind], n, k, w.q.data_ptr(), w.scales.data_ptr(),
                       mins), parts
    if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        return None
    fmt = {torch.float32: 0, torch.float16: 1}.get(w.dtype)
    if fmt is None:
        return None
    w = w.detach()
    return _Weight(fmt, w.shape[0], w.shape[1], w.data_ptr(), 0, 0), (w,)


class Scratch(threading.local):
    """Working memory shared by the blocks of one model, one buffer per thread (PPD runs
    its branches on a second thread while the main step runs), grown on demand."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return Scratch, ()  # copies start empty

    def pointer(self, nbytes: int) -> int:
        if self.buf.numel() * 4 < nbytes:
            self.buf = torch.empty((nbytes + 3) // 4 + 1024, dtype=torch.float32)
        return self.buf.data_ptr()


_VERSION = operator.attrgetter("_version")


class Intact:
    """What a prepared native call assumes of the modules it computes, checked before each
    call: the same sub-modules under the same names (``children``: ``(dict, name, module)``),
    no forward hooks on ``hooked`` (their hook dicts are kept: ``register_forward_hook`` and
    ``register_forward_pre_hook`` add to them), each weight in the storage the call points at
    (``storage``: ``(dict, name, data_ptr)``) and fp16 norm weights not updated in place
    (``versions``: ``(tensor, _version)``). The checks of several blocks add up into one
    (``a + b``) that a decoding step runs in a few passes of C-level ``map`` (~1 us a layer
    instead of ~9 us for the same checks written as Python loops).

    The hook dicts are read again only after a hook was registered anywhere in the process:
    every ``register_forward_hook`` / ``register_forward_pre_hook`` makes a
    :class:`~torch.utils.hooks.RemovableHandle`, whose class counts them (``next_id``), so an
    unchanged count since a check that found none means there are still none (a hook written
    into a module's private hook dict by hand is not seen). Each weight's ``data_ptr`` is read
    every time: ``tensor.data = other`` moves a weight without any such trace."""

    _LISTS = (
        "dicts",
        "fields",
        "hooks",
        "names",
        "objs",
        "ptrs",
        "stores",
        "tensors",
        "versions",
    )
    __slots__ = (*_LISTS, "hooks_mark")

    def __init__(self, children: Iterable[tuple[dict, str, Any]] = (),
                 hooked: Iterable[torch.nn.Module] = (),
                 storage: Iterable[tuple[dict, str, int]] = (),
                 versions: Iterable[tuple[torch.Tensor, int]] = ()) -> None:
        children, storage, versions = list(children), list(storage), list(versions)
        self.dicts = [d for d, _, _ in children]
        self.names = [n for _, n, _ in children]
        self.objs = [o for _, _, o in children]
        self.hooks = [d for m in hooked for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.stores = [d for d, _, _ in storage]
        self.fields = [n for _, n, _ in storage]
        self.ptrs = [p for _, _, p in storage]
        self.tensors = [t for t, _ in versions]
        self.versions = [v for _, v in versions]
        self.hooks_mark: int | None = None  # RemovableHandle.next_id when none were found

    def __add__(self, other: Intact) -> Intact:
        out = Intact()
        for name in Intact._LISTS:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def no_hooks(self) -> bool:
        """Whether none of the modules has a forward (pre-)hook."""
        mark = RemovableHandle.next_id
        if mark == self.hooks_mark:
            return True
        if any(self.hooks):
            return False
        self.hooks_mark = mark
        return True

    def same_children(self) -> bool:
        # list comparison tests identity first; modules compare equal only to themselves
        return list(map(dict.get, self.dicts, self.names)) == self.objs

    def in_place(self) -> bool:
        """Whether every weight still lives where the call points."""
        try:
            return list(map(torch.Tensor.data_ptr,
                            map(dict.get, self.stores, self.fields))) == self.ptrs
        except TypeError:  # a weight was removed
            return False

    def __call__(self) -> bool:
        return (self.same_children() and self.no_hooks()
                and self.in_place() and list(map(_VERSION, self.tensors)) == self.versions)


class NativeBlock:
    """One block's native call: its weights' descriptions, built once and checked cheaply on
    every call (:meth:`serves`)."""

    def __init__(self, lib: ctypes.CDLL, dims: _Dims, block: torch.nn.Module,
                 weights: list[tuple[_Weight, tuple[torch.Tensor, ...]]], scratch: Scratch,
                 reducer: Any = None) -> None:
        self.lib = lib
        self.module = block
        # a tensor-parallel shard's collectives (native_reduce.ShmReducer), kept alive here
        self.reducer = reducer
        self.reduce_ptr = None if reducer is None else reducer.pointer
        self.dims = dims
        attn, mlp = block.attn, block.mlp
        n1, n2 = block.norm_attn, block.norm_mlp
        lins = (attn.wqkv, attn.wo, mlp.w_in, mlp.w_out)
        self.structs = [w for w, _ in weights]
        # fp16 models: fp32 copies of the norm weights (their versions tell of updates)
        self.norms = [n.weight.detach().float() for n in (n1, n2)]
        self.keep = [t for _, ts in weights for t in ts] + [n1.weight, n2.weight]
        # what must not change for the pointers to stay right: the sub-modules themselves
        # and where their weights live
        self.intact = Intact(
            children=((block._modules, "attn", attn), (block._modules, "mlp", mlp),
                      (block._modules, "norm_attn", n1), (block._modules, "norm_mlp", n2),
                      (attn._modules, "wqkv", lins[0]), (attn._modules, "wo", lins[1]),
                      (mlp._modules, "w_in", lins[2]), (mlp._modules, "w_out", lins[3])),
            hooked=(attn, mlp, n1, n2, *lins),
            storage=((m._buffers, "q", m._buffers["q"].data_ptr()) if "q" in m._buffers
                     else (m._parameters, "weight", m._parameters["weight"].data_ptr())
                     for m in (*lins, n1, n2)),
            # (an inference tensor keeps no version counter: its storage is all there is)
            versions=((n.weight, n.weight._version) for n in (n1, n2)
                      if n.weight.dtype != torch.float32 and not n.weight.is_inference()))
        self.head_dim = dims.head_dim
        self.scratch = scratch
        self._args = (ctypes.byref(dims), self.norms[0].data_ptr(), self.norms[1].data_ptr(),
                      *(ctypes.byref(w) for w in self.structs))
        self._layers: dict[tuple[int, int, int], _Layer] = {}
        self.shape = (dims.dim, dims.heads, dims.kv_heads, dims.head_dim, dims.hidden)

    def layer(self, keys: torch.Tensor, values: torch.Tensor) -> _Layer:
        """This block as one layer of a chain (:func:`run_chain`) writing into ``keys`` /
        ``values`` ``(Hkv, S, hd)`` (kept for each cache row it met; a few at most)."""
        key = (keys.data_ptr(), values.data_ptr(), keys.stride(0))
        got = self._layers.get(key)
        if got is None:
            if len(self._layers) > 64:  # caches come and go: forget the old ones
                self._layers.clear()
            got = _Layer(ctypes.addressof(self.dims), self.norms[0].data_ptr(),
                         self.norms[1].data_ptr(), *(ctypes.addressof(w) for w in self.structs),
                         key[0], key[1], key[2], self.reduce_ptr)
            self._layers[key] = got
        return got

    def serves(self, block: torch.nn.Module, cache: Any, slot: int) -> bool:
        """Whether the call computes ``block`` on ``cache``'s slot: the same sub-modules,
        weights still where the call points, no forward hooks to run (:attr:`intact`), and a
        float32 cache with rows of ``(kv_heads, positions, head_dim)``."""
        if block is not self.module or not self.intact():
            return False
        kc, vc = cache.keys[slot], cache.values[slot]
        if kc.dtype is not torch.float32 or vc.dtype is not torch.float32:
            return False
        stride = kc.stride()
        return stride[3] == 1 and stride[2] == self.head_dim and vc.stride() == stride

    def moved(self, block: torch.nn.Module) -> bool:
        """Whether ``block`` is another module than the call was built for (a layer swapped
        for another), or the same one with the same sub-modules but a weight's storage moved
        (``share_memory_()``, as PPD's worker process and the pipeline stages do when they are
        spawned): then a call built afresh may serve it."""
        return block is not self.module or (self.intact.same_children()
                                            and not self.intact.in_place())

    def __call__(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 keys: torch.Tensor, values: torch.Tensor, start: int, threads: int
                 ) -> torch.Tensor:
        """The block's output for ``h`` ``(1, M, D)`` at positions ``start..start+M-1``,
        writing keys/values into ``keys``/``values`` ``(Hkv, S, hd)`` (one cache row)."""
        m = h.shape[1]
        out, cos, ssin = _inputs(h, rope)
        need = self.lib.exitlm_block_scratch(ctypes.byref(self.dims), m, start + m)
        rc = self.lib.exitlm_llama_block(
            out.data_ptr(), m, *self._args, cos.data_ptr(), ssin.data_ptr(),
            keys.data_ptr(), values.data_ptr(), keys.stride(0), start,
            self.scratch.pointer(need), threads, self.reduce_ptr)
        _check(rc, (self,))
        return out if h.dtype == torch.float32 else out.to(h.dtype)


def _inputs(h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 residual stream a native call updates in place (a copy of ``h``; an fp16
    model's stream is computed in fp32 and rounded back) and contiguous rotary tables."""
    out = h.float() if h.dtype != torch.float32 else h.contiguous().clone()
    cos, ssin = rope
    return out, cos.contiguous(), ssin.contiguous()


def _check(rc: int, blocks: Iterable[NativeBlock]) -> None:
    """Raise for a failed native call; a collective's failure with its own message."""
    if rc != 0:
        for b in blocks:
            if b.reducer is not None and rc <= -20:
                b.reducer._check(rc)
        raise RuntimeError(f"native block failed with code {rc}")


class LayerRun:
    """Consecutive blocks of one sequence as the chain calls take them: the blocks and their
    ``exitlm_layer`` structs, block ``i`` writing ``rows[i]`` (one cache row's keys and
    values ``(Hkv, S, hd)``). Made once per range and cache (:class:`~exitlm.runtime.native.
    NativeRunner` keeps them), so that a step does not rebuild ~50 structs and views."""

    def __init__(self, blocks: list[NativeBlock],
                 rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.blocks = blocks
        self.layers = (_Layer * len(blocks))(*(b.layer(k, v) for b, (k, v)
                                                in zip(blocks, rows, strict=True)))
        self.distinct = list({b.shape: b for b in blocks}.values())  # one per shape

    def scratch(self, m: int, positions: int) -> int:
        """Scratch for ``m`` rows attending to ``positions`` positions in the largest block."""
        first = self.blocks[0]
        need = max(first.lib.exitlm_block_scratch(ctypes.byref(b.dims), m, positions)
                   for b in self.distinct)
        return first.scratch.pointer(need)


def run_chain(run: LayerRun, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              start: int, threads: int,
              rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Consecutive blocks of one sequence (float32 or float16 residual stream) in one native
    call: the output of ``blocks[-1](...blocks[0](h))`` ``(1, M, D)`` of ``run``, each block
    writing its keys/values into its cache row. ``exitlm_llama_blocks`` runs each layer with
    the same function as :meth:`NativeBlock.__call__`, so a chain gives the bits of its blocks
    called one by one, without a Python round trip per layer (~15 us each).

    ``rows``: the M rows belong to several sequences (a batch; ``exitlm_llama_blocks_rows``):
    ``(positions, offsets)``, int64 ``(M,)``, row ``m`` at position ``positions[m]`` of the
    cache row ``offsets[m]`` floats after the run's (each row's bits are those of its sequence
    decoded alone; ``rope`` holds each row's table row and ``start`` is unused)."""
    m = h.shape[1]
    # a float16 model's residual stream: fp32 in each block, rounded to fp16 between blocks
    half = h.dtype == torch.float16
    out, cos, ssin = _inputs(h, rope)
    lib = run.blocks[0].lib
    if rows is None:
        rc = lib.exitlm_llama_blocks(
            out.data_ptr(), m, len(run.blocks), run.layers, cos.data_ptr(), ssin.data_ptr(),
            start, run.scratch(m, start + m), threads, int(half))
    else:
        pos, off = rows
        rc = lib.exitlm_llama_blocks_rows(
            out.data_ptr(), m, len(run.blocks), run.layers, cos.data_ptr(), ssin.data_ptr(),
            pos.data_ptr(), off.data_ptr(), run.scratch(m, int(pos.max()) + 1), threads,
            int(half))
    _check(rc, run.blocks)
    return out.to(torch.float16) if half else out


def build_native_block(lib: ctypes.CDLL, block: torch.nn.Module, scratch: Scratch
                       ) -> NativeBlock | None:
    """The native call for ``block`` (an :class:`exitlm.model.layers.Block`), or None unless
    it is the stock Llama-family block (RMSNorm, rotary attention, SwiGLU with SiLU, no
    biases) with weights the kernels take."""

    attn, mlp = block.attn, block.mlp
    n1, n2 = block.norm_attn, block.norm_mlp
    if not (isinstance(attn, Attention) and isinstance(mlp, MLP) and isinstance(n1, Norm)
            and isinstance(n2, Norm) and n1.kind == n2.kind == "rmsnorm" and attn.use_rope
            and mlp.gated and mlp.act is F.silu and n1.eps == n2.eps):
        return None
    lins = (attn.wqkv, attn.wo, mlp.w_in, mlp.w_out)

    # exactly these classes: a parallel layout's subclasses (tensor-parallel row/column
    # shards, exitlm.train.parallel) communicate inside their forward, which this call would skip -
    # except a tensor-parallel shard whose output and MLP-out layers sum their partial
    # products through one shared-memory reducer (``native_reduce``), which the call runs
    reducer = getattr(attn.wo, "native_reducer", None)
    plain = (Linear, torch.nn.Linear, QuantizedLinear)
    sums = (lins[1], lins[3]) if reducer is not None else ()
    if reducer is not None and (getattr(lins[3], "native_reducer", None) is not reducer
                                or any(getattr(lin, "full_bias", None) is not None
                                       for lin in sums)):
        return None
    if any((type(lin) not in plain and lin not in sums)
           or getattr(lin, "bias", None) is not None for lin in lins):
        return None
    if any(t.dtype not in (torch.float32, torch.float16) or t.device.type != "cpu"
           for t in (n1.weight, n2.weight)):
        return None
    weights = [weight_struct(lin.weight) for lin in lins]
    if any(w is None for w in weights):
        return None
    dims = _Dims(attn.wo.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                 mlp.hidden, n1.eps, 1.0 / math.sqrt(attn.head_dim))
    return NativeBlock(lib, dims, block, weights, scratch,  # type: ignore[arg-type]
                       reducer)


def chain(run: LayerRun, token: int, n: int, tables: tuple[torch.Tensor, torch.Tensor], start: int,
          embed: tuple[_Weight, tuple[torch.Tensor, ...]], norm: torch.Tensor | None,
          eps: float, head: tuple[_Weight, tuple[torch.Tensor, ...]] | None, threads: int,
          ids: torch.Tensor | None = None, stop_below: float | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy chain of one sequence in one native call (``exitlm_chain``; a float16
    embedding makes a float16 stream, rounded after every block as the blocks do): from
    ``token`` at position ``start``, ``n`` steps through the blocks of ``run``, each
    followed by the head - RMSNorm (weight ``norm``) and output embedding
    ``head`` - whose argmax is the next step's token. Returns the tokens ``(n,)`` int64 and
    the hidden state after the blocks of every step ``(n + 1, D)``. ``tables``: the model's
    rotary tables, one row of ``head_dim`` per position, covering ``start + n``. With
    ``n == 0`` ``norm`` and ``head`` may be None. ``ids``: the token id of each of ``head``'s
    rows (int64, a ranked draft vocabulary); None: row ``r`` is token ``r``. ``stop_below``:
    end the chain after a draft whose probability under the head is below it (the tokens and
    states returned are then fewer)."""
    if n > 0 and (norm is None or head is None):
        raise ValueError("chain: steps after the first need the head's norm and weight")
    if ids is not None and (ids.dtype != torch.int64 or not ids.is_contiguous()
                            or head is None or ids.numel() != head[0].n):
        raise ValueError("chain: ids must be one contiguous int64 id per head row")
    first = run.blocks[0]
    lib = first.lib
    dim = first.dims.dim
    layers, scratch = run.layers, run.scratch(1, start + n + 1)
    hidden = torch.empty(n + 1, dim, dtype=torch.float32)
    tokens = torch.empty(n, dtype=torch.int64)
    work = torch.empty(dim + (0 if head is None else head[0].n), dtype=torch.float32)
    cos, ssin = tables
    steps = ctypes.c_int64(n)
    rc = lib.exitlm_chain(token, n, len(run.blocks), layers, cos.data_ptr(), ssin.data_ptr(),
                          start, ctypes.byref(embed[0]),
                          None if norm is None else norm.data_ptr(), eps,
                          None if head is None else ctypes.byref(head[0]),
                          None if ids is None else ids.data_ptr(),
                          0.0 if stop_below is None else float(stop_below),
                          ctypes.byref(steps), hidden.data_ptr(), tokens.data_ptr(),
                          work.data_ptr(), scratch, threads)
    _check(rc, run.blocks)
    made = int(steps.value)
    return tokens[:made], hidden[: made + 1]


def segments(run: LayerRun, hidden: torch.Tensor, q: int, starts: list[int], bounds: list[int],
             stop_prob: float | None, tables: tuple[torch.Tensor, torch.Tensor],
             norm: torch.Tensor, eps: float, head: tuple[_Weight, tuple[torch.Tensor, ...]],
             threads: int) -> tuple[int, int, torch.Tensor | None]:
    """One position's forward through the whole chain ``run`` as segments in one native
    call (``exitlm_segments``; EE-LLM Sec. 4 / App. D.3): segment ``i`` runs layers
    ``bounds[i] .. bounds[i+1]`` over positions ``starts[i] .. q`` of ``hidden``
    ``(capacity, D)`` in place; after each inner bound the head (RMSNorm + output embedding
    ``head``) probes row ``q``, and the call stops once its maximum probability reaches
    ``stop_prob`` (None: never). Returns the number of segments run, the bound it stopped at
    (0: none; row ``q`` then holds the last layer's output) and that probe's logits."""
    first = run.blocks[0]
    lib = first.lib
    dim = first.dims.dim
    m = q - min(starts) + 1
    layers, scratch = run.layers, run.scratch(m, q + 1)
    n = len(starts)
    c_starts = (ctypes.c_int64 * n)(*starts)
    c_bounds = (ctypes.c_int64 * (n + 1))(*bounds)
    out = (ctypes.c_int64 * 3)()
    work = torch.empty(dim + head[0].n, dtype=torch.float32)
    cos, ssin = tables
    rc = lib.exitlm_segments(
        hidden.data_ptr(), q, c_starts, c_bounds, n, int(stop_prob is not None),
        2.0 if stop_prob is None else stop_prob, layers, cos.data_ptr(), ssin.data_ptr(),
        norm.data_ptr(), eps, ctypes.byref(head[0]), work.data_ptr(),
        scratch, threads, out)
    _check(rc, run.blocks)
    stopped = int(out[1])
    return int(out[0]), stopped, work[dim:] if stopped else None
