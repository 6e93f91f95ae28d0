"""Prompts into token ids off the event loop, within the prompt-token limit.

Tokenizing a long text takes the tokenizer library seconds (and holds Python's interpreter
when called one text at a time), so the event loop never does it: every text prompt, chat
rendering and ``/tokenize`` goes to one worker thread, through
:meth:`~exitlm.tokenizer.Tokenizer.encode_batch`, which releases the interpreter while it
works. Before any of that a text is bounded by its size
(:meth:`~exitlm.tokenizer.TokenBound.min_tokens`): one that certainly has more tokens than
the limit is refused at once, so the worker's work per prompt is bounded by the limit times
the tokenizer's longest token. At most ``max_pending`` jobs wait for the worker; beyond
that a request gets a 503 with ``Retry-After``.

The worker also returns memory to the system after a large request (:func:`trim_memory`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from exitlm.errors import ExitlmError
from exitlm.serve.errors import APIError, bad_request
from exitlm.serve.limits import Limits
from exitlm.tokenizer import TokenBound, Tokenizer

T = TypeVar("T")
Prompt = str | list[int]


class PromptWorker:
    """Encodes prompts for one server (see the module docstring).

    Args:
        tokenizer: the served model's tokenizer.
        limits: the request limits (the prompt-token limit is checked here).
        context: the engine's context (tokens).
        max_pending: the most jobs waiting for the worker thread.
    """

    def __init__(self, tokenizer: Tokenizer, limits: Limits, context: int,
                 max_pending: int = 256) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.context = context
        self.max_pending = max_pending
        self.bound: TokenBound | None = tokenizer.token_bound()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="exitlm-tokenize")
        self._pending = 0

    @property
    def limit(self) -> int:
        """The most tokens one prompt may have."""
        return self.limits.prompt_tokens(self.context)

    # ----- on the event loop -------------------------------------------------------------------
    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the worker thread (a 503 when ``max_pending`` jobs wait already)."""
        if self._pending >= self.max_pending:
            raise APIError(503, f"the tokenizer queue is full ({self.max_pending} requests "
                           "waiting); retry later", code="queue_full",
                           headers={"Retry-After": "1"})
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self._pending -= 1

    async def encode(self, prompts: list[Prompt], param: str) -> list[list[int]]:
        """Token ids of each prompt (token ids as given), or a 400 naming the first prompt
        beyond the limit."""
        for p in prompts:  # token ids are counted, not tokenized
            if not isinstance(p, str) and len(p) > self.limit:
                raise self.limits.prompt_too_long(len(p), self.context, param)
        if not any(isinstance(p, str) for p in prompts):
            return [list(p) for p in prompts]
        return await self.run(lambda: self._encode(prompts, param))

    async def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          param: str = "messages") -> list[int]:
        """Token ids of ``messages`` rendered with the chat template."""
        def job() -> list[int]:
            return self._encode([self._render(messages, add_generation_prompt)], param)[0]
        return await self.run(job)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- on the worker thread ----------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt)
        except ExitlmError as err:
            raise bad_request(str(err), "messages") from None

    def _encode(self, prompts: list[Prompt], param: str) -> list[list[int]]:
        limit = self.limit
        texts = [p for p in prompts if isinstance(p, str)]
        if self.bound is not None:
            for text in texts:
                low = self.bound.min_tokens(text, limit)
                if low > limit:
                    raise self.limits.prompt_too_long(low, self.context, param, at_least=True)
        encoded = iter(self.tokenizer.encode_batch(texts))
        out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in out:
            if len(ids) > limit:
                raise self.limits.prompt_too_long(len(ids), self.context, param)
        return out


def trim_memory() -> bool:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``): after a large
    request CPython frees its objects, but glibc keeps the pages of its arenas. Returns
    whether anything could be called (Linux with glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
    return True
