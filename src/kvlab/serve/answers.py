"""From a submitted request's engine events to its HTTP answer: one JSON reply, or a stream of
server-sent events; a failed request answers as an OpenAI error object, never as an answer.

A client that goes away cancels its request: a whole reply polls for the disconnect, a stream's
generator is closed by the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvlab.serve.choices import ChoiceReply, kvlab_figures, total_usage
from kvlab.serve.replies import Reply, error_body, internal_error_body
from kvlab.serve.request import Event, FailedEvent, FinishedEvent, TokensEvent

logger = logging.getLogger(__name__)

# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error the client caused or must handle, answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def failure(event: FailedEvent, reply_id: str) -> APIError:
    """A failed request's error: 400 when it asked for what cannot be done, 503 when the shutdown cut it,
    500 when it failed: naming the request and the error's kind ("Type: message"), whose message may show
    paths and values and goes to the log, under the request's id, beside the engine's traceback."""
    if event.kind == "invalid":
        return APIError(400, event.message)
    if event.kind == "shutdown":
        return APIError(503, event.message, "server_error", code="shutting_down")
    logger.error("request %s failed: %s", reply_id, event.message)
    kind = event.message.partition(":")[0]
    named = f" ({kind})" if kind.isidentifier() else ""
    return APIError(500, f"request {reply_id} failed{named}; the server's log has the details", "internal_error")


async def complete(
    cancel: Callable[[], None], events: asyncio.Queue[tuple[int, Event]], reply: Reply, choices: list[ChoiceReply],
    request: Request,
) -> Response:
    """Wait for every choice; a client that goes away cancels the request, a failed choice fails it."""
    finished: dict[int, FinishedEvent] = {}
    try:
        while len(finished) < len(choices):
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel()
                    return Response(status_code=499)
                continue
            if isinstance(event, FailedEvent):
                cancel()
                raise failure(event, reply.id)
            if isinstance(event, FinishedEvent):
                finished[index] = event
    except asyncio.CancelledError:
        cancel()
        raise
    ordered = [finished[index] for index in range(len(choices))]
    generate = choices[0].generate
    body = reply.body([choice.whole(event) for choice, event in zip(choices, ordered, strict=True)],
                      total_usage(ordered, generate))
    body["kvlab"] = kvlab_figures([event.stats for event in ordered])
    return JSONResponse(body)


async def stream(
    cancel: Callable[[], None], events: asyncio.Queue[tuple[int, Event]], reply: Reply, choices: list[ChoiceReply],
    usage_flags: tuple[bool, bool],
) -> AsyncGenerator[str, None]:
    """Server-sent events, one choice per chunk; the generator is closed when the client disconnects,
    which cancels the request. `usage_flags`: (a usage chunk at the end, usage in every chunk)."""
    include_usage, continuous_usage = usage_flags
    finished: dict[int, FinishedEvent] = {}
    try:
        while len(finished) < len(choices):
            index, event = await events.get()
            choice = choices[index]
            if isinstance(event, FailedEvent):
                error = failure(event, reply.id)
                yield _sse(error_body(error.message, error.kind, code=error.code))
                break
            if isinstance(event, TokensEvent):
                fields = choice.on_tokens(event)
                extra = None
            else:
                assert isinstance(event, FinishedEvent)
                finished[index] = event
                fields, extra = choice.on_finished(event), event.stats.to_dict()
            if fields is None:
                continue
            chunk = reply.chunk([fields])
            chunk["kvlab"] = extra or {"completion_tokens": choice.num_tokens}  # a page counts tokens, not chunks
            if include_usage or continuous_usage:
                chunk["usage"] = choice.usage_so_far() if continuous_usage else None
            yield _sse(chunk)
        else:
            if include_usage:
                ordered = [finished[index] for index in range(len(choices))]
                usage_chunk = reply.chunk([])
                usage_chunk["usage"] = total_usage(ordered, choices[0].generate)
                yield _sse(usage_chunk)
        yield "data: [DONE]\n\n"
    finally:
        if len(finished) < len(choices):
            cancel()


async def ending_cleanly(chunks: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """`chunks`, then an error event and `[DONE]` if making them fails, rather than a cut connection (the
    response has started: no status can change). The traceback is logged here, once; closing this
    closes `chunks`, whose own cleanup cancels the request."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:
        logger.error("a streamed reply failed", exc_info=error)
        yield _sse(internal_error_body(error))
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
