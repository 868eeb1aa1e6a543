"""What every request of the HTTP application passes through before and after its handler: plain ASGI
middleware (the API key, the body size limit, the request's log line) and the error shaping (every error
in OpenAI's shape, whatever raised it).

Plain ASGI on purpose: behind starlette's BaseHTTPMiddleware (`@app.middleware("http")`) an endpoint's
`request.is_disconnected()` never sees the client leave, so a non-streaming request whose client
disconnected ran to its last token instead of being aborted.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import APIError
from .warmup import WARMUP_SCOPE_KEY

log = logging.getLogger("dsv4.serve")

TALLY = "dsv4.tally"  # the ASGI scope's key of a request's token counts, for its log line


# ------------------------------------------------------------------------------------------ errors
def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def send_error(send, e: APIError) -> None:
    """Answer with `e` at the ASGI level (before any application ran)."""
    body = json.dumps(e.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": e.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def add_error_handlers(app: FastAPI) -> None:
    """Every error OpenAI's shape: the API's own (`APIError`), the router's (404, 405) and the unexpected
    (500, server_error)."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type_=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error"))


# ------------------------------------------------------------------------------------------ middleware
class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413 (by header, then by count)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = APIError(
            413, f"the request body exceeds this server's limit of {self.limit} bytes", code="request_too_large"
        )
        if declared is not None:
            try:
                if int(declared) > self.limit:
                    return await send_error(send, too_big)
            except ValueError:
                return await send_error(send, APIError(400, "invalid Content-Length header"))
        seen = [0]
        over = [False]
        answered = [False]

        async def limited_receive():
            # past the limit the application gets an empty end of body (it then refuses the request), and
            # its answer is replaced by the 413 below: raising here would surface through the HTTP
            # middleware's task group as an unexpected error (a 500)
            if over[0]:
                return {"type": "http.request", "body": b"", "more_body": False}
            msg = await receive()
            if msg["type"] == "http.request":
                seen[0] += len(msg.get("body", b""))
                if seen[0] > self.limit:
                    over[0] = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def guarded_send(msg):
            if not over[0]:
                return await send(msg)
            if msg["type"] == "http.response.start" and not answered[0]:
                answered[0] = True
                await send_error(send, too_big)

        await self.app(scope, limited_receive, guarded_send)


class RequestLog:
    """One line per request at level info (method, path, status, prompt + completion tokens, seconds);
    /health and /metrics at debug (a monitor polls them). The tokens are those a handler left in the
    scope under TALLY."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), [499]

        async def observed(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, observed)
        finally:
            tally = scope.get(TALLY) or {}
            tokens = f" {tally.get('prompt', 0)}+{tally.get('completion', 0)} tokens" if tally else ""
            quiet = scope.get("path") in ("/health", "/metrics") or scope.get(
                WARMUP_SCOPE_KEY
            )  # (a monitor, the warm-up)
            level = logging.DEBUG if quiet else logging.INFO
            log.log(
                level, f"{scope.get('method')} {scope.get('path')} {status[0]}{tokens} {time.monotonic() - t0:.2f} s"
            )


class APIKey:
    """'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise); no key: every request."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key and scope.get("path") != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.key}":
                return await send_error(
                    send,
                    APIError(
                        401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                    ),
                )
        await self.app(scope, receive, send)
