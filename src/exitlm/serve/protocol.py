"""The request bodies the server accepts, as typed pydantic models, and what they become for
the engine (:class:`~exitlm.infer.options.SamplingOptions`, per-request strategy options).

The fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` and the extras
vLLM adds (``top_k``, ``ignore_eos``, ``stop_token_ids``, ``add_generation_prompt``).
exitlm's own extras (sent through the ``openai`` client's ``extra_body``):

* the served strategy's per-request options by name (``threshold``, ``max_pending`` for
  ``early-exit``; ``num_speculations``, ``draft_threshold`` for ``self-spec``); an option of
  another strategy, or one fixed when the server started, is a 400 naming it;
* ``return_exit_layers: true`` adds each choice's ``exit_layers`` (one per token).

Validation is strict (``"5"`` is not an integer, ``NaN`` is not a number) and the first
problem becomes a 400 naming its field. Unknown fields are refused, as OpenAI does, except a
few that change nothing here (``user``, ``metadata``, ``store``, ...).
"""

from __future__ import annotations

import typing
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from exitlm.config import ConfigError
from exitlm.errors import short_repr
from exitlm.infer.flags import strategies_taking
from exitlm.infer.options import MAX_LOGPROBS, SamplingOptions
from exitlm.infer.strategies import STRATEGIES, Strategy
from exitlm.schema import convert, describe, field_hints
from exitlm.serve.errors import APIError, bad_request

MAX_N = 16
"""The most choices (``n``) one request may ask for."""
MAX_STOP = 16
"""The most stop strings one request may give."""
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and ignored: they change nothing about the tokens."""
M = TypeVar("M", bound=BaseModel)
_SHAPES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of "
              "lists of token ids",
    "stop": "stop must be a string or a list of strings",
}
STRATEGY_FIELDS = frozenset(
    f for s in STRATEGIES.values() for f in s.options_type.__dataclass_fields__)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str = Field(min_length=1, max_length=64)
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class GenerationRequest(_Strict):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_exit_layers: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def strategy_options(self, strategy: Strategy) -> dict[str, Any]:
        """The served strategy's per-request options this request sets (a 400 for unknown
        fields and for options that are not per-request here)."""
        out: dict[str, Any] = {}
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS:
                continue
            if name not in STRATEGY_FIELDS:
                raise bad_request(f"unrecognized request argument supplied: {name}", name)
            if name not in strategy.per_request:
                where = ("is fixed when the server starts"
                         if name in strategy.options_type.__dataclass_fields__
                         else f"belongs to strategy {'/'.join(strategies_taking(name))}")
                raise bad_request(
                    f"{name} {where}; the server runs strategy {strategy.name!r}, whose "
                    f"per-request options are {sorted(strategy.per_request) or 'none'}", name)
            out[name] = _strategy_value(strategy, name, value)
        return out

    def sampling(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingOptions:
        """The engine's options for choice ``index`` (its seed is ``seed + index`` modulo
        2**32, the convention of :func:`exitlm.infer.generate`)."""
        seed = None if self.seed is None else (self.seed + index) % 2**32
        try:
            return SamplingOptions(
                temperature=self.temperature, top_k=max(0, self.top_k), top_p=self.top_p,
                seed=seed, max_new_tokens=max_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                stop_strings=self.stop_strings, ignore_eos=self.ignore_eos, logprobs=logprobs)
        except ConfigError as err:
            key = str(err).split(":", 1)[0].split("[", 1)[0]
            raise bad_request(str(err), _SAMPLING_FIELDS.get(key)) from None


_SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                    "seed": "seed", "max_new_tokens": "max_tokens",
                    "stop_token_ids": "stop_token_ids", "stop_strings": "stop",
                    "logprobs": "logprobs"}
"""The request field behind each :class:`SamplingOptions` field (named by its errors)."""


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("a prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: str | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @property
    def token_logprobs(self) -> int | None:
        """Alternatives per token for the engine (``None``: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Strict):
    """``POST /tokenize``: text, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def _strategy_value(strategy: Strategy, name: str, value: Any) -> Any:
    """``value`` of per-request option ``name`` checked by the option's type, strictly: a JSON
    number for a number (``"0.5"`` is not one, though a YAML config may spell it so), null
    only where the option takes it; a 400 naming the option otherwise."""
    hint = field_hints(strategy.options_type)[name]
    optional = type(None) in typing.get_args(hint)
    numeric = not isinstance(value, bool) and isinstance(value, (int, float))
    if not (numeric or (value is None and optional)):
        raise bad_request(f"{name}: expected {describe(hint)}, got {short_repr(value)}", name)
    try:
        return convert(value, hint, name)
    except ConfigError as err:
        raise bad_request(" ".join(str(err).split()), name) from None


def parse(model: type[M], body: Any) -> M:
    """``body`` as a ``model``, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err) from None


def validation_error(err: ValidationError) -> APIError:
    """The first problem of ``err`` as a 400 (``param``: the top-level field)."""
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"]]
    param = loc[0] if loc else None
    # union members appear in the location by type name: keep the field and indexes only
    where = ".".join(loc[:1] + [x for x in loc[1:] if x.isdigit() or (
        x.isidentifier() and x not in ("str", "int", "float", "bool"))])
    msg = first["msg"]
    if first["type"] == "missing":
        return bad_request(f"missing required argument: {where}", param)
    if first["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {where}", param)
    if param in _SHAPES and first["type"].endswith("_type"):
        return bad_request(_SHAPES[param], param)
    if first["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    return bad_request(f"{where}: {msg}", param)
