"""Tokenization through Hugging Face ``tokenizers``, chat templates through sandboxed Jinja.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` with the special-token facts generation
needs (BOS, EOS set, pad) and the model's chat template. :class:`IncrementalDecoder` turns a
growing list of token ids into text pieces for streaming without splitting multi-byte
characters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A plain template for models that ship none (ChatML, as SmolLM2 itself uses).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's template.

        Rendering is sandboxed (``jinja2.sandbox``): a template comes with a checkpoint and is
        untrusted input.
        """
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages need 'role' and 'content' keys, got {m!r}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template error: {message}")

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        template = env.from_string(self.chat_template or CHATML_TEMPLATE)
        bos = self.tk.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.tk.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos or "", eos_token=eos or "",
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
        """Read ``tokenizer.json`` (+ ``tokenizer_config.json`` when present) from a directory."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        tk = tokenizers.Tokenizer.from_file(str(path))
        meta: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            meta = json.loads((d / "tokenizer_config.json").read_text())

        def tid(key: str) -> int | None:
            tok = meta.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return tk.token_to_id(tok) if isinstance(tok, str) else None

        template = meta.get("chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        eos = tuple(meta.get("exitlm_eos_token_ids") or ())
        if not eos and tid("eos_token") is not None:
            eos = (tid("eos_token"),)
        return cls(
            tk, bos_token_id=tid("bos_token"), eos_token_ids=eos, pad_token_id=tid("pad_token"),
            add_bos=bool(meta.get("add_bos_token", False)),
            chat_template=template,
        )


class IncrementalDecoder:
    """Streams text for a growing token list, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned

    def push(self, token_id: int) -> str:
        """Add one token and return the newly complete text (possibly empty)."""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        piece = text[self.emitted :]
        self.emitted = len(text)
        return piece
