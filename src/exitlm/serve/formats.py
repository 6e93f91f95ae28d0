"""Response bodies in OpenAI's shapes (completions, chat completions, their stream chunks,
log-probabilities, usage) plus exitlm's extra keys, which OpenAI clients ignore:

* ``exit_layers`` on a choice (or a chunk's choice) when the request set
  ``return_exit_layers``: the 1-based layer that chose each generated token, aligned with the
  tokens (``num_layers`` = full depth);
* ``early_exit`` on the response (in a stream: on its last chunk): where the request's
  tokens exited - ``tokens_per_layer``, ``share_per_layer``, ``early_exit_fraction``,
  ``layer_evaluations`` against ``full_depth_evaluations`` and ``layer_speedup``
  (:class:`~exitlm.infer.result.ExitSummary`) - and the strategy's ``stats`` (drafts
  accepted, ``acceptance_rate``, ...).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

from exitlm.infer.request import Request
from exitlm.infer.result import ExitSummary, FinishReason, TokenLogprob
from exitlm.tokenizer import Tokenizer, byte_level_alphabet

FINISH: dict[FinishReason, str] = {
    "length": "length", "stop_token": "stop", "stop_string": "stop", "cancelled": "abort",
    "error": "error",
}


_BYTES = {c: b for b, c in byte_level_alphabet().items()}  # byte-level BPE: char -> byte
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Each token's text and bytes, for log-probability entries (cached per token id). A
    token holding part of a UTF-8 character is spelled ``bytes:\\xe2\\x80`` (OpenAI's
    convention), so that different tokens keep different strings."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _entry(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:  # part of a character: the token's own bytes
                piece = self.tokenizer.tk.id_to_token(token) or ""
                m = _BYTE_TOKEN.fullmatch(piece)
                if m:
                    raw = bytes([int(m.group(1), 16)])
                elif piece and all(c in _BYTES for c in piece):
                    raw = bytes(_BYTES[c] for c in piece)
                if raw != text.encode("utf-8"):  # OpenAI's spelling of partial characters
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token] = (text, list(raw))
        return hit

    def text(self, token: int) -> str:
        return self._entry(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._entry(token)[1]


# ----- log-probabilities -------------------------------------------------------------------------

def completion_logprobs(tt: TokenText, tokens: Sequence[int],
                        entries: Sequence[TokenLogprob | None], offset: int = 0
                        ) -> dict[str, Any]:
    """The completions ``logprobs`` object; an entry of ``None`` (the first prompt token under
    ``echo``) has no log-probability. ``top_logprobs`` holds the asked-for alternatives and
    the chosen token, as OpenAI's does."""
    texts = [tt.text(t) for t in tokens]
    tops: list[dict[str, float] | None] = []
    for t, e in zip(tokens, entries, strict=True):
        if e is None:
            tops.append(None)
            continue
        top = {tt.text(i): lp for i, lp in e.top}
        top.setdefault(tt.text(t), e.logprob)
        tops.append(top)
    starts = list(itertools.accumulate((len(s) for s in texts), initial=offset))[:-1]
    return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob
                                                 for e in entries],
            "top_logprobs": tops, "text_offset": starts}


def chat_logprobs(tt: TokenText, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tt.text(token), "logprob": logprob, "bytes": tt.bytes(token)}

    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]}


# ----- summaries ------------------------------------------------------------------------------

def usage(prompts: list[list[int]], reqs: list[Request], n: int) -> dict[str, Any]:
    """OpenAI's ``usage`` of the choices ``reqs`` of ``prompts`` (choice ``i`` of prompt
    ``i // n``; each prompt counted once): ``prompt_tokens_details.cached_tokens`` are the
    positions of a prompt that none of its choices prefilled - copied from another request's
    cache (:mod:`exitlm.infer.prefill_plan`)."""
    prompt = sum(map(len, prompts))
    done = sum(len(r.token_ids) for r in reqs)
    cached = sum(min(r.prompt_copied for r in reqs[i * n:(i + 1) * n])
                 for i in range(len(prompts)) if reqs[i * n:(i + 1) * n])
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def early_exit(requests: Sequence[Request], num_layers: int, strategy: str) -> dict[str, Any]:
    """The ``early_exit`` summary of a request's choices (see the module docstring)."""
    summary = ExitSummary.of((x for r in requests for x in r.exit_layers),
                             sum(r.layer_evaluations for r in requests), num_layers)
    stats = type(requests[0].stats).total(r.stats for r in requests) if requests else None
    return {"strategy": strategy, "num_layers": num_layers, **summary.to_dict(),
            "stats": stats.to_dict() if stats is not None else {}}
