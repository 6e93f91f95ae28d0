"""What every route reads: the served model, its tokenizer, the engine runner and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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


async def read_json(request: HTTPRequest, limits: Limits) -> Any:
    """The request body as JSON (a 400 for anything else, or for a body beyond
    ``limits.max_request_bytes``, refused by its ``Content-Length`` before it is read;
    NaN and Infinity are refused). A large body marks the request for a memory trim."""
    import json

    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise limits.body_too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise limits.body_too_large()
        chunks.append(chunk)
    if size >= LARGE_BODY_BYTES:
        request.scope["exitlm_large"] = True

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    body = b"".join(chunks)
    del chunks
    try:
        return json.loads(body, parse_constant=refuse)
    except (ValueError, RecursionError) as err:
        raise bad_request(f"the request body is not valid JSON ({err})") from None


def config_error(err: ConfigError) -> APIError:
    """An engine :class:`ConfigError` (a request it cannot serve) as a 400."""
    return bad_request(" ".join(str(err).split()))
