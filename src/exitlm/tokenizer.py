"""Tokenization through Hugging Face ``tokenizers``, chat templates through sandboxed Jinja
(:mod:`exitlm.chat_template`).

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` with the special-token facts generation
needs (BOS, EOS set, pad) and the model's chat template. Streaming text out of a growing list of
token ids is :class:`exitlm.infer.stopping.TextTracker`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from exitlm.chat_template import (
    MAX_TEMPLATE_BYTES,
    ChatTemplateError,
    TemplateLimits,
    render_chat_template,
)
from exitlm.errors import ConfigError, ExitlmError, short_repr
from exitlm.textfile import MIB, read_text_file

MAX_TOKENIZER_BYTES = 256 * MIB
"""The largest ``tokenizer.json`` read (real ones are up to a few tens of MiB)."""
MAX_TOKENIZER_CONFIG_BYTES = 64 * MIB
"""The largest ``tokenizer_config.json`` read."""

# A plain template for models that ship none (ChatML, as SmolLM2 itself uses).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table, which byte-level BPE (``tokenizers``' ByteLevel
    pre-tokenizer and decoder) uses to spell every byte as a printable character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


@dataclass(frozen=True)
class TokenBound:
    """Every token of a tokenizer stands for at most ``bytes_per_token`` bytes of input text,
    except the characters of ``lost``, which it drops, and, with ``lost_leads``, the first
    byte of some 4-byte characters (see :meth:`Tokenizer.token_bound`)."""

    bytes_per_token: int
    lost: str = ""
    lost_leads: bool = False

    def min_tokens(self, text: str, limit: int) -> int:
        """A lower bound on the tokens of ``text``: from its length in characters (every
        character keeps at least one byte) when that already exceeds ``limit``, so that a
        huge text costs a few scans, not an encoding; from its bytes otherwise."""
        lost = sum(text.count(c) for c in self.lost)
        chars = len(text)
        low = -(-(chars - lost) // self.bytes_per_token)
        if low > limit:
            return low
        size = len(text.encode("utf-8", "surrogatepass"))
        # a 4-byte character adds 3 to size - chars and loses at most its lead byte
        kept = size - lost - ((size - chars) // 3 if self.lost_leads else 0)
        return -(-kept // self.bytes_per_token)


class Tokenizer:
    """A text <-> token-id codec with the model's special tokens and chat template."""

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.source: str | None = None
        """The file the tokenizer was read from (:meth:`load`), for messages."""
        self._max_id: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        """The largest token id this tokenizer can produce (-1 for an empty vocabulary). A
        tokenizer's ids need not be dense, so this may exceed ``vocab_size - 1``."""
        if self._max_id is None:
            self._max_id = max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1)
        return self._max_id

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; a BOS token is prepended when the model expects one."""
        ids = self.tk.encode(text, add_special_tokens=False).ids
        use_bos = self.add_bos if add_bos is None else add_bos
        if use_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: list[str], *, add_bos: bool | None = None) -> list[list[int]]:
        """Token ids of each of ``texts``, as :meth:`encode` gives them. The Rust library does
        the work without holding Python's GIL, so other threads (an event loop) go on
        meanwhile; offsets are not computed."""
        fast = getattr(self.tk, "encode_batch_fast", self.tk.encode_batch)  # tokenizers>=0.20
        encodings = fast(list(texts), add_special_tokens=False)
        use_bos = self.add_bos if add_bos is None else add_bos
        head = [self.bos_token_id] if use_bos and self.bos_token_id is not None else []
        return [head + e.ids for e in encodings]

    def token_bound(self) -> TokenBound | None:
        """A lower bound on the number of tokens of any text, computable without tokenizing
        it (:class:`TokenBound`); ``None`` when no bound holds: a normalizer, pre-tokenizer or
        model of this tokenizer may drop text without limit (BERT's whitespace splitting,
        WordPiece's one ``[UNK]`` for a whole word, BPE without the bytes of unknown text).

        The bound is the longest vocabulary entry in the bytes it spells (byte-level BPE:
        one character per byte; otherwise its UTF-8 length, which is never less than the
        text it matches: SentencePiece's ``▁`` is 3 bytes for a 1-byte space, a byte-fallback
        ``<0x41>`` 6 bytes for one), times the most a Unicode normalizer can shrink text
        (4: a 4-byte character becomes a 1-byte one under NFKC). Bytes a byte-level
        vocabulary has no token for are dropped by the library: such ASCII characters are
        not counted, nor the first byte of 4-byte characters when a lead byte is missing
        (SmolLM2's vocabulary lacks 0xF1 and 0xF2, lead bytes of unassigned planes)."""
        spec = json.loads(self.tk.to_str())
        shrink = _shrink_bound(spec.get("normalizer"))
        if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
            return None
        model = spec.get("model") or {}
        vocab = self.tk.get_vocab(with_added_tokens=False)
        lost = ""
        lost_leads = False
        alphabet: dict[int, str] = {}
        if model.get("byte_fallback"):
            longest = 1  # every byte of any text has a token
        elif _has_byte_level(spec.get("pre_tokenizer")):
            alphabet = byte_level_alphabet()
            missing = {b for b, c in alphabet.items() if c not in vocab} - _NOT_IN_UTF8
            if any(0x80 <= b < 0xC0 for b in missing):
                return None  # a whole multi-byte character could be lost
            if missing & set(range(0xC2, 0xF0)):
                return None  # a 2- or 3-byte character could lose half its bytes or more
            lost = "".join(chr(b) for b in sorted(missing) if b < 0x80)
            lost_leads = any(b >= 0x80 for b in missing)
            longest = 1
        elif (model.get("type") == "BPE" and model.get("unk_token") is not None
              and not model.get("fuse_unk")):
            longest = 4  # an unknown character is one [UNK]: at most 4 UTF-8 bytes
        else:  # unknown text may be dropped, or fused into one [UNK]
            return None
        spelled = set(alphabet.values())
        for token in vocab:
            size = sum(1 if c in spelled else len(c.encode("utf-8", "replace")) for c in token)
            longest = max(longest, size)
        for added in self.tk.get_added_tokens_decoder().values():  # matched in the raw text
            longest = max(longest, len(added.content.encode("utf-8", "replace")))
        return TokenBound(longest * shrink, lost, lost_leads)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
        limits: TemplateLimits | None = None,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's template.

        A template comes with a checkpoint and is untrusted input: it renders in a sandbox
        with bounded output size and time (:mod:`exitlm.chat_template`); every failure is a
        one-line :class:`~exitlm.chat_template.ChatTemplateError`.
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(
                    f"chat messages need 'role' and 'content' keys, got {short_repr(m)}")
        bos = self._tok(self.bos_token_id) or ""
        eos = self._tok(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return render_chat_template(
            self.chat_template or CHATML_TEMPLATE, limits, messages=messages,
            add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos or "",
        )

    # ----- persistence (tokenizer.json + a small JSON of special tokens) ------------------------
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (HF-compatible keys)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tk.save(str(d / "tokenizer.json"))
        meta: dict[str, Any] = {
            "bos_token": self._tok(self.bos_token_id),
            "eos_token": self._tok(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "pad_token": self._tok(self.pad_token_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
            "exitlm_eos_token_ids": list(self.eos_token_ids),
        }
        (d / "tokenizer_config.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))

    def _tok(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tk.id_to_token(token_id)

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` (+ ``tokenizer_config.json`` when present) from a directory.

        Unreadable or malformed files raise an :class:`~exitlm.errors.ExitlmError` naming
        the file."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        text = read_text_file(path, MAX_TOKENIZER_BYTES, expected="a tokenizer.json")
        try:
            tk = tokenizers.Tokenizer.from_str(text)
        except Exception as err:  # the Rust library raises plain Exceptions
            raise ExitlmError(f"{path}: cannot load the tokenizer ({_one_line(err)})") from None
        meta = _read_meta(d / "tokenizer_config.json")

        def tid(key: str) -> int | None:
            tok = meta.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return tk.token_to_id(tok) if isinstance(tok, str) else None

        template = _pick_template(meta.get("chat_template"), d / "tokenizer_config.json")
        if template is None and (d / "chat_template.jinja").exists():
            template = read_text_file(d / "chat_template.jinja", MAX_TEMPLATE_BYTES,
                                      expected="a Jinja template", errors="replace")
        eos = meta.get("exitlm_eos_token_ids") or []
        if not isinstance(eos, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tk.get_vocab_size(
                    with_added_tokens=True) for t in eos):
            raise ExitlmError(f"{d / 'tokenizer_config.json'}: exitlm_eos_token_ids: expected a "
                              f"list of token ids, got {short_repr(eos)}")
        eos = tuple(eos)
        if not eos and tid("eos_token") is not None:
            eos = (tid("eos_token"),)
        tok = cls(
            tk, bos_token_id=tid("bos_token"), eos_token_ids=eos, pad_token_id=tid("pad_token"),
            add_bos=bool(meta.get("add_bos_token", False)),
            chat_template=template,
        )
        tok.source = str(path)
        return tok


def check_fits_vocab(name: str, count: int, max_id: int, vocab_size: int, hint: str) -> None:
    """Refuse a tokenizer (``count`` tokens, ids up to ``max_id``) whose ids a model with
    ``vocab_size`` embeddings cannot look up: a one-line :class:`~exitlm.errors.ConfigError`
    naming the tokenizer (``name``) and the sizes, ending with ``hint``."""
    if count > vocab_size:
        raise ConfigError(f"{name} has {count} tokens but the model's vocabulary has "
                          f"{vocab_size}; {hint}")
    if max_id >= vocab_size:
        raise ConfigError(f"{name}: token ids up to {max_id} exceed the model's vocab_size "
                          f"{vocab_size}; {hint}")


_NOT_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
"""Bytes that never occur in UTF-8 text (a vocabulary may leave them out)."""
_GROWING_NORMALIZERS = frozenset({"Prepend", "Replace", "Lowercase", "NFC", "NFD", "NFKC",
                                  "NFKD"})
"""Normalizers that never shrink text by more than 4x (Replace: when its content is at least
as long as its literal pattern; the Unicode forms and lowercasing: a character of up to 4
bytes becomes one of at least 1 byte, and nothing is deleted)."""
_TEXT_KEEPING_PRE = frozenset({"ByteLevel", "Digits", "Metaspace", "Punctuation", "Split",
                               "UnicodeScripts"})
"""Pre-tokenizers that keep every byte of the text (Split and Punctuation unless their
behavior is "removed")."""


def _shrink_bound(spec: dict[str, Any] | None) -> int | None:
    """How many times shorter a normalizer can make text (``None``: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            f = _shrink_bound(part)
            if f is None:
                return None
            factor = max(factor, f)  # each step shrinks only what it changes
        return factor
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content") or ""
        ok = isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode())
        return 1 if ok else None
    if kind == "Prepend":
        return 1
    return 4 if kind in _GROWING_NORMALIZERS else None


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in spec.get("pretokenizers") or [])
    return kind in _TEXT_KEEPING_PRE and str(spec.get("behavior", "")).lower() != "removed"


def _has_byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in spec.get("pretokenizers") or [])
    return spec.get("type") == "ByteLevel"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def _read_meta(file: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict ({} when absent); errors name the file."""
    if not file.exists():
        return {}
    text = read_text_file(file, MAX_TOKENIZER_CONFIG_BYTES, expected="a JSON object")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ExitlmError(f"{file}: invalid JSON ({_one_line(err)})") from None
    if not isinstance(meta, dict):
        raise ExitlmError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _pick_template(value: Any, file: Path) -> str | None:
    """A ``chat_template`` entry of ``file``: text, or Hugging Face's list of named templates
    (``[{"name": ..., "template": ...}]``: the one named ``default``); ``None`` when absent.
    Anything else is an :class:`~exitlm.errors.ExitlmError` naming the file and the key."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}.get("default")
    raise ExitlmError(f"{file}: chat_template: expected a string or a list of "
                      f'{{"name": ..., "template": ...}} objects, got {short_repr(value)}')
