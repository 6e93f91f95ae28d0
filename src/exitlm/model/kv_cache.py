"""Preallocated key/value cache with per-sequence lengths and per-layer fill positions.

Layout convention (exitlm-wide): **the token at position ``p`` of a sequence lives in cache
slot ``p``.** Prompts of different lengths are therefore *right*-padded: a batch's pad tokens
occupy slots past each sequence's length, no query ever attends to a slot after its own
position, and the next real token overwrites the pad slot. Nothing padded is ever attended.

Two kinds of bookkeeping are kept:

* ``lengths[b]`` - how many tokens sequence ``b`` has committed (the next token's position);
* ``fill[slot, b]`` - how many positions of sequence ``b`` have valid keys/values in cache slot
  ``slot`` (a backbone layer or an exit block). Early exiting leaves deep layers behind the
  shallow ones (EE-LLM Sec. 4.1); KV recomputation reads ``fill`` to know which positions still
  have to be run through which layers.

``crop`` rolls both back, which is all speculative decoding needs on rejection: stale entries
past the new length are simply overwritten later.

A serving engine keeps one cache as a pool of rows (one per running sequence): ``rows(lo,
hi)`` is a cache over rows ``[lo, hi)`` sharing the pool's storage (its ``lengths`` and
``fill`` are views too, assigned in place), ``move_row`` compacts the pool when a sequence
leaves, and ``resize`` grows it when longer sequences arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WritePlan:
    """Where one forward pass writes its keys/values (see :meth:`KVCache.plan`)."""

    end: int
    start: int
    length: int
    index: torch.Tensor | None
    new_fill: torch.Tensor


class KVCache:
    """Key/value tensors of shape ``(batch, kv_heads, max_seq_len, head_dim)`` per slot."""

    def __init__(
        self,
        num_slots: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(
                f"KVCache needs batch_size > 0 and max_seq_len > 0, got {batch_size}, "
                f"{max_seq_len}"
            )
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self._lengths = torch.zeros(batch_size, dtype=torch.long)
        self._fill = torch.zeros(num_slots, batch_size, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return len(self.keys)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` committed tokens per sequence (the next token's position); assignments
        are copied in place, so a :meth:`rows` view updates its pool."""
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self._lengths.copy_(value)

    @property
    def fill(self) -> torch.Tensor:
        """``(slots, B)`` valid leading positions per slot and sequence (assigned in place)."""
        return self._fill

    @fill.setter
    def fill(self, value: torch.Tensor) -> None:
        self._fill.copy_(value)

    # ----- a pool of rows ----------------------------------------------------------------------
    def rows(self, lo: int, hi: int) -> KVCache:
        """A cache over rows ``[lo, hi)`` that shares this one's storage and bookkeeping: the
        same view object each time until :meth:`resize` reallocates (a runner keeps what it
        prepared for a cache's tensors, e.g. the native calls of a run of layers, while they
        are the same objects; an engine asks for its rows at every step)."""
        if not 0 <= lo < hi <= self.batch_size:
            raise ValueError(f"rows [{lo}, {hi}) outside the cache's {self.batch_size} rows")
        views: dict[tuple[int, int], KVCache] = self.__dict__.setdefault("_views", {})
        view = views.get((lo, hi))
        if view is not None:
            return view
        if len(views) >= 64:  # batches come and go
            views.clear()
        view = views[(lo, hi)] = KVCache.__new__(KVCache)
        view.keys = [k[lo:hi] for k in self.keys]
        view.values = [v[lo:hi] for v in self.values]
        view.batch_size = hi - lo
        view.max_seq_len = self.max_seq_len
        view._lengths = self._lengths[lo:hi]
        view._fill = self._fill[:, lo:hi]
        return view

    def spliced(self, lower: KVCache, n: int) -> KVCache:
        """A cache whose first ``n`` slots are ``lower``'s (same rows) and the others this
        one's, sharing this cache's bookkeeping (``lengths``, ``fill``). PPD's branch worker
        keeps the layers its branches read in shared memory
        (:mod:`exitlm.infer.executors.ppd_worker`)."""
        if lower.batch_size != self.batch_size or not 0 <= n <= min(lower.num_slots,
                                                                     self.num_slots):
            raise ValueError(f"cannot splice {n} slots of a {lower.batch_size}-row cache into "
                             f"a {self.batch_size}-row cache")
        view = KVCache.__new__(KVCache)
        view.keys = [*lower.keys[:n], *self.keys[n:]]
        view.values = [*lower.values[:n], *self.values[n:]]
        view.batch_size = self.batch_size
        view.max_seq_len = min(self.max_seq_len, lower.max_seq_len)
        view._lengths = self._lengths
        view._fill = self._fill
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` (its first ``max(fill)`` positions and bookkeeping) to ``dst``."""
        n = int(self._fill[:, src].max()) if self.num_slots else 0
        n = max(n, int(self._lengths[src]))
        for t in (*self.keys, *self.values):
            t[dst, :, :n] = t[src, :, :n]
        self._lengths[dst] = self._lengths[src]
        self._fill[:, dst] = self._fill[:, src]

    def copy_prefix(self, src: int, lo: int, hi: int, n: int) -> None:
        """Rows ``[lo, hi)`` hold row ``src``'s first ``n`` positions, and only them: length
        ``n``, each slot filled as far as ``src``'s is, at most ``n`` (a prompt prefilled once
        for several sequences; ``src``, outside the range, holds at least ``n``)."""
        if not 0 <= n <= int(self._lengths[src]) or lo <= src < hi:
            raise ValueError(f"cannot copy {n} positions of row {src} (holding "
                             f"{int(self._lengths[src])}) into rows [{lo}, {hi})")
        for t in (*self.keys, *self.values):
            t[lo:hi, :, :n] = t[src : src + 1, :, :n]
        self._lengths[lo:hi] = n
        self._fill[:, lo:hi] = self._fill[:, src : src + 1].clamp(max=n)

    def clear_row(self, row: int) -> None:
        """Forget row ``row`` (length and fill 0; its entries are overwritten later)."""
        self._lengths[row] = 0
        self._fill[:, row] = 0

    def resize(self, batch_size: int, max_seq_len: int) -> None:
        """Reallocate to ``batch_size`` rows x ``max_seq_len`` positions, keeping what fits."""
        if batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(f"resize needs positive sizes, got {batch_size}, {max_seq_len}")
        if (batch_size, max_seq_len) == (self.batch_size, self.max_seq_len):
            return
        b, s = min(batch_size, self.batch_size), min(max_seq_len, self.max_seq_len)

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(batch_size, t.shape[1], max_seq_len, t.shape[3])
            out[:b, :, :s] = t[:b, :, :s]
            return out

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        self.__dict__.pop("_views", None)  # views of the old storage
        lengths = torch.zeros(batch_size, dtype=torch.long)
        lengths[:b] = self._lengths[:b].clamp(max=max_seq_len)
        fill = torch.zeros(self.num_slots, batch_size, dtype=torch.long)
        fill[:, :b] = self._fill[:, :b].clamp(max=max_seq_len)
        self._lengths, self._fill = lengths, fill
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def put(
        self, slot: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store ``k, v`` ``(n, Hkv, T, D)`` at ``positions`` ``(n, T)`` of ``rows`` ``(n,)``
        (``fill`` is the caller's to update)."""
        kc, vc = self.keys[slot], self.values[slot]
        r = rows.to(kc.device)[:, None]
        p = positions.to(kc.device)
        kc[r, :, p] = k.transpose(1, 2).to(kc.dtype)  # indexed view is (n, T, Hkv, D)
        vc[r, :, p] = v.transpose(1, 2).to(vc.dtype)

    def copy_from(self, src: KVCache, slots: int, positions: int | slice) -> None:
        """Copy ``positions`` of the first ``slots`` slots of ``src`` (same rows) into this
        cache (PPD shares each new entry between its caches)."""
        for i in range(slots):
            self.keys[i][:, :, positions] = src.keys[i][:, :, positions]
            self.values[i][:, :, positions] = src.values[i][:, :, positions]

    def plan(self, positions: torch.Tensor) -> WritePlan:
        """Precompute how a forward over ``positions`` ``(B, T)`` writes into every slot.

        Done once per forward (not per layer): a batch whose sequences all write the same
        contiguous range uses a slice assignment, anything else a scatter.
        """
        if positions.dim() != 2 or positions.shape[0] != self.batch_size:
            raise ValueError(
                f"positions must have shape (batch={self.batch_size}, T), got "
                f"{tuple(positions.shape)}"
            )
        one = positions.numel() == 1  # one sequence's next token: the common decoding step
        end = (int(positions) if one else int(positions.max())) + 1
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: position {end - 1} does not fit max_seq_len "
                f"{self.max_seq_len}; allocate a larger cache (max_seq_len) or generate fewer "
                "tokens"
            )
        if one:
            return WritePlan(end=end, start=end - 1, length=1, index=None,
                             new_fill=torch.tensor([end]))
        t = positions.shape[1]
        first = positions[:, :1]
        aligned = bool(
            (positions == first[:1] + torch.arange(t, device=positions.device)).all()
        )
        new_fill = positions.max(dim=1).values.cpu() + 1
        if aligned:
            return WritePlan(end=end, start=int(first[0, 0]), length=t, index=None,
                             new_fill=new_fill)
        return WritePlan(end=end, start=-1, length=t, index=positions, new_fill=new_fill)

    def write(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, plan: WritePlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``(B, Hkv, T, D)`` as ``plan`` says and return the views to attend
        to: slots ``[0, plan.end)`` of every sequence."""
        kc, vc = self.keys[slot], self.values[slot]
        if plan.index is None:
            kc[:, :, plan.start : plan.start + plan.length] = k
            vc[:, :, plan.start : plan.start + plan.length] = v
        else:
            idx = plan.index.to(kc.device)[:, None, :, None].expand(
                -1, k.shape[1], -1, k.shape[3]
            )
            kc.scatter_(2, idx, k.to(kc.dtype))
            vc.scatter_(2, idx, v.to(vc.dtype))
        torch.maximum(self.fill[slot], plan.new_fill, out=self.fill[slot])
        return kc[:, :, : plan.end], vc[:, :, : plan.end]

    def crop(self, lengths: torch.Tensor | int) -> None:
        """Roll every sequence back to ``lengths`` tokens (speculative-decoding rejection)."""
        if isinstance(lengths, int):
            lengths = torch.full((self.batch_size,), lengths, dtype=torch.long)
        lengths = lengths.to(torch.long).cpu()
        if lengths.shape != (self.batch_size,) or bool((lengths < 0).any()):
            raise ValueError(f"crop needs {self.batch_size} non-negative lengths, got {lengths}")
        torch.minimum(self._lengths, lengths, out=self._lengths)
        torch.minimum(self._fill, lengths[None, :], out=self._fill)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
