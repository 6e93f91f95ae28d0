"""ROUGE-L (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries", Sec. 3): the
longest common subsequence of candidate and reference tokens, as precision ``LCS/|cand|``,
recall ``LCS/|ref|`` and F-measure ``(1 + b^2) P R / (R + b^2 P)`` (``b = 1``: F1).

The benchmarks compare each strategy's continuation with the autoregressive one, so texts are
code as often as prose: :func:`words` splits into identifier/number runs and single
punctuation characters, whitespace dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_TOKEN = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """ROUGE tokens of ``text``: runs of word characters and single punctuation marks."""
    return _TOKEN.findall(text)


def lcs_length(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the longest common subsequence (dynamic programming, ``O(|a| |b|)`` time,
    ``O(min(|a|, |b|))`` memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, start=1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class RougeL:
    precision: float
    recall: float
    f: float


def rouge_l_tokens(candidate: Sequence[object], reference: Sequence[object],
                   beta: float = 1.0) -> RougeL:
    """ROUGE-L of two token sequences; two empty sequences agree perfectly (1.0)."""
    if not candidate and not reference:
        return RougeL(1.0, 1.0, 1.0)
    if not candidate or not reference:
        return RougeL(0.0, 0.0, 0.0)
    lcs = lcs_length(candidate, reference)
    p, r = lcs / len(candidate), lcs / len(reference)
    if lcs == 0:
        return RougeL(0.0, 0.0, 0.0)
    f = (1 + beta**2) * p * r / (r + beta**2 * p)
    return RougeL(p, r, f)


def rouge_l(candidate: str, reference: str, beta: float = 1.0) -> RougeL:
    """ROUGE-L of two texts over :func:`words`."""
    return rouge_l_tokens(words(candidate), words(reference), beta)
