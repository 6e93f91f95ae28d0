"""Token slices with gradients flowing into earlier slices' keys/values (TeraPipe Sec. 3).

TeraPipe cuts a sequence into slices ``[a_0, a_1), [a_1, a_2), ...`` and pipelines them
across stages. Slice ``s`` attends to the keys/values of every earlier slice, so in the
backward pass slice ``s`` produces gradients for those keys/values, which belong to earlier
slices' graphs. :class:`SliceKV` is a stand-in for the KV cache (same ``plan`` / ``write``
interface the attention layers already call):

* forward of slice ``s``: per cache slot, the earlier slices' keys/values are concatenated and
  *detached* into a leaf that requires grad; attention reads ``[leaf, k_s]``; ``k_s`` (still
  attached to slice ``s``'s graph) is remembered;
* backward of slice ``s`` (slices run backward in reverse order): after autograd fills the
  leaves' ``.grad``, :meth:`harvest` splits them per earlier slice and accumulates them;
* backward of slice ``s' < s``: :meth:`roots` returns ``k_{s'}``, ``v_{s'}`` with their
  accumulated gradients, to be passed to ``torch.autograd.backward`` next to the stage
  output and the loss.

So each slice's graph is traversed exactly once, as in TeraPipe, and the result equals one
backward over the whole sequence (tested against it).
"""

from __future__ import annotations

import torch

from exitlm.config import ModelConfig
from exitlm.model.kv_cache import WritePlan
from exitlm.plan.profile import profile_terapipe
from exitlm.plan.terapipe import plan_slices


class SliceKV:
    """Keys/values of one microbatch's token slices on one stage, for training."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.lengths: list[int] = []
        self.leaves: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.current = 0

    def begin(self, index: int, length: int) -> None:
        """Start the forward of slice ``index`` (slices run forward in order)."""
        if index != len(self.lengths):
            raise RuntimeError(f"token slice {index} forwarded out of order "
                               f"({len(self.lengths)} done)")
        self.current = index
        self.lengths.append(length)
        self.leaves[index] = {}

    def plan(self, positions: torch.Tensor) -> WritePlan:
        """Slices cover the same contiguous positions in every row."""
        t = positions.shape[1]
        start = int(positions[0, 0])
        end = start + t
        return WritePlan(end=end, start=start, length=t, index=None,
                         new_fill=torch.full((positions.shape[0],), end, dtype=torch.long))

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor,
              plan: WritePlan) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys.setdefault(slot, [])
        values = self.values.setdefault(slot, [])
        if len(keys) != self.current:
            raise RuntimeError(f"cache slot {slot} wrote twice in token slice {self.current}")
        keys.append(k)
        values.append(v)
        if self.current == 0:
            return k, v
        lk = torch.cat([t.detach() for t in keys[:-1]], dim=2).requires_grad_()  # (B,H,Tp,D)
        lv = torch.cat([t.detach() for t in values[:-1]], dim=2).requires_grad_()
        self.leaves[self.current][slot] = (lk, lv)
        return torch.cat((lk, k), dim=2), torch.cat((lv, v), dim=2)

    def harvest(self, index: int) -> None:
        """After slice ``index``'s backward: keep the gradients its attention sent to the
        keys/values of earlier slices."""
        sizes = self.lengths[:index]
        for slot, (lk, lv) in self.leaves.pop(index, {}).items():
            for leaf, which in ((lk, 0), (lv, 1)):
                if leaf.grad is None:
                    continue
                for s, g in enumerate(leaf.grad.split(sizes, dim=2)):
                    acc = self.grads.setdefault((slot, s), [None, None])  # type: ignore[list-item]
                    acc[which] = g if acc[which] is None else acc[which] + g

    def roots(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tensors of slice ``index``'s graph that later slices sent gradients to, and those
        gradients (for ``torch.autograd.backward``)."""
        tensors, grads = [], []
        for slot in self.keys:
            acc = self.grads.pop((slot, index), None)
            if acc is None:
                continue
            for t, g in ((self.keys[slot][index], acc[0]), (self.values[slot][index], acc[1])):
                if g is not None and t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
        return tensors, grads

    def release(self, index: int) -> None:
        """Drop slice ``index``'s graph references after its backward (every later slice
        has run forward by then and holds detached copies)."""
        for store in (self.keys, self.values):
            for lst in store.values():
                if index < len(lst):
                    lst[index] = lst[index].detach()


def plan_token_slices(cfg: ModelConfig, seq_len: int, stages: int, *,
                      threads: int | None = 1) -> tuple[int, ...]:
    """TeraPipe's optimal slicing (Alg. 1, Eq. 5-8) for one stage of ``cfg`` on this machine:
    the per-stage forward time ``t(l, c)`` is measured and fitted (Eq. 9, see
    :func:`exitlm.plan.profile.profile_terapipe`), then solved by the exact dynamic program
    of :func:`exitlm.plan.terapipe.plan_slices`. The plan is made for one row: the rows of a
    microbatch scale every slice alike."""

    perf, _ = profile_terapipe(cfg, seq_len, stages, threads=threads)
    plan = plan_slices(perf.matrix(), stages, method="bisect")
    return tuple(int(x) for x in plan["slices"])  # type: ignore[union-attr]
