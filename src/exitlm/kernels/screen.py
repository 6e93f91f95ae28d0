"""The exact argmax of an output embedding's logits from a cheaper product: :class:`GreedyScreen`
(an int8 copy of a float head) and :class:`QuantizedScreen` (a quantized head itself), both with
the activations rounded to int8.

Greedy decoding needs one number per step from the LM head - the index of the largest logit -
yet reads the whole head to get it (SmolLM2's tied 49152 x 576 embedding: 113 MB of a 538 MB
fp32 token, ~30% of its time). A screen reads an int8 copy of the head instead (a quarter of
the bytes; Q8_0 groups of 32, :func:`~exitlm.kernels.quant.quantize`), multiplies it with the
activations rounded to int8 as the native kernels round them (``x^``,
:func:`_round_like_kernels`; the integer product, ``gemm_q8(..., int8_activations=True)``, gets
``x^`` itself and computes ``(q s) . x^`` up to float32 summation), and bounds, row by row, how
far each approximate logit ``a_v`` can lie from the logit ``e_v`` the full head computes:

    |a_v - e_v| <= (S_v / 2) ||x||_1  +  ||q_v s_v||_2 (||x^ - x||_2 + 4u ||x^||_2)
                   +  2 gamma_K R_v (||x||_2 + ||x^||_2)  =  Delta_v

(the int8 rounding of the weights, ``|w - q s| <= s / 2`` per element of a group with scale
``s``, at most ``S_v``, the row's largest scale; that of the activations, by Cauchy-Schwarz;
and float32 summation, ``gamma_K ~ (K + K/32 + 8) u`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, Sec. 3.1), of both products, ``sum |w| |x| <= R_v ||x||_2`` with ``R_v``
the larger of the row's two norms). Every row whose interval ``[a_v - Delta_v, a_v + Delta_v]``
reaches the largest lower bound is a candidate; the argmax is among them, and the full head's
own kernel computes their logits - the same bits as in the full product, since every output
element of the native products is a fixed function of its weight row and input row. The token
is therefore always the full head's argmax (first index on ties; a float16 model's logits are
rounded to float16 first, as its head does, so candidates within two float16 ulps of the
maximum are kept).

On SmolLM2's head a median of ~24 rows are candidates per step (p90 ~110; a few steps take
thousands, up to :func:`_cap`, then the full head). With float32 activations the int8 copy's
bound lacks the activations' term (1-6 candidates) but its product is slower: the step 1.28
against 1.13 ms with the avx512 build, 1.83 against 1.19 with the avx2 one (Zen 5,
``benchmarks/greedy_heads.py``). Greedy steps screen float32 and float16 heads
(:func:`screens_head`). A step whose activations are not finite (or tiny), or with too
many candidates, returns None: the caller takes the full head.

Quantized heads have their own screen, :class:`QuantizedScreen`: no copy, their own integer
product. Greedy steps take it for int4 heads when int8 activations are off
(``EXITLM_INT8_ACTIVATIONS=0``); with them on, the native runtime's heads are that integer
product already and need no screen.

A step's arithmetic around the product - rounding the activations, the bound's terms, the
candidates - is one native call each (``exitlm_screen_round``, ``exitlm_screen_candidates``:
the same float32 operations as the NumPy reference here, :func:`candidates_numpy`; ~0.1-0.2 ms
a step less than a dozen NumPy calls over the head's rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from exitlm.env import switched_off
from exitlm.kernels import native
from exitlm.kernels.quant import GROUP, QuantizedWeight, quantize
from exitlm.kernels.versions import version_of

MAX_CANDIDATES = 256
"""More candidates than this, and than a sixteenth of the head's rows (SmolLM2: 3,072), and the
step returns None: the full head is about as cheap."""
MIN_ROWS = 4096
"""Heads with fewer rows are read whole (a screen saves nothing worth its copy)."""
BUILD_TOKENS = 32
"""A screen is made for a greedy step that has at least this many tokens ahead: making it
takes ~0.1 s (SmolLM2), what ~30 of its steps save."""
_U = 2.0 ** -24  # float32 unit roundoff
_CHUNK = 1024  # rows quantized at a time (0.09 s instead of 0.24 for SmolLM2's head)
_TINY = 1e-30  # group scales below this: no screen (float32 rounding is not relative)
_HALF_MAX = 60000.0  # float16 logits beyond this may round to inf: take the full head


class GreedyScreen:
    """An int8 copy of a float32 or float16 output embedding ``(N, K)`` and the constants of
    its error bound (module docstring). It keeps no reference to the weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        w = weight.detach().float()
        parts = [quantize(w[i : i + _CHUNK], "int8") for i in range(0, n, _CHUNK)]  # in cache
        self.q = torch.cat([p.q for p in parts])
        self.scales = torch.cat([p.scales for p in parts])
        self.half = weight.dtype is torch.float16
        self.n, self.k = n, k
        largest = self.scales.amax(dim=1)
        # ||q s||_2 <= ||w||_2 + sqrt(K) max |q s - w|; float32 norms within K u of exact
        bound = torch.linalg.vector_norm(w, dim=1) * 1.001 + largest * (0.5001 * k ** 0.5)
        gamma = (k + k // GROUP + 8) * _U * 1.01  # the terms of one sum, group scales too
        self.radius = (2.0 * gamma * 1.001) * bound
        """Per row, what float32 summation may add per unit of ``||x||_2 + ||x^||_2``."""
        self.widest = float(self.radius.max()) * 1.0001 if n else 0.0
        """The largest of :attr:`radius` (the screen takes it for every row: it is small)."""
        self.rounding = largest * 0.5001
        """Per row, the int8 rounding of the weights' error per unit of ``||x||_1``."""
        _, copy = _square_norms(QuantizedWeight("int8", self.q, self.scales, None))
        self.norms = (copy.sqrt() * 1.0001).float()
        """Per row, ``||q s||_2``: the activations' int8 rounding's error per unit of
        ``||x^ - x||_2``."""
        self.version = (weight.data_ptr(), version_of(weight))
        self.candidates: list[int] = []
        """The rows recomputed exactly for each row of the last :meth:`argmax` (benchmarks)."""

    def current(self, weight: torch.Tensor) -> bool:
        """Whether this screen was made from ``weight`` as it is now."""
        return (weight.data_ptr(), version_of(weight)) == self.version

    def argmax(self, x: torch.Tensor, weight: torch.Tensor, threads: int = 1
               ) -> list[int] | None:
        """The full head's argmax for each row of ``x`` ``(M, K)`` float32 (what the head's
        native product would get: ``weight`` float32 / float16, the weight this screen was made
        from), or None when a row cannot be screened (module docstring)."""
        rounded = _round_and_terms(x)
        if rounded is None:
            return None
        xh, l1, e1, e2 = rounded
        a = native.gemm_q8(torch.from_numpy(xh), self.q, self.scales, threads,
                           int8_activations=True).numpy()
        kernel = native.gemm_f16 if self.half else native.gemm_f32

        def exact(i: int, cand: np.ndarray) -> np.ndarray:
            out = kernel(x[i : i + 1], weight[torch.from_numpy(cand)], 1)[0]
            return (out.half() if self.half else out).numpy()

        self.candidates = []
        # slack (S_v / 2) ||x||_1 + ||q s|| (||x^ - x|| + 4u ||x^||)
        return _choose(a, self.norms.numpy(), self.rounding.numpy(), e1, l1, e2 * self.widest,
                       _cap(self.n), exact, self.half, self.candidates)


def _cap(n: int) -> int:
    """The most candidates a screen recomputes for a head of ``n`` rows (more: the full head)."""
    return max(MAX_CANDIDATES, n // 16)


def _terms(x: torch.Tensor, xh: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``x`` and its int8 rounding ``xh``, a little above: ``||x||_1``,
    ``||x^ - x||_2 + 4u ||x^||_2`` and ``||x||_2 + ||x^||_2`` (float64)."""
    xd, hd = x.numpy().astype(np.float64), xh.astype(np.float64)
    hn = np.linalg.norm(hd, axis=1)
    l1 = np.abs(xd).sum(axis=1) * 1.0002
    e1 = (np.linalg.norm(hd - xd, axis=1) + 4 * _U * hn) * 1.0002
    return l1, e1, (np.linalg.norm(xd, axis=1) + hn) * 1.0001


def _choose(a: np.ndarray, norms: np.ndarray, rounding: np.ndarray | None, e1: np.ndarray,
            l1: np.ndarray, extra: np.ndarray, cap: int,
            exact: Callable[[int, np.ndarray], np.ndarray], half: bool, counts: list[int]
            ) -> list[int] | None:
    """The argmax of each row ``i`` of the exact logits from the approximate ones ``a``
    (:func:`candidates`: the rows whose interval reaches the largest lower bound),
    ``exact(i, candidates)`` their exact logits (first index on ties); None when a row has no
    finite logits, none or more than ``cap`` candidates. ``counts`` gets each row's number of
    candidates (``cap + 1`` for more)."""
    tokens = []
    for i in range(a.shape[0]):
        cand = candidates(a[i], norms, rounding, float(e1[i]), float(l1[i]), float(extra[i]),
                          half, cap)
        if cand is None:
            return None
        counts.append(len(cand))
        if not 0 < len(cand) <= cap:
            return None
        tokens.append(int(cand[int(np.argmax(exact(i, cand)))]))
    return tokens


def candidates(a: np.ndarray, norms: np.ndarray, rounding: np.ndarray | None, e1: float,
               l1: float, extra: float, half: bool, cap: int) -> np.ndarray | None:
    """The rows ``v`` of one row's approximate logits ``a`` (float32) that can hold the exact
    maximum: with the slack ``u_v = rounding_v l1 + norms_v e1`` (``norms_v e1`` without
    ``rounding``; float32 arrays), those whose ``a_v + u_v`` reaches the largest ``a_v - u_v``
    within ``2 (extra + 4u max |a|)`` (float16 logits: two float16 ulps more), in order -
    ``cap + 1`` of them when there are more than ``cap``; None when a logit is not finite (or a
    float16 floor lies beyond what float16 holds). Two passes of the native library
    (``exitlm_screen_candidates``) over the rows, else :func:`candidates_numpy`, the same
    float32 operations."""
    lib = native.library()
    if lib is None:
        got = candidates_numpy(a, norms, rounding, e1, l1, extra, half)
        return None if got is None else got[: cap + 1]
    n = a.shape[0]
    out = np.empty(cap + 1, np.int64)
    count = lib.exitlm_screen_candidates(
        a.ctypes.data, norms.ctypes.data, None if rounding is None else rounding.ctypes.data,
        n, e1, l1, extra, int(half), cap, out.ctypes.data)
    return None if count < 0 else out[:count]


def candidates_numpy(a: np.ndarray, norms: np.ndarray, rounding: np.ndarray | None, e1: float,
                     l1: float, extra: float, half: bool) -> np.ndarray | None:
    """:func:`candidates` in NumPy (the reference; every candidate, no cap)."""
    top = float(np.abs(a).max())
    if not math.isfinite(top):
        return None
    if rounding is None:
        u = norms * e1
    else:
        u = rounding * l1
        u += norms * e1
    floor = float((a - u).max()) - 2 * (extra + 4 * _U * top)
    if half:
        if abs(floor) > _HALF_MAX:
            return None
        floor -= 2.0 ** -9 * abs(floor) + 2.0 ** -24  # two float16 ulps
    return np.flatnonzero(a + u >= floor)


def _round_and_terms(x: torch.Tensor
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``x`` ``(M, K)`` float32 rounded as the kernels round activations
    (:func:`_round_like_kernels`) and its bounds per row (:func:`_terms`): ``(x^, ||x||_1,
    ||x^ - x||_2 + 4u ||x^||_2, ||x||_2 + ||x^||_2)``, each a little above; None where
    :func:`_round_like_kernels` gives None. One native call (``exitlm_screen_round``, float64
    sums in order) where the library is loaded."""
    lib = native.library()
    if lib is None:
        xh = _round_like_kernels(x)
        return None if xh is None else (xh, *_terms(x, xh))
    xn = np.ascontiguousarray(x.numpy(), dtype=np.float32)
    m, k = xn.shape
    xh = np.empty((m, k), np.float32)
    terms = np.empty((m, 3), np.float64)
    if lib.exitlm_screen_round(xn.ctypes.data, m, k, xh.ctypes.data, terms.ctypes.data) != 0:
        return None
    return xh, terms[:, 0], terms[:, 1], terms[:, 2]


def _round_like_kernels(x: torch.Tensor) -> np.ndarray | None:
    """``x`` ``(M, K)`` float32 rounded as the native kernels round activations to int8
    (``kernels.c`` ``quantize_x``, float32 operation for operation: ``d_g = absmax / 127`` per
    group of 32, ``xq = nearbyint(x * (1 / d_g))``), as the float32 values ``d_g xq``; None when
    a group's scale is not finite or below :data:`_TINY`. Fed these values, an int8-activation
    product finds the same ``xq`` (and ``d_g`` within two ulps) and multiplies them."""
    grp = x.numpy().reshape(x.shape[0], -1, GROUP)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        d = np.abs(grp).max(axis=-1, keepdims=True) / np.float32(127.0)
        if not ((d == 0) | ((d >= _TINY) & (d <= 3.0e38))).all():
            return None  # also NaN and inf
        inv = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0))
    return (np.clip(np.rint(grp * inv), -127.0, 127.0).astype(np.float32) * d).reshape(x.shape)


class QuantizedScreen:
    """The exact argmax of an int8 or int4 head's logits - those of its float32-activation
    product (:func:`~exitlm.kernels.quant.qlinear`) - from its integer product with the
    activations rounded to int8 (``int8_activations=True``, the fused blocks' arithmetic;
    SmolLM2's head on a Zen 5 core, a greedy step: Q4_0 0.60 against 0.91 ms, 0.78 against 1.44
    with the avx2 build; Q8_0 0.97 against 1.04, 1.13 against 1.26).

    The row ``x`` is rounded here as the kernels round it (:func:`_round_like_kernels`), to
    ``x^``, and the integer product gets ``x^``: it finds the same int8 values, and an int4
    product's group sums ``X_g`` (its ``min`` terms) are those of ``x^`` too, so it computes
    ``w . x^`` for the dequantized rows ``w`` (``q s``; int4 ``s nib + min``) up to float32
    summation. Then

        |a_v - e_v| <= ||w_v||_2 (||x^ - x||_2 + 4u ||x^||_2)
                       + gamma (R_v + M_v) (||x||_2 + ||x^||_2)  +  4u |a_v|

    (Cauchy-Schwarz; ``R_v``, ``M_v`` the norms of the row's ``q s`` / ``s nib`` and ``min``
    parts, which bound both products' float32 sums over their ``2 G`` accumulations and group
    sums, and the integer product's ``d_g`` a few ulps off: ``gamma``, Higham, *Accuracy and
    Stability of Numerical Algorithms*, Sec. 3.1). Candidates and their exact logits as in
    :class:`GreedyScreen`; on SmolLM2's Q4_0 head a median of 6-12 rows. It keeps no reference
    to the weight."""

    def __init__(self, weight: QuantizedWeight) -> None:
        n, k = weight.shape
        parts, whole = _square_norms(weight)
        spread = (torch.zeros(n, dtype=torch.float64) if weight.mins is None
                  else weight.mins.double().square().sum(dim=1) * GROUP)
        self.norms = (whole.sqrt() * 1.0001).float()
        """Per row, ``||w_v||_2`` (a little above)."""
        gamma = (2 * (k // GROUP) + 48) * _U * 1.1
        self.radius = ((parts.sqrt() + spread.sqrt()) * (gamma * 1.0001)).float()
        """Per row, what float32 summation may add per unit of ``||x||_2 + ||x^||_2``."""
        self.widest = float(self.radius.max()) * 1.0001 if n else 0.0
        """The largest of :attr:`radius` (the screen takes it for every row: it is small)."""
        self.n = n
        self.version = _quantized_version(weight)
        self.candidates: list[int] = []
        """The rows recomputed exactly for each row of the last :meth:`argmax` (benchmarks)."""

    def current(self, weight: QuantizedWeight) -> bool:
        """Whether this screen was made from ``weight``'s tensors as they are now."""
        return _quantized_version(weight) == self.version

    def _product(self, x: torch.Tensor, weight: QuantizedWeight, rows: torch.Tensor | None,
                 threads: int, act8: bool) -> torch.Tensor:
        """The head's native product of ``x`` (with int8 activations when ``act8``), of the
        weight's ``rows`` only when given."""
        q, sc = weight.q, weight.scales
        if weight.kind == "int8":
            if rows is not None:
                q, sc = q[rows], sc[rows]
            return native.gemm_q8(x, q, sc, threads, int8_activations=act8)
        mins = weight.kernel_mins()
        if rows is not None:
            q, sc, mins = q[rows], sc[rows], None if mins is None else mins[rows]
        elif (packed := weight.kernel_packed()) is not None:  # (the same bits, fewer bytes)
            return native.gemm_q4_packed(x, packed, self.n, threads, int8_activations=act8)
        return native.gemm_q4(x, q, sc, mins, threads, int8_activations=act8)

    def argmax(self, x: torch.Tensor, weight: QuantizedWeight, threads: int = 1
               ) -> list[int] | None:
        """``argmax(qlinear(x, weight))`` for each row of ``x`` ``(M, K)`` float32 (first index
        on ties), or None when a row cannot be screened (values not finite, a tiny group scale,
        too many candidates)."""
        rounded = _round_and_terms(x)
        if rounded is None:
            return None
        xh, l1, e1, e2 = rounded
        a = self._product(torch.from_numpy(xh), weight, None, threads, True).numpy()

        def exact(i: int, cand: np.ndarray) -> np.ndarray:
            return self._product(x[i : i + 1], weight, torch.from_numpy(cand), 1,
                                 False)[0].numpy()

        self.candidates = []
        # slack ||w_v|| (||x^ - x|| + 4u ||x^||)
        return _choose(a, self.norms.numpy(), None, e1, l1, e2 * self.widest, _cap(self.n),
                       exact, False, self.candidates)


def _square_norms(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a quantized ``weight``, in float64: ``||q s||_2^2`` (int4: ``||s nib||_2^2``,
    without the mins) and the dequantized row's ``||w||_2^2`` (the same for int8)."""
    n, k = weight.shape
    parts = torch.empty(n, dtype=torch.float64)
    whole = torch.empty(n, dtype=torch.float64)
    for i in range(0, n, _CHUNK):
        q = weight.q[i : i + _CHUNK]
        sn = q.view(-1, k // GROUP, GROUP) if weight.kind == "int8" else native.q4_nibbles(q)
        sn = sn.double()
        sn.mul_(weight.scales[i : i + _CHUNK, :, None].double())
        parts[i : i + _CHUNK] = sn.square().sum(dim=(1, 2))
        if weight.mins is not None:
            sn.add_(weight.mins[i : i + _CHUNK, :, None].double())
        whole[i : i + _CHUNK] = sn.square().sum(dim=(1, 2))
    return parts, whole


def _quantized_version(weight: QuantizedWeight) -> tuple[int, ...]:
    """Where ``weight``'s tensors are and how often they were written (a model's
    :class:`~exitlm.kernels.quantized.QuantizedEmbedding` builds a new ``QuantizedWeight`` per
    access from the same buffers)."""
    return tuple(v for t in (weight.q, weight.scales, weight.mins) if t is not None
                 for v in (t.data_ptr(), version_of(t)))


def screen_for(weight: torch.Tensor | QuantizedWeight) -> GreedyScreen | QuantizedScreen:
    """A new screen of ``weight``: :class:`QuantizedScreen` for a quantized head, else
    :class:`GreedyScreen`."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedScreen(weight)
    return GreedyScreen(weight)


def screens_head(weight: torch.Tensor | QuantizedWeight) -> bool:
    """Whether greedy steps screen a head of ``weight``'s kind: float32 and float16 heads
    (:class:`GreedyScreen`) and int4 ones (:class:`QuantizedScreen`). Measured on SmolLM2's
    head (``benchmarks/greedy_heads.py``): float16 1.07 against 1.30 ms a step on a Zen 5 core
    (1.15 against 1.74 with the avx2 build; decoding 1.02-1.05x), 1.62 against 2.30 ms on a
    Zen 4 core (docs/measurements/zen4_narrow_2026-12-03.md), for a 28 MB int8 copy; int8
    heads save too little to show: 0.97 against 1.04 ms (1.13 against 1.26) on Zen 5, decoding
    0.96-0.98x, and 1.91 against 1.79 ms on Zen 4."""
    if isinstance(weight, QuantizedWeight):
        return weight.kind == "int4"
    return weight.dtype in (torch.float32, torch.float16)


_SWITCH = {"on": True}


def screens_enabled() -> bool:
    """Whether runners screen greedy heads (``EXITLM_SCREEN=0`` or :func:`set_screens` turns
    it off)."""
    return _SWITCH["on"] and not switched_off("EXITLM_SCREEN")


def set_screens(on: bool) -> bool:
    """Turn screening on or off in this process (benchmarks compare both); returns the old
    setting."""
    old, _SWITCH["on"] = _SWITCH["on"], on
    return old


__all__ = ["BUILD_TOKENS", "MAX_CANDIDATES", "MIN_ROWS", "GreedyScreen",
           "QuantizedScreen", "screen_for", "screens_enabled", "screens_head", "set_screens"]
