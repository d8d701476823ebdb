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
`max_tokens_in_system` until it ends (429 past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.engine import Request as EngineRequest
from kvlab.errors import ConfigError
from kvlab.generation.text import TextDeltas
from kvlab.lossless.config import LosslessConfig
from kvlab.serve.access import AccessGuard
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import EngineClosedError, ServeEngine, ServerBusyError
from kvlab.serve.metrics import CONTENT_TYPE
from kvlab.serve.options import TokenBudget, resolve
from kvlab.serve.page import PAGE
from kvlab.serve.protocol import (
    MAX_BODY_BYTES,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    is_json_media_type,
    parse_body,
    usage,
)
from kvlab.serve.request import Event, FailedEvent, FinishedEvent, RequestStats, ServeRequest, TokensEvent
from kvlab.timing import timestamp_s

logger = logging.getLogger(__name__)

# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error the client caused or must handle, answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


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

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.kind, code=error.code), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, chat=True)

    return app


def _check_key(config: ServeConfig, request: Request) -> None:
    if config.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time does not depend on where the key and the guess differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


class CompletionRoute:
    """`POST /v1/completions` and `/v1/chat/completions`: check, parse, resolve, hold the request's tokens,
    submit it, then reply whole or as a stream."""

    def __init__(self, engine: ServeEngine, config: ServeConfig, default_lossless: LosslessConfig) -> None:
        self.engine, self.config, self.default_lossless = engine, config, default_lossless
        self.budget = TokenBudget(config.max_tokens_in_system, engine.metrics.tokens_in_system)

    async def __call__(self, request: Request, chat: bool) -> Response:
        arrival_s = timestamp_s()  # latencies count tokenization and validation too
        _check_key(self.config, request)
        body = await self._body(request, ChatCompletionRequest if chat else CompletionRequest)
        try:
            resolved = await run_in_threadpool(resolve, body, self.engine.loaded, self.config, self.default_lossless)
        except ConfigError as error:
            raise APIError(400, str(error)) from None
        try:
            release = self.budget.take(resolved.num_tokens)
        except ServerBusyError as error:
            self.engine.metrics.failed("tokens_full")
            raise APIError(429, str(error), "rate_limit_error", code="tokens_full") from None
        events, cancel = self._submit(resolved, release, arrival_s)
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.engine.loaded.name, chat,
                      body.include_usage)
        deltas = TextDeltas(self.engine.loaded.decode, resolved.config.stop_strings)
        if body.stream:
            return StreamingResponse(
                _stream(self.engine, cancel, events, reply, deltas), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(self.engine, cancel, events, reply, request)

    async def _body(self, request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Any:
        if not is_json_media_type(request.headers.get("content-type")):
            raise APIError(415, "send the body as JSON, with 'Content-Type: application/json'",
                           code="unsupported_media_type")
        raw = await _read_body(request)
        body = await run_in_threadpool(_parse, raw, model)
        name = self.engine.loaded.name
        if body.model is not None and body.model != name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {name!r}",
                           code="model_not_found")
        return body

    def _submit(
        self, resolved: EngineRequest, release: Callable[[], None], arrival_s: float
    ) -> tuple[asyncio.Queue[Event], Callable[[], None]]:
        """Queue the request; returns its events and what cancels it. Its tokens go back when it ends."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            if isinstance(event, (FinishedEvent, FailedEvent)):
                release()
            with contextlib.suppress(RuntimeError):  # the event loop is gone (server stopped): nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        job = ServeRequest(resolved, sink, arrival_s=arrival_s)

        def cancel() -> None:  # the engine sends a cancelled request no further events
            self.engine.cancel(job)
            release()

        try:
            self.engine.submit(job)
        except ServerBusyError as error:
            release()
            self.engine.metrics.failed("queue_full")
            raise APIError(429, str(error), "rate_limit_error", code="queue_full") from None
        except EngineClosedError as error:
            release()
            raise APIError(503, str(error), "server_error", code="shutting_down") from None
        return events, cancel


class Reply:
    """What every chunk or reply of one request repeats."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool) -> None:
        self.id, self.model, self.chat, self.include_usage = request_id, model, chat, include_usage
        self.created = int(time.time())

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        chunk = chunk_body(self.id, self.model, self.chat, self.created, text, finish_reason, first)
        if self.include_usage:
            chunk["usage"] = None
        return chunk


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


def _parse(raw: bytes, model: type[CompletionRequest | ChatCompletionRequest]) -> Any:
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


def _finish_reason(event: FinishedEvent) -> str:
    return "length" if event.output.stop_reason == "length" else "stop"


def _usage(stats: RequestStats) -> dict[str, Any]:
    return usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)


def _failure(event: FailedEvent) -> APIError:
    """A failed request's error: 400 when it asked for what cannot be done, 503 when the shutdown cut it,
    500 when it failed (logged by the engine)."""
    if event.kind == "invalid":
        return APIError(400, event.message)
    if event.kind == "shutdown":
        return APIError(503, event.message, "server_error", code="shutting_down")
    return APIError(500, event.message, "server_error")


async def _complete(
    engine: ServeEngine, cancel: Callable[[], None], events: asyncio.Queue[Event], reply: Reply, request: Request
) -> Response:
    """Wait for the whole reply; a client that goes away cancels the request."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel()
                    return Response(status_code=499)
                continue
            if isinstance(event, FailedEvent):
                raise _failure(event)
            if isinstance(event, FinishedEvent):
                body = completion_body(reply.id, reply.model, reply.chat, event.output.text, _finish_reason(event))
                body["usage"] = _usage(event.stats)
                body["kvlab"] = event.stats.to_dict()
                return JSONResponse(body)
    except asyncio.CancelledError:
        cancel()
        raise


async def _stream(
    engine: ServeEngine, cancel: Callable[[], None], events: asyncio.Queue[Event], reply: Reply, deltas: TextDeltas
) -> AsyncIterator[str]:
    """Server-sent events; the generator is closed when the client disconnects, which cancels the request."""
    finished, num_tokens = False, 0
    try:
        if reply.chat:
            yield _sse(reply.chunk("", first=True))
        while True:
            event = await events.get()
            if isinstance(event, TokensEvent):
                num_tokens += len(event.token_ids)
                text = deltas.push(event.token_ids)
                if text:
                    chunk = reply.chunk(text)
                    chunk["kvlab"] = {"completion_tokens": num_tokens}  # lets a page count tokens, not chunks
                    yield _sse(chunk)
                continue
            finished = True
            if isinstance(event, FailedEvent):
                error = _failure(event)
                yield _sse(error_body(error.message, error.kind, code=error.code))
                break
            assert isinstance(event, FinishedEvent)
            last = reply.chunk(deltas.finish(event.output.text), _finish_reason(event))
            last["kvlab"] = event.stats.to_dict()
            yield _sse(last)
            if reply.include_usage:
                usage_chunk = reply.chunk(None)
                usage_chunk["usage"] = _usage(event.stats)
                yield _sse(usage_chunk)
            break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            cancel()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
