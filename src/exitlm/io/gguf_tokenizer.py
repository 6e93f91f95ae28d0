"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the vocabulary, merges, token types and
special-token ids as metadata (``tokenizer.ggml.*``). For byte-level BPE vocabularies
(``tokenizer.ggml.model == "gpt2"``) that is enough to rebuild the Hugging Face tokenizer:

* the BPE model from ``tokens`` + ``merges`` (tokens are already spelled in GPT-2's
  byte-to-unicode alphabet; any that are not are re-spelled),
* added tokens from ``token_type`` (3 = control -> special, 4 = user-defined -> added, not
  special), so ``<|im_end|>`` stays one token,
* the pre-tokenizer from ``tokenizer.ggml.pre`` (llama.cpp's name for the split rule the
  merges were learned with; SmolLM's ``smollm`` splits every digit on its own, then applies
  GPT-2's byte-level split),
* a byte-level decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from exitlm.errors import ExitlmError

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# llama.cpp pre-tokenizer names -> the split regex their merges were trained with (None: GPT-2's
# own byte-level regex). Regexes as published by the models' tokenizer.json files.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact")


class GGUFTokenizerError(ExitlmError, ValueError):
    """The GGUF tokenizer metadata describes a tokenizer exitlm cannot rebuild."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes map, in order, to the
    code points 256, 257, ... so every byte has a visible, non-whitespace spelling.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spell(token: str, alphabet: set[str], table: dict[int, str]) -> str:
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp names ``pre`` (``tokenizer.ggml.pre``)."""
    name = (pre or "default").lower()
    if name in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if name not in _SPLITS:
        raise GGUFTokenizerError(
            f"unsupported tokenizer.ggml.pre {pre!r}; exitlm knows "
            f"{sorted([*_SPLITS, *_DIGIT_SPLITTING])}"
        )
    split = _SPLITS[name]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_bpe_tokenizer(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int] | None = None,
    pre: str | None = None,
) -> tokenizers.Tokenizer:
    """Rebuild a byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary metadata.

    Args:
        tokens: ``tokenizer.ggml.tokens`` (index = token id).
        merges: ``tokenizer.ggml.merges`` (``"left right"`` strings, best first).
        token_types: ``tokenizer.ggml.token_type``.
        pre: ``tokenizer.ggml.pre``.
    """
    table = byte_alphabet()
    alphabet = set(table.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(_spell(tok, alphabet, table), i)
    pairs: list[tuple[str, str]] = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    for left, right in pairs:  # tokenizers panics (an error that escapes `except Exception`)
        missing = [t for t in (left, right, left + right) if t not in vocab]
        if missing:
            raise GGUFTokenizerError(f"merge {left + ' ' + right!r} in tokenizer.ggml.merges "
                                     f"uses {missing[0]!r}, which is not in tokenizer.ggml.tokens")
    try:
        tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as err:
        raise GGUFTokenizerError(f"inconsistent tokenizer.ggml.tokens/merges: {err}") from err
    tk.pre_tokenizer = pre_tokenizer_for(pre)
    tk.decoder = decoders.ByteLevel()
    if token_types is not None:
        special = [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == TOKEN_CONTROL and set(tok) <= alphabet
        ]
        if special:
            tk.add_special_tokens(special)
        user = [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == TOKEN_USER_DEFINED and tok in vocab
        ]
        if user:
            tk.add_tokens(user)
    return tk
