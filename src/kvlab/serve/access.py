"""Who may reach the server: the Host a request names and the web page (Origin) it comes from.

`AccessGuard` wraps the app (ASGI middleware) and applies `kvlab.serve.config.AccessPolicy` before any
route runs: a Host the server does not answer to (DNS rebinding) gets 400, a cross-origin request from
an origin `--allowed-origins` does not name gets 403, and only allowed origins get CORS headers.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlab.serve.config import AccessPolicy, ServeConfig
from kvlab.serve.replies import error_body


class AccessGuard:
    """ASGI middleware: answer only requests for a Host the server answers to, from its own pages or an
    allowed origin (`AccessPolicy`); CORS headers and preflight answers go to allowed origins alone."""

    def __init__(self, app: ASGIApp, config: ServeConfig) -> None:
        self.app, self.policy, self.port = app, AccessPolicy.of(config), config.port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host", "").strip().lower()
        server = scope.get("server")  # the port the connection came in on (port 0 is known only then)
        if not self.policy.allows_host(host, int(server[1]) if server and server[1] is not None else self.port):
            message = (f"this server does not answer to Host {host[:100]!r}; "
                       "start it with --allowed-hosts NAME[:PORT] to add that name")
            await _send_error(send, 400, message, "invalid_host")
            return
        origin = headers.get("origin")
        if origin is None or AccessPolicy.is_own_origin(origin, host):
            await self.app(scope, receive, send)  # not from a web page, or from one the server served
            return
        if not self.policy.allows_origin(origin):
            message = (f"requests from pages of {origin[:100]!r} are refused; "
                       "start the server with --allowed-origins ORIGIN to allow them")
            await _send_error(send, 403, message, "origin_not_allowed")
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            allowed = headers.get("access-control-request-headers") or "authorization, content-type"
            await send({"type": "http.response.start", "status": 204, "headers": [
                *cors, (b"access-control-allow-methods", b"GET, POST"),
                (b"access-control-allow-headers", allowed.encode("latin-1")), (b"access-control-max-age", b"600"),
            ]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "http.response.body", "body": body})
