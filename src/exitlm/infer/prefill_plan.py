"""How the engine prefills the prompts it admits in one step: padded groups of similar
lengths, and prompts that share their start with another one prefilled once.

* :func:`prefill_groups`: prompts sorted by length go in right-padded batches whose padding
  stays bounded.
* A prompt's start already in the cache is copied, not recomputed: causal attention makes
  the keys and values of positions ``[0, m)`` depend on tokens ``[0, m)`` only, so a running
  sequence whose prompt starts with the same ``m`` tokens holds exactly what this prompt's
  prefill would write there (vLLM's automatic prefix caching, on the engine's contiguous
  rows). :func:`plan_prefill` copies from a running row when the shared start is at least
  :data:`MIN_SHARED_PREFIX` positions (or the whole prompt but its last position), and
  prefills a prompt that several new requests share (``n`` choices) once for them.

Each row still prefills at least its prompt's last position itself: that position's logits
give its first token, sampled with the row's own options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFILL_PADDING = 1.25
"""Prompts prefilled together may hold at most this many padded positions per real one."""
MIN_SHARED_PREFIX = 32
"""The fewest positions copied from a running sequence whose prompt starts alike (a prompt
that is the same but for nothing is copied whatever its length): copies of fewer would split
the step's prefill into more, smaller batches for little arithmetic saved."""

Held = Sequence[tuple[int, Sequence[int]]]
"""The running rows a prompt's start may be copied from: ``(row, prompt ids)`` pairs."""


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING
                   ) -> list[tuple[int, int]]:
    """Split prompts sorted by length into ranges ``[a, b)`` prefilled as one right-padded
    batch each: a range grows while its padded size (count x longest) stays within
    ``padding`` x its real tokens. Mixed lengths would otherwise pay for the longest prompt in
    every row (e.g. 14, 67, 424 and 17 tokens: 1696 positions for 522 real ones)."""
    groups: list[tuple[int, int]] = []
    a, total = 0, 0
    for i, n in enumerate(lengths):
        if i > a and (i - a + 1) * n > padding * (total + n):
            groups.append((a, i))
            a, total = i, 0
        total += n
    if lengths:
        groups.append((a, len(lengths)))
    return groups


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def held_start(prompt: Sequence[int], held: Held, min_prefix: int = MIN_SHARED_PREFIX
               ) -> tuple[int, int] | None:
    """``(row, m)``: the running row whose prompt shares the longest start with ``prompt``
    and how many positions of it to copy - at most all but ``prompt``'s last - when that is
    at least ``min_prefix`` or all but the last; ``None`` otherwise."""
    best: tuple[int, int] | None = None
    last = len(prompt) - 1
    for row, ids in held:
        m = min(common_prefix(prompt, ids), last)
        if m > 0 and (m >= min_prefix or m == last) and (best is None or m > best[1]):
            best = (row, m)
    return best


@dataclass(frozen=True)
class PrefillPart:
    """Rows ``[a, b)`` of the admission order prefilled as one batch, each holding its
    prompt's first ``start`` positions beforehand: copied from the running row ``source``,
    or (``source`` ``None``, ``start`` > 0: rows of one prompt) filled into row ``a`` first
    and copied to the others."""

    a: int
    b: int
    start: int = 0
    source: int | None = None


def plan_prefill(prompts: Sequence[Sequence[int]], held: Held = (), *, share: bool = True,
                 min_prefix: int = MIN_SHARED_PREFIX) -> tuple[list[int], list[PrefillPart]]:
    """The order in which to admit ``prompts`` (indices into it) and the parts that prefill
    them. The requests of one prompt sit together: several of one prompt of two tokens or
    more prefill it once, and all of them start from a running row's copy when one holds
    enough of it (:func:`held_start`), the prompts copying the same start in batches of their
    rests' lengths; the others follow sorted by length, in :func:`prefill_groups`.
    ``share=False``: every prompt whole, sorted by length."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts if share else ()):
        by_prompt.setdefault(tuple(p), []).append(i)
    order: list[int] = []
    parts: list[PrefillPart] = []
    copied: dict[tuple[int, int], list[int]] = {}  # (row, start) -> the prompts that copy it
    for key, idx in by_prompt.items():
        start = held_start(key, held, min_prefix)
        if start is not None:
            copied.setdefault(start, []).extend(idx)
        elif len(idx) > 1 and len(key) > 1:
            parts.append(PrefillPart(len(order), len(order) + len(idx), len(key) - 1))
            order += idx
    for (row, start), idx in copied.items():  # one batch per copy, its rests padded alike
        idx.sort(key=lambda i: len(prompts[i]))
        parts += [PrefillPart(len(order) + a, len(order) + b, start, row) for a, b in
                  prefill_groups([len(prompts[i]) - start for i in idx])]
        order += idx
    taken = set(order)
    rest = sorted((i for i in range(len(prompts)) if i not in taken),
                  key=lambda i: len(prompts[i]))
    parts += [PrefillPart(len(order) + a, len(order) + b) for a, b in
              prefill_groups([len(prompts[i]) for i in rest])]
    return order + rest, parts


__all__ = ["MIN_SHARED_PREFIX", "PREFILL_PADDING", "PrefillPart", "common_prefix", "held_start",
           "plan_prefill", "prefill_groups"]
