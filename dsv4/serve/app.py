"""The OpenAI-compatible HTTP API over the engine (FastAPI).

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus). Streaming answers are server-sent events exactly as OpenAI streams them
(`data: {chunk}` ... `data: [DONE]`). Every error is OpenAI's shape with a 4xx status; a client that
goes away mid-request has its sequences aborted and their cache pages freed at once.

A request's CPU work (parsing, validation, chat encoding, tokenization: `dsv4.serve.prepare`) runs in a
worker thread, never on the event loop. On shutdown (`begin_drain`) new requests get 503 while those in
flight go on; when the grace period is over (`end_in_flight`) each is ended with a final chunk whose
`finish_reason` is "abort" (streams) or a 200 with what it has (non-streaming), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine.client import EngineClient
from ..engine.sequence import StepOutput
from . import chat
from .metrics import ServerMetrics
from .prepare import Prepared, prepare_chat, prepare_completion
from .protocol import APIError
from .streams import Endings, Tracker, Usage, chain, close_all, first, merge, until_disconnect
from .validate import Limits

log = logging.getLogger("dsv4.serve")


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: object                         # encode(text, bos=...) / decode(ids, skip_special_tokens=...)
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    metrics: ServerMetrics | None = None
    limits: Limits | None = None              # default: from max_model_len, a 2^20-token vocabulary
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False                    # shutting down: new requests get 503
    endings: Endings = field(default_factory=Endings)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsv4-prepare"))

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits(vocab_size=1 << 20, max_model_len=self.max_model_len,
                                 max_sequence_tokens=self.max_model_len)

    async def offload(self, fn: Callable, *args):
        """fn(*args) in a worker thread (the event loop goes on meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def begin_drain(self) -> None:
        """Stop admitting requests (503); those in flight go on."""
        self.draining = self.endings.draining = True

    def end_in_flight(self) -> None:
        """End every request still in flight now (a final chunk with finish_reason "abort")."""
        self.endings.end_all()


# ------------------------------------------------------------------------------------------ helpers
def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(state: ServerState, request: Request) -> bytes:
    if state.draining:
        raise APIError(503, "the server is shutting down and takes no new requests", type_="server_error",
                       code="server_shutting_down")
    try:
        return await request.body()
    except ClientDisconnect:                 # gone mid-body (or cut off by the body timeout): nobody to answer
        raise APIError(499, "the client disconnected before sending the whole request body") from None


def _token_text(state: ServerState, tok: int) -> str:
    return state.tokenizer.decode([tok], skip_special_tokens=False)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(e: BaseException) -> str:
    err = e if isinstance(e, APIError) else APIError(500, f"the engine failed while running this request: {e}",
                                                      type_="server_error")
    return _sse(err.body())


async def _submit(state: ServerState, rid: str, prep: Prepared, n: int, param: str
                  ) -> tuple[list[AsyncIterator[StepOutput]], list[StepOutput | None]]:
    """Send every prompt of a request to the engine and wait for each one's first output, concurrently; a
    refusal of any of them closes (aborts) all of them and answers the request with it."""
    streams = [state.engine.generate(f"{rid}-{i}" if len(prep.prompts) > 1 else rid, p, sp, n)
               for i, (p, sp) in enumerate(zip(prep.prompts, prep.params))]
    try:
        heads = await asyncio.gather(*(first(it, param) for it in streams))
    except BaseException:
        await close_all(streams)
        raise
    return streams, list(heads)


# ------------------------------------------------------------------------------------------ completions
def _completion_logprobs(state: ServerState, lps, offset: int) -> dict:
    """OpenAI's logprobs of a completion's tokens; text_offset counts from the start of the completion, so
    the first tokens of a healed prompt (which spell the removed end of the prompt again) start before it
    (`offset` = -len(the removed text))."""
    tokens = [_token_text(state, lp.token) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(state, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def _tally(request: Request, prep: Prepared) -> dict:
    """The request's token counts, for its log line (`_RequestLog` reads them from the ASGI scope)."""
    tally = request.scope.setdefault("dsv4.tally", {})
    tally["prompt"] = sum(len(p) for p in prep.prompts)
    return tally


async def completions(state: ServerState, request: Request):
    raw = await _body(state, request)
    prep = await state.offload(prepare_completion, raw, state.limits, state.tokenizer, state.model_name)
    return await until_disconnect(request, _completions(state, prep, _tally(request, prep)))


async def _completions(state: ServerState, prep: Prepared, tally: dict):
    req = prep.req
    rid = f"cmpl-{uuid.uuid4().hex}"
    tracker = Tracker(state.metrics, tally)
    streams, heads = await _submit(state, rid, prep, req.n, "prompt")
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    n_choices = len(prep.prompts) * req.n

    def choice_index(stream: int, out: StepOutput) -> int:
        return stream * req.n + out.index

    outputs = merge([chain(h, it) for h, it in zip(heads, streams)], state.endings)
    if req.stream:
        async def events() -> AsyncIterator[str]:
            usage = Usage()
            offsets: dict[int, int] = {}
            finished: set[int] = set()
            try:
                async for si, out in outputs:
                    tracker.tokens(len(out.new_tokens))
                    idx = choice_index(si, out)
                    lp = None
                    if req.logprobs is not None and out.new_logprobs:
                        lp = _completion_logprobs(state, out.new_logprobs,
                                                  offsets.get(idx, -len(prep.params[si].heal_text)))
                    offsets[idx] = offsets.get(idx, 0) + len(out.text)
                    if out.text or out.finished or lp:
                        reason = out.finish_reason if out.finished else None
                        yield _sse({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                         "finish_reason": reason}]})
                    usage.add(si, idx, out)
                    if out.finished:
                        finished.add(idx)
            except Exception as e:                               # noqa: BLE001 - the stream ends in words
                yield _sse_error(e)
                yield "data: [DONE]\n\n"
                return
            finally:
                tracker.done()
            for idx in range(n_choices):                         # ended by the shutdown: a proper last chunk
                if idx not in finished:
                    yield _sse({**base, "choices": [{"index": idx, "text": "", "logprobs": None,
                                                     "finish_reason": "abort"}]})
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": usage.body()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    texts: dict[int, list[str]] = {i: [] for i in range(n_choices)}
    lps: dict[int, list] = {i: [] for i in range(n_choices)}
    reasons: dict[int, str | None] = {}
    usage = Usage()
    try:
        async for si, out in outputs:
            tracker.tokens(len(out.new_tokens))
            idx = choice_index(si, out)
            texts[idx].append(out.text)
            lps[idx].extend(out.new_logprobs)
            usage.add(si, idx, out)
            if out.finished:
                reasons[idx] = out.finish_reason
    finally:
        tracker.done()
    choices = [{"index": i, "text": "".join(texts[i]),
                "logprobs": _completion_logprobs(state, lps[i], -len(prep.params[i // req.n].heal_text))
                if req.logprobs is not None else None,
                "finish_reason": reasons.get(i, "abort")} for i in range(n_choices)]
    return JSONResponse({**base, "choices": choices, "usage": usage.body()})


# ------------------------------------------------------------------------------------------ chat
def _chat_logprobs(state: ServerState, lps) -> list[dict]:
    out = []
    for lp in lps:
        tok = _token_text(state, lp.token)
        out.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [{"token": (t := _token_text(state, i)), "logprob": v,
                                      "bytes": list(t.encode("utf-8"))} for i, v in lp.top]})
    return out


def _delta(event, call_ids: list[str]) -> dict:
    if isinstance(event, chat.ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, chat.ContentDelta):
        return {"content": event.text}
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    call_ids.append(call_id)
    return {"tool_calls": [{"index": event.index, "id": call_id, "type": "function",
                            "function": {"name": event.call.name, "arguments": event.call.arguments}}]}


async def chat_completions(state: ServerState, request: Request):
    raw = await _body(state, request)
    prep = await state.offload(prepare_chat, raw, state.limits, state.tokenizer, state.model_name)
    return await until_disconnect(request, _chat(state, prep, _tally(request, prep)))


async def _chat(state: ServerState, prep: Prepared, tally: dict):
    req = prep.req
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = Tracker(state.metrics, tally)
    streams, heads = await _submit(state, rid, prep, req.n, "messages")
    created = int(time.time())
    parsers = [chat.ChatStreamParser(thinking=prep.thinking) for _ in range(req.n)]
    base = {"id": rid, "created": created, "model": state.model_name}
    outputs = merge([chain(heads[0], streams[0])], state.endings)

    def finish_reason(out: StepOutput, result) -> str:
        if result.tool_calls:
            return "tool_calls"
        return out.finish_reason or "stop"

    if req.stream:
        def chunk(i: int, delta: dict, reason: str | None = None, lp=None) -> str:
            return _sse({**base, "object": "chat.completion.chunk",
                         "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]})

        async def events() -> AsyncIterator[str]:
            usage = Usage()
            call_ids: list[str] = []
            finished: set[int] = set()
            try:
                for i in range(req.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for _, out in outputs:
                    tracker.tokens(len(out.new_tokens))
                    i = out.index
                    usage.add(0, i, out)
                    evs = parsers[i].feed(out.text) if out.text else []
                    lp = {"content": _chat_logprobs(state, out.new_logprobs)} if req.logprobs else None
                    for ev in evs:
                        yield chunk(i, _delta(ev, call_ids), lp=lp)
                        lp = None
                    if lp and lp["content"]:
                        yield chunk(i, {}, lp=lp)
                    if out.finished:
                        finished.add(i)
                        result = parsers[i].finish()
                        for ev in result.flushed:
                            yield chunk(i, _delta(ev, call_ids))
                        yield chunk(i, {}, finish_reason(out, result))
            except Exception as e:                               # noqa: BLE001 - the stream ends in words
                yield _sse_error(e)
                yield "data: [DONE]\n\n"
                return
            finally:
                tracker.done()
            for i in range(req.n):                               # ended by the shutdown: a proper last chunk
                if i not in finished:
                    for ev in parsers[i].finish().flushed:
                        yield chunk(i, _delta(ev, call_ids))
                    yield chunk(i, {}, "abort")
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage.body()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    lps: dict[int, list] = {i: [] for i in range(req.n)}
    finals: dict[int, StepOutput] = {}
    usage = Usage()
    try:
        async for _, out in outputs:
            tracker.tokens(len(out.new_tokens))
            usage.add(0, out.index, out)
            if out.text:
                parsers[out.index].feed(out.text)
            lps[out.index].extend(out.new_logprobs)
            if out.finished:
                finals[out.index] = out
    finally:
        tracker.done()
    choices = []
    for i in range(req.n):
        result = parsers[i].finish()
        msg: dict = {"role": "assistant", "content": result.content}
        if result.reasoning_content is not None:
            msg["reasoning_content"] = result.reasoning_content
        if result.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in result.tool_calls]
        choices.append({"index": i, "message": msg,
                        "logprobs": {"content": _chat_logprobs(state, lps[i])} if req.logprobs else None,
                        "finish_reason": finish_reason(finals[i], result) if i in finals else "abort"})
    return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": usage.body()})


# ------------------------------------------------------------------------------------------ the app
class _BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes with 413 (by header, then by count)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = APIError(413, f"the request body exceeds this server's limit of {self.limit} bytes",
                           code="request_too_large")
        if declared is not None:
            try:
                if int(declared) > self.limit:
                    return await _send_error(send, too_big)
            except ValueError:
                return await _send_error(send, APIError(400, "invalid Content-Length header"))
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
                await _send_error(send, too_big)

        await self.app(scope, limited_receive, guarded_send)


class _RequestLog:
    """ASGI middleware: one line per request at level info (method, path, status, prompt + completion tokens,
    seconds); /health and /metrics at debug (a monitor polls them)."""

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
            tally = scope.get("dsv4.tally") or {}
            tokens = f" {tally.get('prompt', 0)}+{tally.get('completion', 0)} tokens" if tally else ""
            level = logging.DEBUG if scope.get("path") in ("/health", "/metrics") else logging.INFO
            log.log(level, f"{scope.get('method')} {scope.get('path')} {status[0]}{tokens} "
                           f"{time.monotonic() - t0:.2f} s")


class _APIKey:
    """ASGI middleware: 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise).

    Plain ASGI on purpose: behind starlette's BaseHTTPMiddleware (`@app.middleware("http")`) an endpoint's
    `request.is_disconnected()` never sees the client leave, so a non-streaming request whose client
    disconnected ran to its last token instead of being aborted."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key and scope.get("path") != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.key}":
                return await _send_error(send, APIError(
                    401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"))
        await self.app(scope, receive, send)


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(state: ServerState):
    """The ASGI application (FastAPI behind a body-size limit)."""
    app = FastAPI(title="dsv4", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dsv4 = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(APIError(e.status_code, str(e.detail), type_=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception):
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error"))

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "dsv4", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            raise APIError(404, "metrics are off")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(state, request)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await chat_completions(state, request)

    return _RequestLog(_BodyLimit(_APIKey(app, state.api_key), state.max_body_bytes))
