"""How the engine prefills the prompts it admits in one step: padded groups of similar
lengths, and prompts that share their start with another one prefilled once.

* :func:`prefill_groups`: prompts sorted by length go in right-padded batches whose padding
  stays bounded.
* A prompt's start already in the cache is copied, not recomputed: causal attention makes
  the keys and values of positions ``[0, m)`` depend on tokens ``[0, m)`` only, so a running
  sequence whose prompt starts with the same ``m`` tokens holds exactly what this prompt's
  prefill would write there (vLLM's automatic prefix caching, on the engine's contiguous
  rows). :func:`plan_prefill` copies from a running row when the shared start is at least
  :data:`MIN_SHARED_PREFIX` positions (or the whole prompt but its last position), and fills
  a start that several new requests share (``n`` choices of one prompt, one system prompt)
  once for them.

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
    prompt's first ``start`` positions beforehand: copied from the running row ``source``, or
    from row ``copy_of`` of the admission (an earlier part filled it), or else (both ``None``,
    ``start`` > 0) filled into row ``a`` first and copied to the others."""

    a: int
    b: int
    start: int = 0
    source: int | None = None
    copy_of: int | None = None


def alike_starts(prompts: Sequence[Sequence[int]], idx: list[int],
                 min_prefix: int = MIN_SHARED_PREFIX) -> tuple[list[tuple[int, list[int]]],
                                                              list[int]]:
    """The prompts ``idx`` in clusters that share a start - ``(m, members)``, ``m`` at least
    ``min_prefix`` positions and less than every member's length, or the members one prompt
    of two tokens or more (``m`` all but its last) - and those that share none."""
    order = sorted(idx, key=lambda i: tuple(prompts[i]))  # alike starts side by side
    clusters: list[tuple[int, list[int]]] = []
    alone: list[int] = []
    cur: list[int] = []
    m, same = 0, True

    def close() -> None:
        if len(cur) > 1:
            clusters.append((m, cur))
        else:
            alone.extend(cur)

    for i in order:
        if cur:
            prev = prompts[cur[-1]]
            joined = min(m, common_prefix(prev, prompts[i]), len(prompts[i]) - 1)
            alike = same and list(prompts[i]) == list(prev)
            if joined > 0 and (joined >= min_prefix or alike):
                cur.append(i)
                m, same = joined, alike
                continue
            close()
        cur, m, same = [i], len(prompts[i]) - 1, True
    close()
    return clusters, alone


def plan_prefill(prompts: Sequence[Sequence[int]], held: Held = (), *, share: bool = True,
                 min_prefix: int = MIN_SHARED_PREFIX) -> tuple[list[int], list[PrefillPart]]:
    """The order in which to admit ``prompts`` (indices into it) and the parts that prefill
    them. A prompt whose start a running row holds copies it (:func:`held_start`), the
    prompts copying one start in batches of their rests' lengths; prompts that share a start
    with each other (:func:`alike_starts`: the ``n`` choices of one prompt, one system prompt)
    fill it once into the first one's row and copy it; the others follow sorted by length,
    in :func:`prefill_groups`. ``share=False``: every prompt whole, sorted by length."""
    order: list[int] = []
    parts: list[PrefillPart] = []
    copied: dict[tuple[int, int], list[int]] = {}  # (row, start) -> the prompts that copy it
    rest: list[int] = []
    for i, p in enumerate(prompts):
        start = held_start(p, held, min_prefix) if share else None
        (copied.setdefault(start, []) if start is not None else rest).append(i)
    clusters, alone = alike_starts(prompts, rest, min_prefix) if share else ([], rest)
    for source, start, idx in [*((r, m, x) for (r, m), x in copied.items()),
                               *((None, m, x) for m, x in clusters)]:
        idx.sort(key=lambda i: len(prompts[i]))
        first = len(order)
        for k, (a, b) in enumerate(prefill_groups([len(prompts[i]) - start for i in idx])):
            parts.append(PrefillPart(first + a, first + b, start, source,
                                     None if source is not None or k == 0 else first))
        order += idx
    alone.sort(key=lambda i: len(prompts[i]))
    parts += [PrefillPart(len(order) + a, len(order) + b) for a, b in
              prefill_groups([len(prompts[i]) for i in alone])]
    return order + alone, parts


__all__ = ["MIN_SHARED_PREFIX", "PREFILL_PADDING", "PrefillPart", "alike_starts", "common_prefix",
           "held_start", "plan_prefill", "prefill_groups"]
