"""Token frequency ranking for draft vocabularies: counts, ranks, the corpus measurement cached
once per tokenizer and corpus, and a loaded model given the order when it drafts over fewer
ids than its vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _ee_models import ee_model
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.io import token_order
from exitlm.io.corpus import DataConfig


def test_counts_and_rank() -> None:
    tok = byte_level_tokenizer()
    counts = token_order.count_tokens(tok.encode, ["aab", "ba", "c"], 256)
    assert counts[ord("a")] == 3 and counts[ord("b")] == 2 and counts[ord("c")] == 1
    order = token_order.rank(counts)
    assert order[:3].tolist() == [ord("a"), ord("b"), ord("c")]
    assert order[3:5].tolist() == [0, 1]  # unseen ids follow, lowest first
    assert sorted(order.tolist()) == list(range(256))
    # the budget stops counting
    assert int(token_order.count_tokens(tok.encode, ["aaaa", "bbbb"], 256, 5).sum()) == 5


def test_corpus_order_is_measured_once_and_cached(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"f{i}.txt").write_text("zzzz yy x " * (i + 1))
    data = DataConfig(paths=(str(docs),))
    tok = byte_level_tokenizer()
    cache = tmp_path / "cache"
    order = token_order.corpus_token_order(tok, 256, data, cache=cache)
    assert order[:4].tolist() == [ord("z"), ord(" "), ord("y"), ord("x")]
    files = list((cache / "token_order").glob("*.safetensors"))
    assert len(files) == 1

    def boom(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError("counted again")

    monkeypatch.setattr(token_order, "count_tokens", boom)
    assert torch.equal(token_order.corpus_token_order(tok, 256, data, cache=cache), order)
    # a damaged cache file is measured again
    files[0].write_bytes(b"not safetensors")
    monkeypatch.undo()
    assert torch.equal(token_order.corpus_token_order(tok, 256, data, cache=cache), order)
    # another corpus is another entry
    token_order.corpus_token_order(tok, 256, DataConfig(paths=(str(docs / "f0.txt"),)),
                                   cache=cache)
    assert len(list((cache / "token_order").glob("*.safetensors"))) == 2


def test_rank_model_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ee_model(every_layer=True)
    v = model.config.vocab_size
    calls = []

    def fake(tokenizer: object, vocab: int, *a: object, **k: object) -> torch.Tensor:
        calls.append(vocab)
        return torch.arange(vocab).flip(0)

    monkeypatch.setattr(token_order, "corpus_token_order", fake)
    assert not token_order.rank_model_tokens(model, object(), None)  # no draft vocabulary
    assert not token_order.rank_model_tokens(model, object(), v)  # the whole vocabulary
    assert not token_order.rank_model_tokens(model, None, 5)  # nothing to rank with
    assert model.token_order is None and not calls
    assert token_order.rank_model_tokens(model, object(), 5)
    assert model.draft_ids(2).tolist() == [v - 1, v - 2] and calls == [v]
    assert token_order.rank_model_tokens(model, object(), 5) and calls == [v]  # kept
