"""``POST /v1/completions`` and ``POST /v1/chat/completions`` on the engine.

A request becomes one engine request per choice: ``n`` choices of each prompt (completions
take a list of prompts; choice ``i`` belongs to prompt ``i // n``), choice ``i`` seeded
``seed + i``; the engine prefills a prompt once for its choices. Unstreamed, the handler
waits for every choice (and cancels them when the client disconnects); streamed, every engine
update becomes an SSE event ``data: {chunk}``, the stream ends with ``data: [DONE]``, and a
client that goes away cancels the choices (the generator is closed, its ``finally`` cancels
them). An engine failure is a 500, or in a stream one ``data: {"error": ...}`` event before
``[DONE]``.

``echo`` with ``logprobs`` (lm-evaluation-harness's log-likelihoods) scores the prompt with
:meth:`~exitlm.infer.engine.Engine.score` at the final layer, on the engine thread; generated
tokens carry the log-probabilities of the distribution that chose them (an early exit's, for
a token that exited early).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from exitlm.config import ConfigError
from exitlm.infer.engine import EngineBroken, EngineFull
from exitlm.infer.request import Request, Update
from exitlm.infer.result import TokenLogprob
from exitlm.serve import formats
from exitlm.serve.errors import APIError, bad_request
from exitlm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse,
)
from exitlm.serve.runner import EngineFailure, RequestGroup
from exitlm.serve.state import ServerState, config_error, read_json

DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion that gives none (OpenAI's default); chat completions default
to the rest of the context (both at most ``--max-completion-tokens``)."""
PING_S = 15.0
"""Seconds between SSE keep-alive comments."""


@dataclass
class Plan:
    """One HTTP generation request, resolved for the engine."""

    chat: bool
    req: GenerationRequest
    prompts: list[list[int]]
    max_tokens: int
    logprobs: int | None
    echo_texts: list[str] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = 0

    @property
    def n(self) -> int:
        return self.req.n

    @property
    def per_token(self) -> bool:
        """Whether chunks must carry every token (log-probabilities or exit layers)."""
        return self.logprobs is not None or self.req.return_exit_layers


# ----- the two endpoints ----------------------------------------------------------------------

async def completions(state: ServerState, http: HTTPRequest) -> Response:
    req = parse(CompletionRequest, await read_json(http, state.limits))
    state.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    raw = req.prompts()
    state.limits.check_prompts(len(raw), req.n, state.engine.max_queue)
    if req.max_tokens is None:
        max_tokens = state.limits.default_completion(DEFAULT_COMPLETION_TOKENS)
    else:
        max_tokens = req.max_tokens
        state.limits.check_completion(max_tokens)
    prompts = await state.prompts.encode(raw, "prompt")
    for ids in prompts:
        state.check_context(len(ids), max_tokens, "prompt")
    echo = None
    if req.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p, skip_special_tokens=False)
                for p in raw]
    return await _serve(state, http, Plan(False, req, prompts, max_tokens, req.logprobs, echo))


async def chat_completions(state: ServerState, http: HTTPRequest) -> Response:
    req = parse(ChatCompletionRequest, await read_json(http, state.limits))
    state.check_model(req.model)
    state.limits.check_prompts(1, req.n, state.engine.max_queue)
    asked = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                 None)
    if asked is not None:
        state.limits.check_completion(asked)
    ids = await state.prompts.encode_chat(req.chat(), req.add_generation_prompt)
    max_tokens = (asked if asked is not None
                  else state.limits.default_completion(max(0, state.context - len(ids))))
    state.check_context(len(ids), max_tokens, "messages")
    return await _serve(state, http, Plan(True, req, [ids], max_tokens, req.token_logprobs))


async def _serve(state: ServerState, http: HTTPRequest, plan: Plan) -> Response:
    plan.created = int(time.time())
    options = plan.req.strategy_options(state.engine.strategy)
    ids = [p for p in plan.prompts for _ in range(plan.n)]
    sampling = [plan.req.sampling(plan.max_tokens, plan.logprobs, i) for i in range(len(ids))]
    try:
        group = state.runner.submit(ids, sampling, options)
    except EngineFull as err:
        raise APIError(503, f"{err}; retry later", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except ConfigError as err:
        raise config_error(err, "messages" if plan.chat else "prompt") from None
    except EngineBroken as err:
        raise APIError(503, str(err), code="engine_unavailable") from None
    log = _log(http)
    log.update(n=plan.n, stream=plan.req.stream, prompt_tokens=sum(map(len, plan.prompts)))
    try:
        scores = await _prompt_scores(state, plan)
    except BaseException:
        group.cancel()
        raise
    if plan.req.stream:
        # the background task also covers a client gone before the stream started
        return EventSourceResponse(_stream(state, plan, group, scores, log), sep="\n",
                                   ping=PING_S, shutdown_grace_period=state.drain_timeout,
                                   background=BackgroundTask(group.cancel))
    return await _complete(state, http, plan, group, scores, log)


async def _prompt_scores(state: ServerState, plan: Plan
                         ) -> list[list[TokenLogprob | None]] | None:
    if plan.echo_texts is None or plan.logprobs is None:
        return None
    engine, top = state.engine, plan.logprobs
    return await state.runner.call(lambda: [engine.score(ids, top) for ids in plan.prompts])


# ----- unstreamed -----------------------------------------------------------------------------

async def _complete(state: ServerState, http: HTTPRequest, plan: Plan, group: RequestGroup,
                    scores: list[list[TokenLogprob | None]] | None, log: dict[str, Any]
                    ) -> Response:
    async def drain() -> None:
        async for _ in group.updates():
            pass

    collector = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():
            log["note"] = "client disconnected"
            return Response(status_code=499)
        collector.result()
    except EngineFailure as err:
        raise APIError(500, str(err), code="engine_failure") from None
    finally:
        watcher.cancel()
        collector.cancel()
        group.cancel()
    reqs = group.requests
    log.update(completion_tokens=sum(len(r.token_ids) for r in reqs),
               finish=_reasons(reqs))
    choices = [_choice(state, plan, i, r, scores) for i, r in enumerate(reqs)]
    body = {**_head(state, plan, "chat.completion" if plan.chat else "text_completion"),
            "choices": choices,
            "usage": formats.usage(plan.prompts, reqs, plan.n),
            "early_exit": formats.early_exit(reqs, state.num_layers, state.strategy)}
    return JSONResponse(body)


def _choice(state: ServerState, plan: Plan, i: int, r: Request,
            scores: list[list[TokenLogprob | None]] | None) -> dict[str, Any]:
    reason = formats.FINISH[r.finish_reason or "length"]
    if plan.chat:
        out: dict[str, Any] = {
            "index": i, "message": {"role": "assistant", "content": r.text},
            "logprobs": (formats.chat_logprobs(state.token_text, r.logprobs)
                         if plan.logprobs is not None else None),
            "finish_reason": reason}
    else:
        p = i // plan.n
        text, tokens = r.text, list(r.token_ids)
        entries: list[TokenLogprob | None] = list(r.logprobs)
        if plan.echo_texts is not None:
            text = plan.echo_texts[p] + text
            tokens = plan.prompts[p] + tokens
            entries = (scores[p] if scores is not None else []) + entries
        out = {"index": i, "text": text,
               "logprobs": (formats.completion_logprobs(state.token_text, tokens, entries)
                            if plan.logprobs is not None else None),
               "finish_reason": reason}
    if plan.req.return_exit_layers:
        out["exit_layers"] = list(r.exit_layers)
    return out


async def _disconnected(http: HTTPRequest) -> None:
    """Return when the client has gone away (the body has been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


# ----- streamed -------------------------------------------------------------------------------

async def _stream(state: ServerState, plan: Plan, group: RequestGroup,
                  scores: list[list[TokenLogprob | None]] | None, log: dict[str, Any]
                  ) -> AsyncIterator[str]:
    reqs = group.requests
    left = len(reqs)
    offsets = [0] * len(reqs)
    usage = plan.req.include_usage
    try:
        for i in range(len(reqs)):
            first = _opening(state, plan, i, scores, offsets)
            if first is not None:
                yield _dumps(_chunk(state, plan, [first]))
        async for i, u in group.updates():
            left -= u.finished
            if not (u.text or u.finished or (u.token_ids and plan.per_token)):
                continue
            chunk = _chunk(state, plan, [_delta(state, plan, i, u, offsets)])
            if left == 0 and not usage:
                chunk["early_exit"] = formats.early_exit(reqs, state.num_layers, state.strategy)
            yield _dumps(chunk)
        if usage:
            yield _dumps({**_chunk(state, plan, []),
                          "usage": formats.usage(plan.prompts, reqs, plan.n),
                          "early_exit": formats.early_exit(reqs, state.num_layers,
                                                           state.strategy)})
    except EngineFailure as err:
        yield _dumps(APIError(500, str(err), code="engine_failure").body())
        log["note"] = "engine failure"
    finally:
        group.cancel()
        log.update(completion_tokens=sum(len(r.token_ids) for r in reqs),
                   finish=_reasons(reqs))
    yield "[DONE]"


def _opening(state: ServerState, plan: Plan, i: int,
             scores: list[list[TokenLogprob | None]] | None, offsets: list[int]
             ) -> dict[str, Any] | None:
    """A choice's first chunk: the assistant role (chat) or the echoed prompt."""
    if plan.chat:
        return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
    if plan.echo_texts is None:
        return None
    p = i // plan.n
    lp = None
    if plan.logprobs is not None:
        lp = formats.completion_logprobs(state.token_text, plan.prompts[p],
                                         scores[p] if scores is not None else [])
    offsets[i] = len(plan.echo_texts[p])
    return {"index": i, "text": plan.echo_texts[p], "logprobs": lp, "finish_reason": None}


def _delta(state: ServerState, plan: Plan, i: int, u: Update, offsets: list[int]
           ) -> dict[str, Any]:
    """The chunk choice of one engine update."""
    reason = formats.FINISH[u.request.finish_reason or "length"] if u.finished else None
    if plan.chat:
        out: dict[str, Any] = {
            "index": i, "delta": {"content": u.text} if u.text else {},
            "logprobs": (formats.chat_logprobs(state.token_text, u.logprobs)
                         if plan.logprobs is not None else None),
            "finish_reason": reason}
    else:
        lp = None
        if plan.logprobs is not None:
            lp = formats.completion_logprobs(state.token_text, u.token_ids, u.logprobs,
                                             offsets[i])
        offsets[i] += len(u.text)
        out = {"index": i, "text": u.text, "logprobs": lp, "finish_reason": reason}
    if plan.req.return_exit_layers:
        out["exit_layers"] = list(u.exit_layers)
    return out


def _chunk(state: ServerState, plan: Plan, choices: list[dict[str, Any]]) -> dict[str, Any]:
    out = {**_head(state, plan, "chat.completion.chunk" if plan.chat else "text_completion"),
           "choices": choices}
    if plan.req.include_usage:
        out["usage"] = None
    return out


# ----- helpers --------------------------------------------------------------------------------

def _head(state: ServerState, plan: Plan, obj: str) -> dict[str, Any]:
    prefix = "chatcmpl-" if plan.chat else "cmpl-"
    return {"id": prefix + plan.id, "object": obj, "created": plan.created,
            "model": state.model_name}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _reasons(reqs: list[Request]) -> str:
    return ",".join(sorted({r.finish_reason or "running" for r in reqs}))


def _log(http: HTTPRequest) -> dict[str, Any]:
    """The dict the request's log line is written from (:mod:`exitlm.serve.app`)."""
    info: dict[str, Any] = http.scope.setdefault("exitlm_log", {})
    return info
