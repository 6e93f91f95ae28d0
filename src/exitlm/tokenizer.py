"""Tokenization through Hugging Face ``tokenizers``, chat templates through sandboxed Jinja
(:mod:`exitlm.chat_template`).

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` with the special-token facts generation
needs (BOS, EOS set, pad) and the model's chat template. Streaming text out of a growing list of
token ids is :class:`exitlm.infer.stopping.TextTracker`'s job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from exitlm.chat_template import ChatTemplateError, TemplateLimits, render_chat_template
from exitlm.errors import ExitlmError, short_repr

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

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; a BOS token is prepended when the model expects one."""
        ids = self.tk.encode(text, add_special_tokens=False).ids
        use_bos = self.add_bos if add_bos is None else add_bos
        if use_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

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
        try:
            tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises plain Exceptions
            raise ExitlmError(f"{path}: cannot load the tokenizer ({_one_line(err)})") from None
        meta = _read_meta(d / "tokenizer_config.json")

        def tid(key: str) -> int | None:
            tok = meta.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return tk.token_to_id(tok) if isinstance(tok, str) else None

        template = _pick_template(meta.get("chat_template"))
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
        eos = meta.get("exitlm_eos_token_ids") or []
        if not isinstance(eos, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tk.get_vocab_size(
                    with_added_tokens=True) for t in eos):
            raise ExitlmError(f"{d / 'tokenizer_config.json'}: exitlm_eos_token_ids: expected a "
                              f"list of token ids, got {short_repr(eos)}")
        eos = tuple(eos)
        if not eos and tid("eos_token") is not None:
            eos = (tid("eos_token"),)
        return cls(
            tk, bos_token_id=tid("bos_token"), eos_token_ids=eos, pad_token_id=tid("pad_token"),
            add_bos=bool(meta.get("add_bos_token", False)),
            chat_template=template,
        )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def _read_meta(file: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict ({} when absent); errors name the file."""
    if not file.is_file():
        return {}
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, OSError) as err:
        raise ExitlmError(f"{file}: invalid JSON ({_one_line(err)})") from None
    if not isinstance(meta, dict):
        raise ExitlmError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _pick_template(value: Any) -> str | None:
    """A ``chat_template`` entry: text, or Hugging Face's list of named templates (the one
    named ``default``)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None
