"""What every route reads: the served model, its tokenizer, the engine runner and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from exitlm.config import ConfigError
from exitlm.errors import ExitlmError
from exitlm.infer.engine import Engine
from exitlm.serve.errors import APIError, bad_request
from exitlm.serve.formats import TokenText
from exitlm.serve.metrics import Metrics
from exitlm.serve.runner import EngineRunner
from exitlm.tokenizer import Tokenizer

MAX_BODY_BYTES = 32 * 2**20
"""The largest request body read (a 413 beyond)."""


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
    """

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    drain_timeout: float = 30.0
    created: int = field(default_factory=lambda: int(time.time()))
    runner: EngineRunner = field(init=False)
    metrics: Metrics = field(init=False)
    token_text: TokenText = field(init=False)

    def __post_init__(self) -> None:
        self.runner = EngineRunner(self.engine, on_update=lambda u: self.metrics.observe(u))
        self.metrics = Metrics(self.num_layers, self.engine.decoder.stats_type,
                               queue_depth=lambda: self.runner.waiting,
                               running=lambda: self.runner.running,
                               failures=lambda: self.runner.failures)
        self.token_text = TokenText(self.tokenizer)

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

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (token ids are checked by the engine when submitted)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` (a 400 when it fails)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt)
        except ExitlmError as err:
            raise bad_request(str(err), "messages") from None

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


async def read_json(request: HTTPRequest) -> Any:
    """The request body as JSON (a 400 for anything else; NaN and Infinity are refused)."""
    import json

    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=refuse)
    except (ValueError, RecursionError) as err:
        raise bad_request(f"the request body is not valid JSON ({err})") from None


def config_error(err: ConfigError) -> APIError:
    """An engine :class:`ConfigError` (a request it cannot serve) as a 400."""
    return bad_request(" ".join(str(err).split()))
