"""ROUGE-L (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries", Sec. 3) through
Google's ``rouge-score`` package: the longest common subsequence of candidate and reference
tokens, as precision ``LCS/|cand|``, recall ``LCS/|ref|`` and F1.

The benchmarks compare continuations that are code as often as prose, so the tokenizer handed
to ``rouge-score`` is exitlm's :func:`words` (runs of word characters and single punctuation
marks, whitespace dropped, case kept) instead of the package's default (lower-cased
alphanumeric runs, punctuation dropped), which would call ``f(x)`` and ``f[x]`` identical.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rouge_score import rouge_scorer

_TOKEN = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """ROUGE tokens of ``text``: runs of word characters and single punctuation marks."""
    return _TOKEN.findall(text)


class _CodeTokenizer:
    """The ``tokenize`` interface ``rouge-score`` asks of a custom tokenizer."""

    def tokenize(self, text: str) -> list[str]:
        return words(text)


@cache
def _scorer() -> rouge_scorer.RougeScorer:
    # imported on first use: rouge-score pulls in nltk (and through it scikit-learn), ~2 s of
    # start-up for every command that imports the benchmarks
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_CodeTokenizer())


@dataclass(frozen=True)
class RougeL:
    precision: float
    recall: float
    f: float


def rouge_l(candidate: str, reference: str) -> RougeL:
    """ROUGE-L of two texts over :func:`words`; two texts without tokens agree (1.0)."""
    if not words(candidate) and not words(reference):
        return RougeL(1.0, 1.0, 1.0)
    s = _scorer().score(reference, candidate)["rougeL"]  # score(target, prediction)
    return RougeL(s.precision, s.recall, s.fmeasure)
