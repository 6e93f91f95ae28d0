"""What every route reads: the served model, its tokenizer, the engine runner and metrics."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from exitlm.config import ConfigError
from exitlm.infer.engine import Engine
from exitlm.serve.errors import APIError, bad_request
from exitlm.serve.formats import TokenText
from exitlm.serve.limits import Limits
from exitlm.serve.metrics import Metrics
from exitlm.serve.prompts import PromptWorker
from exitlm.serve.runner import EngineRunner
from exitlm.tokenizer import Tokenizer

LARGE_BODY_BYTES = 2**18
"""A request body from this size on is large: once answered, freed memory is given back to
the system (:func:`exitlm.serve.prompts.trim_memory`)."""


@dataclass
class ServerState:
    """The server's one model and engine.

    Attributes:
        engine: the decoding engine (stepped only by ``runner``'s thread).
        tokenizer: encodes prompts and chat templates, decodes tokens.
        model_name: the id clients pass as ``model`` (``--served-model-name``).
        api_key: when set, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
            ``Authorization: Bearer <api_key>``.
        drain_timeout: seconds a shutdown waits for requests in flight.
        limits: what one request may ask for (:mod:`exitlm.serve.limits`).
    """

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    drain_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits)
    created: int = field(default_factory=lambda: int(time.time()))
    runner: EngineRunner = field(init=False)
    metrics: Metrics = field(init=False)
    token_text: TokenText = field(init=False)
    prompts: PromptWorker = field(init=False)

    def __post_init__(self) -> None:
        self.runner = EngineRunner(self.engine, on_update=lambda u: self.metrics.observe(u))
        self.metrics = Metrics(self.num_layers, self.engine.decoder.stats_type,
                               queue_depth=lambda: self.runner.waiting,
                               running=lambda: self.runner.running,
                               failures=lambda: self.runner.failures)
        self.token_text = TokenText(self.tokenizer)
        self.prompts = PromptWorker(self.tokenizer, self.limits, self.context,
                                    max_pending=self.engine.max_queue or 256)

    @property
    def num_layers(self) -> int:
        return self.engine.model.num_layers

    @property
    def strategy(self) -> str:
        return self.engine.strategy.name

    @property
    def context(self) -> int:
        """The longest prompt + completion served (tokens)."""
        return self.engine.max_seq_len

    def check_model(self, model: str | None) -> None:
        """A 400 unless ``model`` is the served model (or omitted)."""
        if model is not None and model != self.model_name:
            raise APIError(400, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        """A 400 when a prompt and its completion do not fit the context."""
        if prompt_len + max_tokens <= self.context:
            return
        if prompt_len >= self.context:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                           f"{self.context} tokens", param=param,
                           code="context_length_exceeded")
        raise APIError(400, f"this model's context is {self.context} tokens; the prompt has "
                       f"{prompt_len} and max_tokens asks for {max_tokens} more: lower "
                       "max_tokens or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")


MAX_INT_DIGITS = 64
"""The longest integer a request body may hold (digits): no field takes a longer one."""

_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: HTTPRequest, limits: Limits) -> Any:
    """The request body as JSON (a 400 for anything else, or for a body beyond
    ``limits.max_request_bytes``, refused by its ``Content-Length`` before it is read;
    NaN and Infinity, integers of more than :data:`MAX_INT_DIGITS` digits and strings with a
    lone UTF-16 surrogate (``"\\ud800"``: not Unicode text) are refused). A client that goes
    away before its body arrived gets a 499. A large body marks the request for a memory
    trim."""
    import json

    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise limits.body_too_large(int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise limits.body_too_large()
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected before its request body arrived",
                       code="client_disconnected") from None
    if size >= LARGE_BODY_BYTES:
        request.scope["exitlm_large"] = True

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise _LongInteger(len(text.lstrip("-")))
        return int(text)

    body = b"".join(chunks)
    del chunks
    try:
        doc = json.loads(body, parse_constant=refuse, parse_int=integer)
    except _LongInteger as err:
        raise bad_request(f"the request body holds an integer of {err.args[0]} digits; no "
                          f"field takes more than {MAX_INT_DIGITS}") from None
    except (ValueError, RecursionError) as err:
        raise bad_request(f"the request body is not valid JSON ({err})") from None
    where = _lone_surrogate(doc)
    if where is not None:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                          "escape): text must be valid Unicode", param=where)
    return doc


class _LongInteger(ValueError):
    """An integer literal too long to be any field's value (its digits in ``args[0]``)."""


def _lone_surrogate(doc: Any) -> str | None:
    """The path (``messages[0].content``) of a string in ``doc`` (keys included) that holds a
    lone surrogate, else None. Iterative, so any nesting depth is fine; a path is built only
    for the containers met and the string found, so a long list of strings or numbers costs
    none."""
    def name(path: str, key: Any, in_dict: bool) -> str:
        return (f"{path}.{key}" if path else str(key)) if in_dict else f"{path}[{key}]"

    if not isinstance(doc, (dict, list)):
        return "body" if isinstance(doc, str) and _SURROGATE.search(doc) else None
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        obj, path = stack.pop()
        in_dict = isinstance(obj, dict)
        for key, value in (obj.items() if in_dict else enumerate(obj)):
            if in_dict and _SURROGATE.search(key):
                return path or "body"
            if isinstance(value, str):
                if _SURROGATE.search(value):
                    return name(path, key, in_dict)
            elif isinstance(value, (dict, list)):
                stack.append((value, name(path, key, in_dict)))
    return None


def config_error(err: ConfigError, prompt_param: str | None = None) -> APIError:
    """An engine :class:`ConfigError` (a request it cannot serve) as a 400; one about the
    prompt (empty, a token id outside the vocabulary) names ``prompt_param``."""
    message = " ".join(str(err).split())
    about_prompt = message.startswith(("prompt", "the prompt"))
    return bad_request(message, prompt_param if about_prompt else None)
