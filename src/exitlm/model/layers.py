"""Building blocks of the transformer: norms, rotary embedding, attention, MLP, block.

Weights follow ``nn.Linear``'s ``(out_features, in_features)`` convention so checkpoints map
one-to-one; :func:`exitlm.model.layout.optimize_layout` may re-stride them for fast batch-1
decoding on CPU without changing their values.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

from exitlm.config import ModelConfig, RopeScaling
from exitlm.model.kv_cache import KVCache, WritePlan

# Pre-packed (oneDNN) copies of weights for inference on CPU, see exitlm.model.layout: bf16
# weights (every product) and, when a decoder multiplies a few rows at a time, fp32 weights
# (products of PACKED_ROWS rows). Keyed by id(weight); each entry remembers the weight (weakly)
# and its version counter, so a weight changed in place (an optimizer step) silently falls
# back to the plain kernel.
_PACKED: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def register_packed(weight: torch.Tensor, packed: torch.Tensor | None) -> None:
    """Use ``packed`` instead of ``weight`` in :func:`linear` while gradients are off."""
    key = id(weight)
    if packed is None:
        _PACKED.pop(key, None)
        return
    _PACKED[key] = (weakref.ref(weight, lambda _: _PACKED.pop(key, None)), weight._version, packed)


PACKED_ROWS = (2, 32)
"""Row counts (inclusive) of the fp32 products that use a pre-packed weight: oneDNN with the
weight packed once costs ~1.1-2.4 GEMVs for 2-8 rows where MKL's and OpenBLAS' GEMMs, which
pack the weight on every call, cost 3-6 (README "Performance")."""


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` has an up-to-date pre-packed copy (see :func:`register_packed`)."""
    entry = _PACKED.get(id(weight))
    return entry is not None and entry[0]() is weight and entry[1] == weight._version


def _find_openblas_threads() -> Callable[[int], None] | None:
    """The thread-count setter of the OpenBLAS that numpy calls, or None when numpy uses
    another BLAS or it cannot be found (numpy's GEMV path is then not used)."""
    names = (
        "scipy_openblas_set_num_threads64_",  # numpy >= 2 wheels
        "scipy_openblas_set_num_threads",
        "openblas_set_num_threads64_",  # numpy 1.x wheels
        "openblas_set_num_threads",
    )
    root = os.path.dirname(os.path.dirname(np.__file__))
    candidates = glob.glob(os.path.join(root, "numpy.libs", "*openblas*"))  # Linux wheels
    candidates += glob.glob(os.path.join(os.path.dirname(np.__file__), ".dylibs", "*openblas*"))
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn.restype = None
                return fn
    return None


class _NumpyGemv:
    """Batch-1 fp32 GEMV through numpy's OpenBLAS, on zero-copy views of torch's tensors.

    On this project's CPUs OpenBLAS' ``sgemv`` streams fp32 weights ~1.2-1.5x faster than the
    MKL kernel behind ``F.linear`` (README "Performance"), and also scales to two threads,
    which MKL's does not. It runs on the calling thread only, except inside
    :func:`decode_threads`: OpenBLAS worker threads next to torch's busy-waiting OpenMP
    workers make every GEMV wait for the scheduler (decoding ~8x slower on 2 cores).
    """

    def __init__(self) -> None:
        self.set_threads = _find_openblas_threads()
        self.enabled = self.set_threads is not None
        self.threads = -1
        self.threads_override: int | None = None

    def sync_threads(self) -> None:
        n = self.threads_override or 1
        if n != self.threads:
            assert self.set_threads is not None
            self.set_threads(n)
            self.threads = n

    def vector(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``weight @ x`` for a contiguous 1-row ``x`` without gradient, as a 1-D tensor."""
        return torch.from_numpy(np.dot(x.numpy().reshape(-1), weight.detach().numpy().T))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.sync_threads()
        y = self.vector(x.detach(), weight)
        if x.dim() == 3:
            return y.view(x.shape[0], x.shape[1], -1)
        return y.view(*x.shape[:-1], -1)

    def rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for a few fp32 rows (``SMALL_ROWS``), in blocks of weight rows.

        Verification in self-speculative decoding, KV recomputation and small decoding
        batches multiply 2-8 rows. MKL and OpenBLAS pack the whole weight matrix for such a
        GEMM, so it costs 3-5 GEMVs; OpenBLAS' small-matrix kernel, which needs no packing,
        only takes products of at most ~1e6 multiply-adds. Cutting the weight into blocks of
        rows that fit brings 5 rows to ~2.5 GEMVs (README "Performance").
        """
        self.sync_threads()
        x2 = x.detach().reshape(-1, x.shape[-1])
        m, k = x2.shape
        n = weight.shape[0]
        xn = x2.numpy()
        # a strided view: for a column-major weight (layout.optimize_layout) each block's
        # transpose is a contiguous slice of the (in, out) matrix, for a row-major one a
        # transposed block; OpenBLAS takes either without a copy
        w = weight.detach().numpy()
        out = np.empty((m, n), dtype=np.float32)
        block = _row_block(m, k)
        for a in range(0, n, block):
            np.matmul(xn, w[a : a + block].T, out=out[:, a : a + block])
        return torch.from_numpy(out).view(*x.shape[:-1], n)


SMALL_ROWS = (2, 8)
"""Row counts (inclusive) whose fp32 products go through :meth:`_NumpyGemv.rows` (beyond 8
rows the blocks gain little over ``F.linear``)."""

LEAN_ROWS = 16
"""The most tokens of one sequence that :meth:`Block._decode_step` runs (verification of up
to 15 drafts); longer chunks (prefills) take the general path."""


def _blas_layout(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is row- or column-major, the layouts :meth:`_NumpyGemv.rows`
    hands to OpenBLAS as they are."""
    return weight.is_contiguous() or weight.t().is_contiguous()


def _row_block(m: int, k: int) -> int:
    """Weight rows per block so that ``m x block x k`` stays within OpenBLAS' small-matrix
    kernel (measured limit ~1e6 multiply-adds; blocks above 128 rows fell off it too)."""
    block = 128
    while block > 8 and m * block * k > 1_000_000:
        block //= 2
    return block


_NUMPY_GEMV = _NumpyGemv()
_PLAIN_TENSORS = frozenset((torch.Tensor, nn.Parameter))


def gemv_bound(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether batch-1 decoding of weights of ``dtype`` on ``device`` runs its GEMVs through
    numpy's OpenBLAS (see :func:`thread_split`)."""
    return _NUMPY_GEMV.enabled and dtype == torch.float32 and device.type == "cpu"


@contextmanager
def thread_split(torch_threads: int, blas_threads: int) -> Iterator[None]:
    """Run with ``torch_threads`` intra-op threads for torch and ``blas_threads`` for the
    numpy OpenBLAS products of :func:`linear` (restored afterwards).

    Batch-1 fp32 decoding gives the threads to OpenBLAS and leaves torch one: a step's other
    ops are far too small to split, and with two OpenMP threads torch's idle worker spins on
    the core OpenBLAS' worker needs (decoding ~8x slower on 2 cores).
    """
    n = torch.get_num_threads()
    prev = _NUMPY_GEMV.threads_override
    _NUMPY_GEMV.threads_override = blas_threads
    if torch_threads != n:
        torch.set_num_threads(torch_threads)
    try:
        yield
    finally:
        if torch_threads != n:
            torch.set_num_threads(n)
        _NUMPY_GEMV.threads_override = prev


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the CPU fast paths of :mod:`exitlm.model.layout`.

    * a weight pre-packed for oneDNN is used when no gradient is needed (bf16: always; fp32:
      for products of 2-32 rows, when a decoder asked for it);
    * one fp32 row without gradients (batch-1 decoding) goes through numpy's OpenBLAS GEMV,
      and 2-8 rows (verification, KV recomputation, small batches) through its small-matrix
      GEMM in blocks of weight rows (:meth:`_NumpyGemv.rows`);
    * CPU fp16 GEMM with many rows (prefill) is ~50x slower than fp32, so such inputs are
      computed in fp32 and cast back; one-row GEMV (decoding) stays in fp16, where it is fast.
    """
    if _PACKED and not torch.is_grad_enabled():
        entry = _PACKED.get(id(weight))
        if (
            entry is not None
            and entry[0]() is weight
            and entry[1] == weight._version
            and x.dtype == weight.dtype
            and (x.dtype is not torch.float32
                 or PACKED_ROWS[0] <= x.numel() // x.shape[-1] <= PACKED_ROWS[1])
        ):
            return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")
    if (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and _NUMPY_GEMV.enabled
        and x.is_cpu
        and weight.is_cpu
        and not torch.is_grad_enabled()
        and type(weight) in _PLAIN_TENSORS
        and type(x) is torch.Tensor
    ):
        if x.numel() == x.shape[-1]:  # one row: batch-1 decoding
            y = _NUMPY_GEMV(x, weight)
            return y if bias is None else y + bias
        if (
            SMALL_ROWS[0] <= x.numel() // x.shape[-1] <= SMALL_ROWS[1]
            and x.is_contiguous()
            and _blas_layout(weight)
        ):
            y = _NUMPY_GEMV.rows(x, weight)
            return y if bias is None else y + bias
    if x.dtype == torch.float16 and x.device.type == "cpu" and x.numel() > 8 * x.shape[-1]:
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.float16)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Norm(nn.Module):
    """RMSNorm (Llama family) or LayerNorm (GPT-2), chosen by ``ModelConfig.norm``."""

    def __init__(self, dim: int, kind: str, eps: float) -> None:
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        if x.dtype in (torch.float16, torch.bfloat16):
            # Normalise in fp32 like the reference Llama implementation, then scale.
            y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
            return y * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotary inverse frequencies ``theta^(-2i/d)``, with optional Llama-3 / linear scaling."""
    # float32 arithmetic, as the reference implementations do, so angles match bit-for-bit.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return torch.where(mid, blended, scaled)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention (and the KV cache) computes in for weights of ``dtype``.

    CPU kernels for fp16/bf16 attention are several times slower than fp32 ones, and the
    q/k/v rows of one token are tiny, so on CPU attention runs in fp32 (more accurate too).
    """
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def rope_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)`` for angles ``(B, T, D/2)``, shaped ``(B, T, 1, D)``.

    ``signed_sin = [-sin, sin]`` folds rotate-half's sign into the table, so applying the
    rotation costs one concatenation and two multiply-adds (:func:`apply_rope`).
    """
    cos, sin = angles.cos(), angles.sin()
    cos_t = torch.cat((cos, cos), dim=-1)[:, :, None]
    sin_t = torch.cat((-sin, sin), dim=-1)[:, :, None]
    return cos_t.to(dtype), sin_t.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by its positions' angles (half-split convention).

    Equals ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Attention(nn.Module):
    """Multi-head / grouped-query causal self-attention with a fused q,k,v projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.hdim
        self.use_rope = cfg.pos == "rope"
        qkv_out = (cfg.num_heads + 2 * cfg.n_kv_heads) * cfg.hdim
        self.wqkv = Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.num_heads * cfg.hdim, cfg.dim, bias=cfg.out_bias)

    def kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, Hkv, T, D)`` of the (normed) input ``x`` ``(B, T, D)``."""
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        qkv = qkv.to(attention_dtype(qkv.dtype, qkv.device)).view(b, t, h + 2 * hkv, d)
        k, v = qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
        if rope is not None:
            k = apply_rope(k, *rope)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        slot: int,
        plan: WritePlan | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        adt = attention_dtype(qkv.dtype, qkv.device)
        if qkv.dtype != adt:
            qkv = qkv.to(adt)
        qkv = qkv.view(b, t, h + 2 * hkv, d)  # (B, T, heads, D)
        if rope is not None:
            qk = apply_rope(qkv[:, :, : h + hkv], *rope)  # q and k rotated together
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q, k = qkv[:, :, :h], qkv[:, :, h : h + hkv]
        v = qkv[:, :, h + hkv :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if cache is not None and plan is not None:
            k, v = cache.write(slot, k, v, plan)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=hkv != h
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=hkv != h
            )
        out = out.transpose(1, 2).reshape(b, t, h * d).to(x.dtype)  # (B, T, H*D)
        return self.wo(out)


_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """SwiGLU (fused gate+up projection) or a plain two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.hidden = cfg.hidden_dim
        width = 2 * cfg.hidden_dim if self.gated else cfg.hidden_dim
        self.w_in = Linear(cfg.dim, width, bias=cfg.mlp_bias)
        self.w_out = Linear(cfg.hidden_dim, cfg.dim, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w_in(x)
        if self.gated:
            gate, up = y.split(self.hidden, dim=-1)
            return self.w_out(self.act(gate) * up)
        return self.w_out(self.act(y))


def _rms_norm_fp32(h: torch.Tensor, norm: Norm) -> torch.Tensor:
    """``F.rms_norm`` of fp32 ``h`` with ``norm``'s weight, spelled out: the same operations
    in the same order as ATen's composite kernel (bit-identical results), with half of its
    dispatches, which shows when a decoding step runs it from cold caches."""
    var = torch.mean(h * h, -1, keepdim=True)
    return h * torch.rsqrt(var + norm.eps) * norm._parameters["weight"]


class Block(nn.Module):
    """Pre-norm transformer layer: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = Norm(cfg.dim, cfg.norm, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm_mlp = Norm(cfg.dim, cfg.norm, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        slot: int,
        plan: WritePlan | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if (
            plan is not None
            and h.shape[0] == 1
            and h.shape[1] <= LEAN_ROWS
            and h.dtype is torch.float32
            and _NUMPY_GEMV.enabled
            and (mask is None) == (h.shape[1] == 1)
            and rope is not None
            and cache is not None
            and plan.index is None
            and not torch.is_grad_enabled()
            and not h.requires_grad
        ):
            parts = self._decode_parts()
            if parts is not None:
                return self._decode_step(parts, h, rope, cache, slot, plan, mask)
        h = h + self.attn(self.norm_attn(h), rope, cache, slot, plan, mask)
        return h + self.mlp(self.norm_mlp(h))

    def kv(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer's attention computes from its input ``h``."""
        return self.attn.kv(self.norm_attn(h), rope)

    def _decode_parts(self) -> tuple | None:
        """What :meth:`_decode_step` needs, or None unless it computes exactly what the
        sub-modules would: the stock Llama-family modules (RMSNorm, rotary attention, SwiGLU,
        no biases), plain fp32 weights on the CPU, and no hooks that calling the sub-modules
        would run. Reads the modules' dicts directly: this runs for every layer of every
        decoding step."""
        mods = self._modules
        attn, mlp, n1, n2 = mods["attn"], mods["mlp"], mods["norm_attn"], mods["norm_mlp"]
        if (
            type(attn) is not Attention or type(mlp) is not MLP
            or type(n1) is not Norm or type(n2) is not Norm
            or n1.kind != "rmsnorm" or n2.kind != "rmsnorm"
            or not mlp.gated or mlp.act is not F.silu or not attn.use_rope
            or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
        ):
            return None
        for m in (attn, mlp, n1, n2):
            if m._forward_hooks or m._forward_pre_hooks:
                return None
        am, mm = attn._modules, mlp._modules
        weights = []
        for lin in (am["wqkv"], am["wo"], mm["w_in"], mm["w_out"]):
            params = lin._parameters
            w = params["weight"]
            if (
                type(lin) is not Linear or lin._forward_hooks or lin._forward_pre_hooks
                or params["bias"] is not None or type(w) not in _PLAIN_TENSORS
                or w.dtype is not torch.float32 or not w.is_cpu
                or not _blas_layout(w)
            ):
                return None
            weights.append(w)
        return (attn, mlp, n1, n2, *weights)

    def _decode_step(
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
        ``LEAN_ROWS`` rows are a verification or KV-recomputation chunk (with its mask;
        products through :meth:`_NumpyGemv.rows` or ``F.linear``, as :func:`linear` would).
        Every layer of every step pays this code's cost, from caches that the previous
        multi-megabyte product just flushed, so fewer calls measurably matter (README
        "Performance")."""
        attn, mlp, n1, n2, w_qkv, w_o, w_in, w_out = parts
        nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        m = h.shape[1]
        mm = _NUMPY_GEMV.vector if m == 1 else linear
        _NUMPY_GEMV.sync_threads()
        x = _rms_norm_fp32(h, n1)
        qkv = mm(x, w_qkv).view(1, m, nh + 2 * nkv, d)
        qk = apply_rope(qkv[:, :, : nh + nkv], *rope)
        q = qk[:, :, :nh].transpose(1, 2)
        k, v = cache.write(
            slot, qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + nkv :].transpose(1, 2), plan
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
        if m > 1:  # (1, H, m, D) -> (1, m, H*D); one row's layout is that already
            out = out.transpose(1, 2).reshape(1, m, nh * d)
        h = h + mm(out, w_o).view(h.shape)
        x = _rms_norm_fp32(h, n2)
        y = mm(x, w_in)
        hidden = mlp.hidden
        return h + mm(F.silu(y[..., :hidden]) * y[..., hidden:], w_out).view(h.shape)


