"""The engine's pool of KV rows: one KV cache whose rows hold the running sequences, plus the
per-row buffers a decoder asks for (KV recomputation's hidden states).

**Contiguous rows with compaction** (not paged blocks): the running sequences always occupy
rows ``[0, n)``, so every decoding step runs over a plain view of the pool - no gather of keys
and values per layer. A sequence that leaves hands its row to the last running one (one copy
of that sequence's entries, once), and new sequences take rows ``n, n+1, ...``.

**Sized to need.** The pool starts empty and grows - rows up to the engine's ``max_batch``,
positions up to its ``max_seq_len`` (the model's context at most) plus the speculation
lookahead - by doubling, as longer or more sequences arrive; it never grows per generated
token. A single long sequence makes every row that long (the price of contiguous rows).
"""

from __future__ import annotations

import torch

from exitlm.infer.decoder import Batch, Seq
from exitlm.model.kv_cache import KVCache
from exitlm.runtime.runner import Runner

_ALIGN = 64  # positions are allocated in multiples of this


class SlotPool:
    """KV rows and per-row buffers for at most ``max_rows`` sequences of ``max_len``
    positions each (see the module docstring)."""

    def __init__(self, runner: Runner, aux_dims: dict[str, int], max_rows: int,
                 max_len: int) -> None:
        self.runner = runner
        self.aux_dims = dict(aux_dims)
        self.max_rows = max_rows
        self.max_len = max_len
        self.cache: KVCache | None = None
        self.aux: dict[str, torch.Tensor] = {}

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else self.cache.batch_size

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.max_seq_len

    def ensure(self, rows: int, length: int) -> None:
        """Make room for ``rows`` sequences of ``length`` positions (growing by doubling)."""
        if rows > self.max_rows or length > self.max_len:
            raise ValueError(f"the pool holds at most {self.max_rows} rows x {self.max_len} "
                             f"positions, asked for {rows} x {length}")
        if rows <= self.rows and length <= self.length:
            return
        new_rows = min(self.max_rows, max(rows, 2 * self.rows))
        new_len = self.length
        if length > new_len:
            new_len = max(length, 2 * new_len)
            new_len = min(self.max_len, -(-new_len // _ALIGN) * _ALIGN)
        if self.cache is None:
            self.cache = self.runner.new_cache(new_rows, new_len)
        else:
            self.runner.release(self.cache)  # what the runner kept for the old storage
            self.cache.resize(new_rows, new_len)
        for name, dim in self.aux_dims.items():
            old = self.aux.get(name)
            buf = torch.zeros(new_rows, new_len, dim, dtype=self.runner.dtype,
                              device=self.runner.device)
            if old is not None:
                buf[: old.shape[0], : old.shape[1]] = old[:new_rows, :new_len]
            self.aux[name] = buf

    def batch(self, lo: int, hi: int, seqs: list[Seq]) -> Batch:
        """The decoder's view of rows ``[lo, hi)`` holding ``seqs``."""
        assert self.cache is not None and len(seqs) == hi - lo
        return Batch(seqs, self.cache.rows(lo, hi), {k: v[lo:hi] for k, v in self.aux.items()})

    def copy_prefix(self, src: int, lo: int, hi: int, n: int) -> None:
        """Rows ``[lo, hi)`` hold the first ``n`` positions of row ``src`` (a prompt
        prefilled once for several sequences, :meth:`KVCache.copy_prefix`)."""
        assert self.cache is not None
        self.cache.copy_prefix(src, lo, hi, n)

    def move_row(self, src: int, dst: int) -> None:
        """Sequence in row ``src`` moves to row ``dst`` (which it overwrites)."""
        assert self.cache is not None
        self.cache.move_row(src, dst)
        for buf in self.aux.values():
            buf[dst] = buf[src]
        self.cache.clear_row(src)

    def clear_row(self, row: int) -> None:
        if self.cache is not None:
            self.cache.clear_row(row)

    def drop(self) -> None:
        """Forget the pool (the runner releases what it kept for it)."""
        if self.cache is not None:
            self.runner.release(self.cache)
        self.cache = None
        self.aux = {}

    def nbytes(self) -> int:
        kv = 0 if self.cache is None else self.cache.nbytes()
        return kv + sum(b.numel() * b.element_size() for b in self.aux.values())
