"""Per-sequence text tracking: incremental decoding, stop strings and streaming.

:class:`TextTracker` follows one sequence's generated tokens. It decodes them only when
someone needs text during generation (a stream callback or stop strings), detects stop
strings, and streams text pieces whose concatenation is exactly the final ``text``: it holds
back an incomplete UTF-8 character and any tail that might still grow into a stop string.
Decoding is incremental (a short window of recent tokens per step, as vLLM's detokenizer
does), so a long generation costs O(1) tokenizer work per token, not O(length).
The engine feeds every request's accepted tokens through one of these.
"""

from __future__ import annotations

from collections.abc import Callable

from exitlm.tokenizer import Tokenizer

TextCallback = Callable[[int, str], None]
"""``stream(sequence_index, text_piece)``: called as text becomes final."""


class TextTracker:
    """Text state of one generated sequence.

    Args:
        tokenizer: decodes ids to text; ``None`` gives empty text (token-id-only generation).
        index: the sequence's index in the batch, passed to ``stream``.
        stop_strings: strings that end the sequence; the text is cut right before them.
        stream: receives ``(index, piece)`` as text becomes final.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        index: int = 0,
        *,
        stop_strings: tuple[str, ...] = (),
        stream: TextCallback | None = None,
    ) -> None:
        if tokenizer is None and (stop_strings or stream is not None):
            raise ValueError("stop strings and text streaming need a tokenizer")
        self.tokenizer = tokenizer
        self.index = index
        self.stop_strings = tuple(stop_strings)
        self.stream = stream
        self.ids: list[int] = []
        self.live = stream is not None or bool(stop_strings)
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self._text = ""
        self._emitted = 0  # characters already streamed
        self._searched = 0  # characters already searched for stop strings
        self._final: str | None = None
        self._prefix = 0  # window start for incremental decoding
        self._read = 0  # tokens whose text is in self._text

    def push(self, token_id: int) -> bool:
        """Add one token; return True when a stop string has just completed."""
        self.ids.append(token_id)
        if not self.live:
            return False
        delta = self._delta(final=False)
        if delta is None:
            return False  # the rest of a multi-byte character is still to come
        text = self._text = self._text + delta
        if self.stop_strings:
            start = max(0, self._searched - self._longest_stop + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop_strings) if i >= 0]
            self._searched = len(text)
            if hits:
                self._finish(text[: min(hits)])
                return True
        self._emit(len(text) - self._held_back(text))
        return False

    def extend(self, token_ids: list[int]) -> int:
        """Push several tokens; return how many were consumed before a stop string ended the
        sequence (``len(token_ids)`` when none did)."""
        for i, t in enumerate(token_ids):
            if self.push(t):
                return i + 1
        return len(token_ids)

    def finish(self) -> str:
        """End the sequence (length or stop token): stream the rest and return the text."""
        if self._final is None:
            if self.tokenizer is None:
                self._finish("")
            elif self.live:
                self._finish(self._text + (self._delta(final=True) or ""))
            else:
                self._finish(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        assert self._final is not None
        return self._final

    @property
    def text(self) -> str:
        """The final text (after :meth:`finish` or a stop string), else the text so far."""
        return self._final if self._final is not None else self._text

    # ----- internals -----------------------------------------------------------------------
    def _delta(self, final: bool) -> str | None:
        """Text the tokens since the last call add: both texts are decoded from the same
        window start, so tokenizers that drop a leading space at the start of a decode still
        give the right difference. ``None`` while the newest character is incomplete."""
        assert self.tokenizer is not None
        dec = self.tokenizer.decode
        before = dec(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = dec(self.ids[self._prefix :], skip_special_tokens=True)
        if not final and after.endswith("\ufffd"):
            return None
        if len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def _emit(self, upto: int) -> None:
        if upto > self._emitted:
            if self.stream is not None:
                self.stream(self.index, self._text[self._emitted : upto])
            self._emitted = upto

    def _finish(self, text: str) -> None:
        self._text = text
        self._final = text
        self._emit(len(text))
