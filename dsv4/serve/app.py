"""The OpenAI-compatible HTTP API over the engine (FastAPI): the application, built from its parts.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (and `/v1/models/{id}`),
`GET` (or `HEAD`) `/health`, `GET /metrics` (Prometheus), answered by `dsv4.serve.handlers`. Streaming answers
are server-sent events exactly as OpenAI streams them (`data: {chunk}` ... `data: [DONE]`). Every error is
OpenAI's shape with a 4xx status (`dsv4.serve.middleware`); a client that goes away mid-request has its
sequences aborted and their cache pages freed at once.

A request's CPU work (parsing, validation, chat encoding, tokenization: `dsv4.serve.prepare`) runs in a
worker thread, never on the event loop. On shutdown (`ServerState.begin_drain`) new requests get 503 while
those in flight go on; when the grace period is over (`end_in_flight`) each is ended with a final chunk
whose `finish_reason` is "abort" (streams) or a 200 with what it has (non-streaming), never a 500.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from . import handlers
from .middleware import APIKey, BodyLimit, RequestLog, add_error_handlers
from .state import ServerState

__all__ = ["ServerState", "create_app"]


def create_app(state: ServerState):
    """The ASGI application: FastAPI's routes behind the API key check, the body-size limit and the log line
    (outermost), in that order inward."""
    app = FastAPI(title="dsv4", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dsv4 = state
    add_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def _health():
        return await handlers.health(state)

    @app.get("/v1/models")
    async def _models():
        return await handlers.models(state)

    @app.get("/v1/models/{model_id:path}")
    async def _model(model_id: str):
        return await handlers.model(state, model_id)

    @app.get("/metrics")
    async def _metrics():
        return await handlers.metrics(state)

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await handlers.completions(state, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await handlers.chat_completions(state, request)

    return RequestLog(BodyLimit(APIKey(app, state.api_key), state.max_body_bytes))
