"""The bounds on what one request may ask of the server, checked before the work they bound.

Each is an ``exitlm serve`` option (:class:`Limits` holds the defaults); a request beyond one
gets a 400 that names the limit and the option that raises it:

* ``--max-request-bytes`` (4 MiB): the request body. A larger ``Content-Length`` is refused
  before the body is read. Parsing JSON holds Python's interpreter for the whole body (about
  5-20 ms per MiB), so this bound is also how long any other request can be held up;
* ``--max-prompts`` (256): the prompts of one ``/v1/completions`` request (``prompt`` as a
  list); prompts times ``n`` must also fit ``--max-queue``, or the request could never be
  queued;
* ``--max-prompt-tokens`` (the context, ``--max-seq-len``): the tokens of one prompt. A text
  prompt is first bounded by its size in bytes (:meth:`exitlm.tokenizer.Tokenizer.
  token_bound`: a text of more than ``bytes_per_token x limit`` bytes certainly has too many
  tokens and is refused without tokenizing), then tokenized off the event loop
  (:mod:`exitlm.serve.prompts`);
* ``--max-completion-tokens`` (the context): ``max_tokens`` of one choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from exitlm.serve.errors import APIError, bad_request

MIB = 2**20


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (``None``: bounded by the context only)."""

    max_prompts: int = 256
    max_request_bytes: int = 4 * MIB
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = None

    def prompt_tokens(self, context: int) -> int:
        """The most tokens one prompt may have (a prompt may fill the context when it asks
        for no completion, as log-likelihood scoring does)."""
        return min(context, self.max_prompt_tokens or context)

    def check_prompts(self, count: int, n: int, max_queue: int | None) -> None:
        """A 400 when a request has more prompts, or prompts x ``n`` choices, than the
        server takes (``max_queue``: the engine's queue)."""
        if count > self.max_prompts:
            raise bad_request(
                f"this request has {count} prompts; the server takes at most "
                f"{self.max_prompts} prompts per request (raise it with --max-prompts)",
                "prompt", code="too_many_prompts")
        if max_queue is not None and count * n > max_queue:
            raise bad_request(
                f"this request asks for {count * n} completions ({count} prompts x n={n}); "
                f"the server queues at most {max_queue} (raise it with --max-queue)",
                "n" if n > 1 else "prompt", code="too_many_prompts")

    def check_completion(self, max_tokens: int) -> None:
        """A 400 when ``max_tokens`` exceeds ``--max-completion-tokens``."""
        cap = self.max_completion_tokens
        if cap is not None and max_tokens > cap:
            raise bad_request(
                f"max_tokens is {max_tokens}; the server allows at most {cap} tokens per "
                "completion (raise it with --max-completion-tokens)", "max_tokens",
                code="max_tokens_exceeded")

    def default_completion(self, default: int) -> int:
        """``max_tokens`` of a request that gives none: ``default`` (16 for a completion,
        the rest of the context for a chat), at most ``--max-completion-tokens``."""
        cap = self.max_completion_tokens
        return default if cap is None else min(default, cap)

    def body_too_large(self, size: int | None = None) -> APIError:
        """The 400 for a body beyond ``--max-request-bytes`` (``size``: when known)."""
        has = f"has {size} bytes" if size is not None else "is larger"
        return bad_request(
            f"the request body {has}; the server reads at most {self.max_request_bytes} bytes "
            "(raise it with --max-request-bytes)", code="request_too_large")

    def prompt_too_long(self, tokens: int, context: int, param: str, *, at_least: bool = False
                        ) -> APIError:
        """The 400 for a prompt of ``tokens`` tokens (``at_least``: a bound from its size)
        beyond :meth:`prompt_tokens`."""
        limit = self.prompt_tokens(context)
        has = f"at least {tokens}" if at_least else f"{tokens}"
        if limit < context:
            where = f"the server takes at most {limit} (raise it with --max-prompt-tokens)"
        else:
            where = f"this model's context is {context} tokens (--max-seq-len)"
        return APIError(400, f"the prompt has {has} tokens; {where}", param=param,
                        code="context_length_exceeded")
