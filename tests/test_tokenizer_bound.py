"""``Tokenizer.token_bound``: the token count it promises from a text's size is never more
than the tokenizer's real count (byte-level BPE with long tokens and missing bytes, byte
fallback, a shrinking normalizer), and tokenizers that can drop text get no bound;
``encode_batch`` equals ``encode``."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import models, normalizers, pre_tokenizers

from exitlm.infer.cli import byte_level_tokenizer
from exitlm.tokenizer import Tokenizer, byte_level_alphabet

PIECES = ["\n" + " " * 40, "\x04", chr(0x50000), "日本", "héllo", " the", "<|im_start|>",
          "1234", "\t\t", "ＡＢ", "𝐀", "e\u0301", "ﬃ", " "]


def _byte_level_bpe(drop: set[int]) -> Tokenizer:
    """Byte-level BPE over every byte but ``drop``, with a 41-byte whitespace token."""
    char_of = byte_level_alphabet()
    vocab = {char_of[b]: i for i, b in enumerate(b for b in range(256) if b not in drop)}
    merges = []
    run = char_of[ord("\n")]
    for _ in range(40):  # "\n" then spaces, one merge at a time
        merges.append((run, char_of[ord(" ")]))
        run += char_of[ord(" ")]
        vocab[run] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.add_special_tokens(["<|im_start|>"])
    return Tokenizer(tk)


def _byte_fallback_nfkc() -> Tokenizer:
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "A": 258,
             "▁the": 259}
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                         byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    return Tokenizer(tk)


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 80))) for _ in range(200)]


@pytest.mark.parametrize("make", [lambda: _byte_level_bpe(set()),
                                  lambda: _byte_level_bpe({4, 6, 0xF1}),
                                  _byte_fallback_nfkc, byte_level_tokenizer])
def test_bound_never_exceeds_the_real_count(make: object) -> None:
    tok = make()  # type: ignore[operator]
    bound = tok.token_bound()
    assert bound is not None
    for text in _texts(0):
        real = len(tok.encode(text))
        for limit in (0, real, 10**9):  # the cheap path and the exact one
            assert bound.min_tokens(text, limit) <= real, (text, bound)
    assert tok.encode_batch(_texts(1)[:20]) == [tok.encode(t) for t in _texts(1)[:20]]


def test_bound_sizes() -> None:
    assert byte_level_tokenizer().token_bound().bytes_per_token == 1  # type: ignore[union-attr]
    full = _byte_level_bpe(set()).token_bound()
    assert full is not None and full.bytes_per_token == 41 and not full.lost
    holes = _byte_level_bpe({4, 6, 0xF1}).token_bound()
    assert holes is not None and holes.lost == "\x04\x06" and holes.lost_leads
    assert holes.bytes_per_token == 41
    text = "\x04" * 1000 + "ab"  # the dropped characters do not count
    assert holes.min_tokens(text, 10) == 1 <= len(_byte_level_bpe({4, 6, 0xF1}).encode(text))
    four = chr(0x50000) * 41  # 164 bytes, each character losing its lead byte: 123 kept
    assert holes.min_tokens(four, 10) == 3 <= len(_byte_level_bpe({4, 6, 0xF1}).encode(four))
    assert _byte_fallback_nfkc().token_bound().bytes_per_token == 4 * 6  # type: ignore[union-attr]


def test_tokenizers_that_drop_text_have_no_bound() -> None:
    wordpiece = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert Tokenizer(wordpiece).token_bound() is None
    stripped = _byte_level_bpe(set()).tk
    stripped.normalizer = normalizers.Strip()
    assert Tokenizer(stripped).token_bound() is None
    # a byte-level vocabulary without a UTF-8 continuation byte can lose whole characters
    assert _byte_level_bpe({0x80}).token_bound() is None
    assert _byte_level_bpe({0xC3}).token_bound() is None
    no_unk = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    assert Tokenizer(no_unk).token_bound() is None
