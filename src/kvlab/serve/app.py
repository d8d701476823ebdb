"""The HTTP layer: OpenAI-compatible routes over a `ServeEngine`, API-key check, errors as OpenAI objects.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both stream with server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus) and `GET /` (the playground page).
With an API key, the `/v1` routes need `Authorization: Bearer KEY`, compared in constant time.

Who may talk to the server (`AccessGuard`, before any route): a request whose `Host` is not one the
server answers to is refused (400: DNS rebinding), and one whose `Origin` is neither the server's
own nor an allowed origin is refused (403: another web page driving it). Only allowed origins get
CORS headers and preflight answers. POST bodies must be `application/json` (415 otherwise, so no
HTML form can send one), are counted as they arrive (413 past `MAX_BODY_BYTES`) and parsed within
the bounds of `kvlab.serve.protocol`. Each admitted request holds its prompt + max_tokens against
`max_tokens_in_system` until it ends, waiting in line for them (`kvlab.serve.budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.errors import ConfigError
from kvlab.lossless.config import LosslessConfig
from kvlab.serve.access import AccessGuard
from kvlab.serve.answers import DISCONNECT_POLL_S, APIError, complete, ending_cleanly, stream
from kvlab.serve.body import MAX_BODY_BYTES, BodyError, is_json_media_type, parse_body
from kvlab.serve.budget import TokenBudget
from kvlab.serve.choices import ChoiceReply
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import EngineClosedError, ServeEngine, ServerBusyError
from kvlab.serve.metrics import CONTENT_TYPE
from kvlab.serve.options import ResolvedBody, detokenize, resolve, tokenize
from kvlab.serve.page import PAGE
from kvlab.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvlab.serve.replies import Reply, TokenStrings, error_body, internal_error_body
from kvlab.serve.request import Event, FailedEvent, FinishedEvent, ServeRequest
from kvlab.timing import timestamp_s

logger = logging.getLogger(__name__)


def create_app(
    engine: ServeEngine, config: ServeConfig, default_lossless: LosslessConfig,
    shutdown: Callable[[float], None] | None = None,
) -> FastAPI:
    """The ASGI app; its end (lifespan shutdown) calls `shutdown(0.0)`, `engine.shutdown` by default
    (`kvlab.serve.server.Drain` when a SIGTERM may have drained the engine already)."""
    model_name = engine.loaded.name
    created = int(time.time())
    end = shutdown or engine.shutdown
    completion = CompletionRoute(engine, config, default_lossless)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # After a SIGTERM the drain has already run (this waits for it); otherwise cancel what is left.
        await run_in_threadpool(end, 0.0)

    app = FastAPI(title="kvlab", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(AccessGuard, config=config)

    _add_error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.replace("{{MODEL}}", model_name).replace("{{MODE}}", config.mode))

    @app.get("/health")
    async def health() -> Response:
        if engine.failure is not None:
            return JSONResponse({"status": "engine failed", "error": engine.failure}, status_code=503)
        if engine.closing:  # draining after SIGTERM: the server still answers, and says so
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.healthy:
            return JSONResponse({"status": "engine failed", "error": None}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_key(config, request)
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "kvlab"}
        return JSONResponse({"object": "list", "data": [entry]})

    _add_token_routes(app, engine, config, completion.strings)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI error object: what the client caused, HTTP errors, and the unexpected."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.kind, code=error.code), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        # Starlette's outermost middleware answers with this (so every route and AccessGuard are inside
        # it), then re-raises for the server to log the traceback once: uvicorn's "Exception in ASGI
        # application". A stream that fails once started ends in `ending_cleanly` instead.
        return JSONResponse(internal_error_body(error), status_code=500)


def _add_token_routes(app: FastAPI, engine: ServeEngine, config: ServeConfig, strings: TokenStrings) -> None:
    """`POST /tokenize` and `/detokenize`, as vLLM's server has them."""

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        _check_key(config, request)
        body = await run_in_threadpool(_parse, await _json_body(request), TokenizeRequest)
        context = engine.loaded.architecture.max_context
        limit = min(config.max_prompt_tokens or context, context - 1)
        try:
            tokens = await run_in_threadpool(tokenize, body, engine.loaded, limit)
        except ConfigError as error:
            raise APIError(400, str(error)) from None
        texts = [strings(token) for token in tokens] if body.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": texts})

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        _check_key(config, request)
        body = await run_in_threadpool(_parse, await _json_body(request), DetokenizeRequest)
        try:
            text = await run_in_threadpool(detokenize, body, engine.loaded)
        except ConfigError as error:
            raise APIError(400, str(error)) from None
        return JSONResponse({"prompt": text})


def _check_key(config: ServeConfig, request: Request) -> None:
    if config.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time does not depend on where the key and the guess differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


class CompletionRoute:
    """`POST /v1/completions` and `/v1/chat/completions`: check, parse, resolve, hold the request's tokens,
    submit one engine request per prompt, then reply whole or as a stream."""

    def __init__(self, engine: ServeEngine, config: ServeConfig, default_lossless: LosslessConfig) -> None:
        self.engine, self.config, self.default_lossless = engine, config, default_lossless
        self.budget = TokenBudget.for_server(config, engine.metrics)
        self.strings = TokenStrings(engine.loaded.decode)

    async def __call__(self, request: Request, chat: bool) -> Response:
        arrival_s = timestamp_s()  # latencies count tokenization and validation too
        _check_key(self.config, request)
        body = await self._body(request, ChatCompletionRequest if chat else CompletionRequest)
        try:
            resolved = await run_in_threadpool(resolve, body, self.engine.loaded, self.config, self.default_lossless)
            tokens = self.budget.hold(resolved.num_tokens)  # 400 past one request's share
        except ConfigError as error:
            raise APIError(400, str(error)) from None
        except ServerBusyError as error:  # the tokens do not fit and the line for them is full
            self.engine.metrics.failed("tokens_full")
            raise APIError(429, str(error), "rate_limit_error", code="tokens_full") from None
        if not await tokens.wait(request.is_disconnected, DISCONNECT_POLL_S):
            self.engine.metrics.failed("cancelled")
            return Response(status_code=499)
        events, cancel = self._submit(resolved, tokens.release, arrival_s)
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.engine.loaded.name, chat)
        choices = [ChoiceReply(index, reply, resolved, self.engine.loaded, self.strings)
                   for index in range(len(resolved.requests))]
        if body.stream:
            usage_flags = (body.include_usage, body.continuous_usage)
            return StreamingResponse(
                ending_cleanly(stream(cancel, events, reply, choices, usage_flags)), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await complete(cancel, events, reply, choices, request)

    async def _body(self, request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Any:
        raw = await _json_body(request)
        body = await run_in_threadpool(_parse, raw, model)
        name = self.engine.loaded.name
        if body.model is not None and body.model != name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {name!r}",
                           code="model_not_found")
        return body

    def _submit(
        self, resolved: ResolvedBody, release: Callable[[], None], arrival_s: float
    ) -> tuple[asyncio.Queue[tuple[int, Event]], Callable[[], None]]:
        """Queue one engine request per prompt; returns their events, tagged with the choice's index, and
        what cancels them all. The tokens held go back once every one has ended."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        num_open = [len(resolved.requests)]
        lock = threading.Lock()

        def ended() -> None:
            with lock:
                num_open[0] -= 1
                if num_open[0] == 0:
                    release()

        def sink_for(index: int) -> Callable[[Event], None]:
            def sink(event: Event) -> None:
                if isinstance(event, (FinishedEvent, FailedEvent)):
                    ended()
                with contextlib.suppress(RuntimeError):  # the event loop is gone (server stopped): nobody listens
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return sink

        jobs = [ServeRequest(engine_request, sink_for(index), arrival_s=arrival_s)
                for index, engine_request in enumerate(resolved.requests)]

        def cancel() -> None:  # the engine sends a cancelled request no further events
            for job in jobs:
                self.engine.cancel(job)
            release()

        for number, job in enumerate(jobs):
            try:
                self.engine.submit(job)
            except (ServerBusyError, EngineClosedError) as error:
                for submitted in jobs[:number]:
                    self.engine.cancel(submitted)
                release()
                if isinstance(error, EngineClosedError):
                    raise APIError(503, str(error), "server_error", code="shutting_down") from None
                self.engine.metrics.failed("queue_full")
                raise APIError(429, str(error), "rate_limit_error", code="queue_full") from None
        return events, cancel


async def _json_body(request: Request) -> bytes:
    """The raw body of a JSON request (415 for another media type)."""
    if not is_json_media_type(request.headers.get("content-type")):
        raise APIError(415, "send the body as JSON, with 'Content-Type: application/json'",
                       code="unsupported_media_type")
    return await _read_body(request)


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `MAX_BODY_BYTES` (declared or counted)."""
    too_large = APIError(413, f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies too: counted as they arrive, never held past the limit
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, model: type[BaseModel]) -> Any:
    """The validated body (run off the event loop: a large body takes a while to parse)."""
    try:
        data = parse_body(raw)
    except BodyError as error:
        raise APIError(400, str(error)) from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        raise APIError(400, f"{where}: {message}") from None
