"""Frequency-ranked draft vocabularies (FR-Spec, arXiv 2502.14856, Sec. 3): the token ids of a
tokenizer ordered by how often they occur in a corpus.

A draft head over a model's ``N`` most frequent tokens costs ``N / V`` of the full head and keeps
most of the drafts the full head would make (FR-Spec reports 75% of the draft head's cost saved
with unchanged output: verification stays the full model's). ``--draft-vocab N`` drafts over the
first ``N`` ids of :meth:`~exitlm.model.transformer.EarlyExitLM.draft_ids`; this module gives a
model that order:

* :func:`count_tokens` / :func:`rank` - counts over texts, most frequent first (ties by id);
* :func:`corpus_token_order` - the order measured on the training split of a corpus (by default
  the Python standard library's source, :mod:`exitlm.io.corpus`) with a tokenizer, computed
  once (a progress bar on stderr) and cached as ``$EXITLM_CACHE/token_order/<key>.safetensors``
  keyed by the tokenizer's vocabulary, the corpus and the token budget;
* :func:`rank_model_tokens` - puts that order on a loaded model when it drafts over fewer ids
  than its vocabulary.

Cache files are exitlm's own (written atomically, read with safetensors: never unpickled); a
damaged one is measured again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from exitlm.io.corpus import DataConfig, is_held_out, iter_documents
from exitlm.io.default_model import cache_root
from exitlm.io.dirs import ensure_dir
from exitlm.paths import atomic_file

MAX_TOKENS = 2_000_000
"""Tokens counted at most (the training split of the standard library holds ~20M; the
ranking of the frequent head of the vocabulary settles long before)."""
FORMAT = 1


def count_tokens(encode: Any, texts: Iterable[str], vocab_size: int,
                 max_tokens: int = MAX_TOKENS, progress: Any = None) -> torch.Tensor:
    """Occurrences ``(V,)`` int64 of every token id in ``texts`` encoded by ``encode``
    (``str -> list[int]``), stopping after ``max_tokens`` tokens; ``progress`` (a tqdm bar or
    None) is advanced by the tokens counted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    seen = 0
    for text in texts:
        ids = [i for i in encode(text) if 0 <= i < vocab_size][: max_tokens - seen]
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)
            seen += len(ids)
            if progress is not None:
                progress.update(len(ids))
        if seen >= max_tokens:
            break
    return counts


def rank(counts: torch.Tensor) -> torch.Tensor:
    """Token ids from the most to the least frequent (equal counts: lower id first)."""
    return torch.sort(-counts.to(torch.int64), stable=True).indices


def _key(tokenizer: Any, vocab_size: int, data: DataConfig, max_tokens: int) -> str:
    """The cache key: the tokenizer's full description, the vocabulary size, the corpus and
    the budget."""
    tk = getattr(tokenizer, "tk", None)
    desc = tk.to_str() if tk is not None and hasattr(tk, "to_str") else repr(tokenizer)
    meta = json.dumps({"format": FORMAT, "vocab": vocab_size, "paths": list(data.paths),
                       "val": data.val_fraction, "seed": data.seed, "max": max_tokens,
                       "text_field": data.text_field}, sort_keys=True)
    return hashlib.sha256((desc + meta).encode()).hexdigest()[:32]


def corpus_token_order(tokenizer: Any, vocab_size: int, data: DataConfig | None = None, *,
                       max_tokens: int = MAX_TOKENS, cache: Path | None = None) -> torch.Tensor:
    """The token ids of ``tokenizer`` ranked by frequency on the training split of ``data``
    (default: the standard library), from the cache when it holds them (see the module
    docstring)."""
    from tqdm import tqdm

    data = data or DataConfig()
    folder = (cache or cache_root()) / "token_order"
    path = folder / f"{_key(tokenizer, vocab_size, data, max_tokens)}.safetensors"
    if path.is_file():
        try:
            order = load_file(str(path))["order"]
            if order.numel() == vocab_size:
                return order.to(torch.long)
        except Exception:
            pass
    docs = (text for key, text in iter_documents(data)
            if not is_held_out(key, data.val_fraction, data.seed))
    with tqdm(total=max_tokens, desc="ranking tokens", unit="tok", leave=False,
              disable=None) as bar:
        counts = count_tokens(tokenizer.encode, docs, vocab_size, max_tokens, bar)
    order = rank(counts)
    ensure_dir(folder)
    with atomic_file(path) as tmp:
        save_file({"order": order.to(torch.int64).contiguous()}, str(tmp),
                  metadata={"format": str(FORMAT), "tokens": str(int(counts.sum()))})
    return order


def rank_model_tokens(model: Any, tokenizer: Any, draft_vocab: int | None) -> bool:
    """Give ``model`` the corpus ranking of its tokens (:func:`corpus_token_order`) when it
    drafts over fewer ids than its vocabulary and has none yet; ``False`` when there is no
    tokenizer to rank with (the draft vocabulary is then the first ids)."""
    vocab = model.config.vocab_size
    if draft_vocab is None or draft_vocab >= vocab or model.token_order is not None:
        return model.token_order is not None
    if tokenizer is None:
        return False
    model.set_token_order(corpus_token_order(tokenizer, vocab))
    return True


__all__ = ["MAX_TOKENS", "corpus_token_order", "count_tokens", "rank", "rank_model_tokens"]
