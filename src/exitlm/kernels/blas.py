"""Batch-1 fp32 products through numpy's OpenBLAS, and the thread hand-off they need.

On this project's CPUs OpenBLAS' ``sgemv`` streams fp32 weights at 17-25 GB/s on one thread
against 10-21 GB/s for the MKL kernel behind ``F.linear`` (~1.2-1.5x, docs/architecture.md),
and it scales to two threads, which MKL's does not. numpy ships that OpenBLAS; its products
run here on zero-copy views of torch's tensors.

OpenBLAS' thread count is process-wide library state, so it is held by one object,
:data:`BLAS`, and changed only through :func:`thread_split`: OpenBLAS worker threads next to
torch's busy-waiting OpenMP workers make every GEMV wait for the scheduler (decoding ~8x
slower on 2 cores), so outside a :func:`thread_split` block OpenBLAS runs on the calling
thread only.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

SMALL_ROWS = (2, 8)
"""Row counts (inclusive) whose fp32 products go through :meth:`OpenBlas.rows` (beyond 8
rows the blocks gain little over ``F.linear``)."""

PLAIN_TENSORS = frozenset((torch.Tensor, nn.Parameter))
"""Tensor types whose storage numpy may view: not DTensors (tensor parallelism), not other
subclasses."""


def _find_openblas_threads() -> Callable[[int], None] | None:
    """The thread-count setter of the OpenBLAS that numpy calls, or None when numpy uses
    another BLAS or it cannot be found (the OpenBLAS paths are then not used)."""
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


def blas_layout(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is row- or column-major, the layouts :meth:`OpenBlas.rows` hands
    to OpenBLAS as they are."""
    return weight.is_contiguous() or weight.t().is_contiguous()


def row_block(m: int, k: int) -> int:
    """Weight rows per block so that ``m x block x k`` stays within OpenBLAS' small-matrix
    kernel (measured limit ~1e6 multiply-adds; blocks above 128 rows fell off it too)."""
    block = 128
    while block > 8 and m * block * k > 1_000_000:
        block //= 2
    return block


class OpenBlas:
    """fp32 products through numpy's OpenBLAS, on zero-copy views of torch's tensors.

    :meth:`vector` is batch-1 decoding's GEMV, :meth:`rows` the 2-8-row products of
    verification, KV recomputation and small batches. Both run on the calling thread only,
    except inside :func:`thread_split` (module docstring).
    """

    def __init__(self) -> None:
        self.set_threads = _find_openblas_threads()
        self.enabled = self.set_threads is not None
        self.threads = -1
        self.threads_override: int | None = None

    def sync_threads(self) -> None:
        """Give OpenBLAS the thread count :func:`thread_split` asked for (1 outside it)."""
        n = self.threads_override or 1
        if n != self.threads:
            assert self.set_threads is not None
            self.set_threads(n)
            self.threads = n

    def vector(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``weight @ x`` for a contiguous 1-row ``x`` without gradient, as a 1-D tensor."""
        return torch.from_numpy(np.dot(x.numpy().reshape(-1), weight.detach().numpy().T))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for one row ``x`` (any leading shape of size 1)."""
        self.sync_threads()
        y = self.vector(x.detach(), weight)
        if x.dim() == 3:
            return y.view(x.shape[0], x.shape[1], -1)
        return y.view(*x.shape[:-1], -1)

    def rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for a few fp32 rows (:data:`SMALL_ROWS`), in blocks of weight rows.

        Verification in self-speculative decoding, KV recomputation and small decoding
        batches multiply 2-8 rows. MKL and OpenBLAS pack the whole weight matrix for such a
        GEMM, so it costs 3-5 GEMVs; OpenBLAS' small-matrix kernel, which needs no packing,
        only takes products of at most ~1e6 multiply-adds. Cutting the weight into blocks of
        rows that fit brings 5 rows to ~2.5 GEMVs (docs/architecture.md "CPU fast paths").
        """
        self.sync_threads()
        x2 = x.detach().reshape(-1, x.shape[-1])
        m, k = x2.shape
        n = weight.shape[0]
        xn = x2.numpy()
        # a strided view: for a column-major weight (backend.layout) each block's transpose
        # is a contiguous slice of the (in, out) matrix, for a row-major one a transposed
        # block; OpenBLAS takes either without a copy
        w = weight.detach().numpy()
        out = np.empty((m, n), dtype=np.float32)
        block = row_block(m, k)
        for a in range(0, n, block):
            np.matmul(xn, w[a : a + block].T, out=out[:, a : a + block])
        return torch.from_numpy(out).view(*x.shape[:-1], n)


BLAS = OpenBlas()
"""The process's numpy OpenBLAS (its thread count is library state, so there is one)."""


def gemv_bound(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether batch-1 decoding of weights of ``dtype`` on ``device`` runs its GEMVs through
    numpy's OpenBLAS (see :func:`thread_split`)."""
    return BLAS.enabled and dtype == torch.float32 and device.type == "cpu"


@contextmanager
def thread_split(torch_threads: int, blas_threads: int) -> Iterator[None]:
    """Run with ``torch_threads`` intra-op threads for torch and ``blas_threads`` for the
    OpenBLAS products of the backend (restored afterwards).

    Batch-1 fp32 decoding gives the threads to OpenBLAS and leaves torch one: a step's other
    ops are far too small to split, and with two OpenMP threads torch's idle worker spins on
    the core OpenBLAS' worker needs (decoding ~8x slower on 2 cores).
    """
    n = torch.get_num_threads()
    prev = BLAS.threads_override
    BLAS.threads_override = blas_threads
    if torch_threads != n:
        torch.set_num_threads(torch_threads)
    try:
        yield
    finally:
        if torch_threads != n:
            torch.set_num_threads(n)
        BLAS.threads_override = prev
