"""The HTTP layer: OpenAI-compatible routes over a `ServeEngine`, API-key check, errors as OpenAI objects.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both stream with server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus) and `GET /` (the playground page).
With an API key, the `/v1` routes need `Authorization: Bearer KEY`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.errors import ConfigError
from kvlab.generation.text import TextDeltas
from kvlab.lossless.config import LosslessConfig
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import EngineClosedError, ServeEngine, ServerBusyError
from kvlab.serve.metrics import CONTENT_TYPE
from kvlab.serve.options import resolve
from kvlab.serve.page import PAGE
from kvlab.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    usage,
)
from kvlab.serve.request import Event, FailedEvent, FinishedEvent, RequestStats, ServeRequest, TokensEvent

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error the client caused or must handle, answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def create_app(engine: ServeEngine, config: ServeConfig, default_lossless: LosslessConfig) -> FastAPI:
    """The ASGI app; shutting it down (lifespan end) shuts the engine down."""
    model_name = engine.loaded.name
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Uvicorn has let open requests finish for `shutdown_timeout_s`; cancel what is left.
        await run_in_threadpool(engine.shutdown, 0.0)

    app = FastAPI(title="kvlab", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.kind, code=error.code), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), "invalid_request_error"), status_code=error.status_code)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        expected = config.api_key.encode()
        # compare_digest on equal-length inputs: the time does not depend on where they differ.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.replace("{{MODEL}}", model_name).replace("{{MODE}}", config.mode))

    @app.get("/health")
    async def health() -> Response:
        if engine.failure is not None or not engine.healthy:
            return JSONResponse({"status": "engine failed", "error": engine.failure}, status_code=503)
        if engine.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_key(request)
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "kvlab"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def serve(request: Request, chat: bool) -> Response:
        arrival_s = time.perf_counter()  # latencies count tokenization and validation too
        check_key(request)
        body = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}", code="model_not_found")
        try:
            resolved = await run_in_threadpool(resolve, body, engine.loaded, config, default_lossless)
        except ConfigError as error:
            raise APIError(400, str(error)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
                pass

        job = ServeRequest(resolved.prompt, resolved.config, resolved.mode, resolved.compressor, resolved.lossless,
                           resolved.cache_salt, sink, arrival_s=arrival_s)
        try:
            engine.submit(job)
        except ServerBusyError as error:
            engine.metrics.failed("queue_full")
            raise APIError(429, str(error), "rate_limit_error", code="queue_full") from None
        except EngineClosedError as error:
            raise APIError(503, str(error), "server_error", code="shutting_down") from None
        reply = Reply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name, chat, body.include_usage)
        deltas = TextDeltas(engine.loaded.decode, resolved.config.stop_strings)
        if body.stream:
            return StreamingResponse(
                _stream(engine, job, events, reply, deltas), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(engine, job, events, reply, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    return app


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


async def _parse(request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
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


async def _complete(
    engine: ServeEngine, job: ServeRequest, events: asyncio.Queue[Event], reply: Reply, request: Request
) -> Response:
    """Wait for the whole reply; a client that goes away cancels the request."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    return Response(status_code=499)
                continue
            if isinstance(event, FailedEvent):
                raise APIError(500, event.message, "server_error")
            if isinstance(event, FinishedEvent):
                body = completion_body(reply.id, reply.model, reply.chat, event.output.text, _finish_reason(event))
                body["usage"] = _usage(event.stats)
                body["kvlab"] = event.stats.to_dict()
                return JSONResponse(body)
    except asyncio.CancelledError:
        engine.cancel(job)
        raise


async def _stream(
    engine: ServeEngine, job: ServeRequest, events: asyncio.Queue[Event], reply: Reply, deltas: TextDeltas
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
                yield _sse(error_body(event.message, "server_error"))
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
            engine.cancel(job)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
