"""The ASGI application: routes, API-key check, errors in OpenAI's shape, one log line per
request, and the engine thread's start and stop (the lifespan).

Routes (OpenAI's and vLLM's):

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`exitlm.serve.generation`);
* ``GET /v1/models``: the served model, with its strategy, depth, exits and the options a
  request may set; ``GET /v1/models/{id}``: that model object (a 404 naming any other id);
* ``POST /tokenize`` (``prompt``, or chat ``messages``) and ``POST /detokenize``
  (``tokens``);
* ``GET /health``: ``{"status": "ok", "running": ..., "waiting": ...}`` (no API key); 503
  with ``"status": "unavailable"`` and the reason once the engine cannot serve any more;
* ``GET /metrics``: Prometheus text (:mod:`exitlm.serve.metrics`, no API key).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exitlm.serve import generation
from exitlm.serve.errors import APIError, bad_request
from exitlm.serve.prompts import trim_memory
from exitlm.serve.protocol import DetokenizeRequest, TokenizeRequest, parse
from exitlm.serve.state import ServerState, read_json

log = logging.getLogger("exitlm.serve")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
          "/health", "/metrics")
"""The paths counted by name in ``exitlm_http_requests_total`` (others, ``/v1/models/{id}``
included, as ``other``)."""


def create_app(state: ServerState) -> FastAPI:
    """The server's application over ``state`` (its engine thread starts with the app)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.runner.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await state.runner.stop()
            state.prompts.close()

    app = FastAPI(title="exitlm", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(RequestLog, state=state)  # type: ignore[arg-type]

    async def authorized(request: HTTPRequest) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                           "<key>'", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authorized)])

    @api.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await generation.completions(state, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        return await generation.chat_completions(state, request)

    def model_card() -> dict[str, Any]:
        engine = state.engine
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "exitlm", "max_model_len": state.context,
                "exitlm": {"strategy": state.strategy, "num_layers": state.num_layers,
                           "exit_layers": list(engine.model.config.exit_layers),
                           "options": engine.decoder.resolved_options(),
                           "per_request_options": sorted(engine.strategy.per_request),
                           "max_batch": engine.max_batch}}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{state.model_name!r}", param="model", code="model_not_found")
        return model_card()

    @api.post("/tokenize")
    async def tokenize(request: HTTPRequest) -> dict[str, Any]:
        req = parse(TokenizeRequest, await read_json(request, state.limits))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        if req.prompt is not None:
            ids = (await state.prompts.encode([req.prompt], "prompt"))[0]
        else:
            ids = await state.prompts.encode_chat(
                [{"role": m.role, "content": m.text()} for m in req.messages or []],
                req.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context}

    @api.post("/detokenize")
    async def detokenize(request: HTTPRequest) -> dict[str, Any]:
        req = parse(DetokenizeRequest, await read_json(request, state.limits))
        state.check_model(req.model)
        vocab = state.engine.model.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})",
                              "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Any:
        body = {"status": "ok", "model": state.model_name, "strategy": state.strategy,
                "running": state.runner.running, "waiting": state.runner.waiting,
                "engine_failures": state.runner.failures}
        broken = state.engine.broken
        if broken is not None:  # it will not recover: a supervisor should restart it
            return JSONResponse({**body, "status": "unavailable", "reason": broken},
                                status_code=503)
        return body

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    app.include_router(api)
    return app


# ----- errors ------------------------------------------------------------------------------

async def _api_error(request: HTTPRequest, err: APIError) -> JSONResponse:
    request.scope.setdefault("exitlm_log", {})["error"] = repr(err.message[:160])
    return err.response()


async def _http_error(_request: HTTPRequest, err: HTTPException) -> JSONResponse:
    return APIError(err.status_code, str(err.detail), headers=err.headers).response()


async def _unexpected(_request: HTTPRequest, err: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, so the server's log gets the traceback
    return APIError(500, f"internal server error ({type(err).__name__})").response()


# ----- one log line per request ----------------------------------------------------------------

class RequestLog:
    """ASGI middleware: after the response has been sent (a stream included), log one line -
    client, method, path, status, seconds and what the handler noted (tokens, finish
    reasons) - and count the request in ``exitlm_http_requests_total``."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        info: dict[str, Any] = scope.setdefault("exitlm_log", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            client = scope.get("client") or ("-", 0)
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            log.info('%s:%s "%s %s" %d %.3fs%s', client[0], client[1], scope.get("method"),
                     path, status, time.perf_counter() - t0, f" {extra}" if extra else "")
            self.state.metrics.http_request(path if path in ROUTES else "other", status)
            if scope.pop("exitlm_large", False):  # its objects are freed by now
                asyncio.get_running_loop().run_in_executor(None, trim_memory)
