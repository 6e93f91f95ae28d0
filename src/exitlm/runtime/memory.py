"""Where a CPU model's weights live: one arena of transparent huge pages.

Decoding one token on a CPU streams every weight of the model from memory once (SmolLM2-135M:
538 MB in fp32), and on 4 KiB pages that stream crosses a page every 4 KiB: a TLB miss and a
page walk each time, ~131,000 per fp32 token, which a single core's stream cannot hide. Linux
backs an anonymous mapping advised with ``MADV_HUGEPAGE`` by 2 MiB pages (when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``): 512 times fewer
misses. torch's allocator asks for no huge pages and a checkpoint's tensors come from wherever
the loader made them, so :func:`place_weights` (called by the CPU runners'
:class:`~exitlm.runtime.products.Products` once the weights have their decoding layout) copies
a model's parameters and buffers into one 2 MiB-aligned private mapping advised for huge pages
and points each tensor at its copy (``tensor.data = ...``: the same Python objects, the same
values and strides, tensors sharing storage still share it - a tied LM head stays the input
embedding).

Left where they are: tensors off the CPU, tensors in shared memory (another process maps
them), tensors in a mapped file (a checkpoint read in place - fp32 and quantized models loaded
from safetensors: the page cache shares them between processes, which a private copy would
not, and recent kernels map such files with large folios already), and every tensor of a model
in training mode or with gradients (a model being trained: its optimizer and any wrapper may
hold views of the storage). ``EXITLM_HUGE_PAGES=0`` turns placement off.

Measured on a 2-core Sapphire Rapids VM at one thread, SmolLM2-135M: fp16 (converted at load,
so private memory) decodes 1.0-1.37x faster in huge pages, 1.15x on average, process against
process; private copies of the fp32 / int8 / int4 weights 1.05-1.1x, same process
(docs/measurements/huge_pages_2026-11-27.md).
"""

from __future__ import annotations

import bisect
import mmap
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from exitlm.env import switched_off
from exitlm.kernels.blas import PLAIN_TENSORS
from exitlm.kernels.versions import replace_data

HUGE_PAGE = 2 << 20
"""The size of an x86-64 / aarch64 transparent huge page (the arena's alignment)."""
MIN_BYTES = 8 << 20
"""Models whose weights take fewer bytes stay where they are (a few pages: nothing to win)."""
_ALIGN = 64  # each storage's copy starts on a cache line, keeping its tensors' alignment
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_arenas: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def huge_pages_available() -> bool:
    """Whether :func:`place_weights` can get huge pages here: Linux with transparent huge
    pages not set to ``never``, and ``EXITLM_HUGE_PAGES`` not ``0``."""
    if switched_off("EXITLM_HUGE_PAGES"):
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _mapped_files() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files and shared memory (sorted):
    ``/proc/self/maps`` lines with an inode."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] != "0":
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return sorted(ranges)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Each private, anonymous CPU parameter and buffer of ``model`` once: tensors in shared
    memory or in a mapped file (a safetensors checkpoint read in place) and tensor subclasses
    (a parallel layout's DTensors) are left out."""
    files = _mapped_files()
    starts = [lo for lo, _ in files]
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if (id(t) in seen or type(t) not in PLAIN_TENSORS or t.device.type != "cpu"
                or t.layout != torch.strided):
            continue
        seen.add(id(t))
        if not t.numel() or t.is_shared():
            continue
        at = bisect.bisect_right(starts, t.data_ptr()) - 1
        if at < 0 or t.data_ptr() >= files[at][1]:
            yield t


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of its storage that ``t`` reads."""
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * size
    return lo, lo + (last + 1) * size


def placed(model: nn.Module) -> bool:
    """Whether every weight :func:`place_weights` would move lies in ``model``'s arena."""
    return _inside(model, list(_tensors(model)))


def _inside(model: nn.Module, tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` all lie in ``model``'s arena."""
    arena = _arenas.get(model)
    if arena is None:
        return False
    base = arena.data_ptr()
    end = base + arena.numel()
    return all(base <= t.data_ptr() < end for t in tensors)


def place_weights(model: nn.Module, *, min_bytes: int = MIN_BYTES) -> bool:
    """Copy ``model``'s CPU weights into one huge-page arena (see the module docstring).

    Returns whether the weights now lie in an arena; a second call on a placed model copies
    nothing. Values, dtypes, shapes, strides and shared storages are kept exactly.
    """
    if (not huge_pages_available() or model.training
            or any(p.grad is not None for p in model.parameters())):
        return False
    tensors = list(_tensors(model))
    if _inside(model, tensors):
        return True
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    spans: list[tuple[list[torch.Tensor], int, int, int]] = []  # tensors, lo, hi, arena offset
    total = 0
    for ts in groups.values():
        lo = min(_extent(t)[0] for t in ts)
        lo -= lo % _ALIGN
        hi = max(_extent(t)[1] for t in ts)
        spans.append((ts, lo, hi, total))
        total += -(-(hi - lo) // _ALIGN) * _ALIGN
    if total < min_bytes:
        return False
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    arena = whole[start:start + total]
    storage = arena.untyped_storage()  # the whole mapping; offsets below count from it
    for ts, lo, hi, at in spans:
        old = torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage(), lo, (hi - lo,))
        arena[at:at + hi - lo].copy_(old)
        for t in ts:
            first = (start + at + t.storage_offset() * t.element_size() - lo) // t.element_size()
            replace_data(t, lambda data, first=first: torch.empty(0, dtype=data.dtype).set_(
                storage, first, data.shape, data.stride()))
    _arenas[model] = arena
    return True


__all__ = ["HUGE_PAGE", "MIN_BYTES", "huge_pages_available", "place_weights", "placed"]
