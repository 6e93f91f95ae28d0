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
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.fill = torch.zeros(num_slots, batch_size, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return len(self.keys)

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
        end = int(positions.max()) + 1
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: position {end - 1} does not fit max_seq_len "
                f"{self.max_seq_len}; allocate a larger cache (max_seq_len) or generate fewer "
                "tokens"
            )
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
        self.lengths = torch.minimum(self.lengths, lengths)
        self.fill = torch.minimum(self.fill, lengths[None, :])

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/reorder sequences along the batch dimension (e.g. drop finished ones)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        cpu_index = index.cpu()
        self.lengths = self.lengths.index_select(0, cpu_index)
        self.fill = self.fill.index_select(1, cpu_index)
        self.batch_size = int(index.numel())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
