"""The OpenAI-compatible HTTP API over the engine (FastAPI).

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus). Streaming answers are server-sent events exactly as OpenAI streams them
(`data: {chunk}` ... `data: [DONE]`). Every error is OpenAI's shape with a 4xx status; a client that
goes away mid-request has its sequences aborted and their cache pages freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.client import EngineClient, EngineDeadError
from ..engine.sampling import SamplingParams
from ..engine.sequence import RequestError, StepOutput
from . import chat_format
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, refuse_unsupported, thinking_requested


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: object                         # encode(text, bos=...) / decode(ids, skip_special_tokens=...)
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    metrics: ServerMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))


# ------------------------------------------------------------------------------------------ helpers
def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays / objects too deeply") from None
    except ValueError as e:                  # not JSON, not UTF-8, an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:                                     # "\ud800" parses to a lone surrogate, which no text can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a string with a lone surrogate escape (not Unicode text)") \
            from None
    return body


def _validate(model_cls, body: dict):
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ())) or None
        raise APIError(400, f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), param=loc) from None


def _sampling(state: ServerState, req, max_tokens: int | None, prompt_len: int, logprobs: int | None,
              chat: bool) -> SamplingParams:
    room = state.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this server's context is {state.max_model_len} "
                            f"tokens (prompt + output), so at most {state.max_model_len - 1} prompt tokens fit",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context of "
                            f"{state.max_model_len} tokens: at most {max(room, 0)} new tokens fit",
                       param="max_tokens", code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            logprobs=logprobs, repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
            skip_special_tokens=not chat, include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as e:
        param = str(e).split(":", 1)[0]
        raise APIError(400, str(e), param=param) from None


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{state.model_name}`)",
                       param="model", code="model_not_found")


def _token_text(state: ServerState, tok: int) -> str:
    return state.tokenizer.decode([tok], skip_special_tokens=False)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Tracker:
    """Per-request timing for the latency metrics."""

    def __init__(self, metrics: ServerMetrics | None):
        self.metrics, self.t0 = metrics, time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        if n:
            if self.first is None:
                self.first = now
            elif self.last is not None:
                self.gaps.append((now - self.last) / n)
            self.last = now

    def done(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(None if self.first is None else self.first - self.t0, self.gaps,
                                         time.monotonic() - self.t0)


async def _merge(streams: list[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Outputs of several engine requests as they come: (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[StepOutput]) -> None:
        try:
            async for out in it:
                await queue.put((i, out))
        except BaseException as e:                     # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for it in streams:
            with contextlib.suppress(Exception):
                await it.aclose()


async def _until_disconnect(request: Request, work):
    """Run `work` (a coroutine); cancel it when the client disconnects (frees its sequences)."""
    task = asyncio.create_task(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)
    return task.result()


# ------------------------------------------------------------------------------------------ completions
def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [state.tokenizer.encode(p, bos=True)]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, str) for x in p):
        return [state.tokenizer.encode(x, bos=True) for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]


def _completion_logprobs(state: ServerState, lps, offset: int) -> dict:
    tokens = [_token_text(state, lp.token) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(state, t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


async def completions(state: ServerState, request: Request):
    req = _validate(CompletionRequest, await _json_body(request))
    _check_model(state, req.model)
    refuse_unsupported(req)
    prompts = _completion_prompts(state, req)
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, "logprobs must be in [0, 20]", param="logprobs")
    params = [_sampling(state, req, req.max_tokens, len(p), req.logprobs, chat=False) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    tracker = _Tracker(state.metrics)
    streams = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        it = state.engine.generate(f"{rid}-{i}", p, sp, req.n)
        streams.append(it)
    # validate every prompt before any output (errors come before the first byte)
    heads = [await _first(it) for it in streams]
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}

    def choice_index(stream: int, out: StepOutput) -> int:
        return stream * req.n + out.index

    if req.stream:
        async def events() -> AsyncIterator[str]:
            usage = {"p": 0, "c": 0, "cached": 0}
            offsets: dict[int, int] = {}
            try:
                async for si, out in _merge([_chain(h, it) for h, it in zip(heads, streams)]):
                    tracker.tokens(len(out.new_tokens))
                    idx = choice_index(si, out)
                    lp = None
                    if req.logprobs is not None and out.new_logprobs:
                        lp = _completion_logprobs(state, out.new_logprobs, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(out.text)
                    if out.text or out.finished or lp:
                        reason = out.finish_reason if out.finished else None
                        yield _sse({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                         "finish_reason": reason}]})
                    if out.finished:
                        usage["p"] += out.prompt_tokens if out.index == 0 else 0
                        usage["c"] += out.completion_tokens
                        usage["cached"] += out.cached_tokens if out.index == 0 else 0
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(usage["p"], usage["c"], usage["cached"])})
                yield "data: [DONE]\n\n"
            finally:
                tracker.done()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def collect():
        texts: dict[int, list[str]] = {}
        lps: dict[int, list] = {}
        reasons: dict[int, str | None] = {}
        usage = [0, 0, 0]
        async for si, out in _merge([_chain(h, it) for h, it in zip(heads, streams)]):
            tracker.tokens(len(out.new_tokens))
            idx = choice_index(si, out)
            texts.setdefault(idx, []).append(out.text)
            lps.setdefault(idx, []).extend(out.new_logprobs)
            if out.finished:
                reasons[idx] = out.finish_reason
                usage[0] += out.prompt_tokens if out.index == 0 else 0
                usage[1] += out.completion_tokens
                usage[2] += out.cached_tokens if out.index == 0 else 0
        tracker.done()
        choices = [{"index": i, "text": "".join(texts[i]),
                    "logprobs": _completion_logprobs(state, lps[i], 0) if req.logprobs is not None else None,
                    "finish_reason": reasons.get(i)} for i in sorted(texts)]
        return JSONResponse({**base, "choices": choices, "usage": _usage(*usage)})

    return await _until_disconnect(request, collect())


async def _first(it: AsyncIterator[StepOutput]) -> StepOutput | None:
    """The first output of a request (raises the request's validation error now)."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
    except RequestError as e:
        code = "context_length_exceeded" if "context" in str(e) else None
        raise APIError(400, str(e), code=code) from None
    except EngineDeadError as e:
        raise APIError(503, str(e), type_="server_error") from None


async def _chain(head: StepOutput | None, it: AsyncIterator[StepOutput]) -> AsyncIterator[StepOutput]:
    """The head output, then the rest of the request's outputs."""
    try:
        if head is not None:
            yield head
            async for out in it:
                yield out
    finally:
        with contextlib.suppress(Exception):
            await it.aclose()


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
    if isinstance(event, chat_format.ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, chat_format.ContentDelta):
        return {"content": event.text}
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    call_ids.append(call_id)
    return {"tool_calls": [{"index": event.index, "id": call_id, "type": "function",
                            "function": {"name": event.call.name, "arguments": event.call.arguments}}]}


async def chat_completions(state: ServerState, request: Request):
    req = _validate(ChatCompletionRequest, await _json_body(request))
    _check_model(state, req.model)
    refuse_unsupported(req)
    thinking = thinking_requested(req)
    tools = req.tools if req.tool_choice != "none" else None
    try:
        text = chat_format.encode_chat(req.messages, tools=tools, thinking=thinking,
                                       reasoning_effort=req.reasoning_effort)
    except chat_format.ChatFormatError as e:
        raise APIError(400, str(e), param="messages") from None
    prompt = state.tokenizer.encode(text, bos=False)
    if req.top_logprobs is not None and not (req.logprobs and 0 <= req.top_logprobs <= 20):
        raise APIError(400, "top_logprobs needs logprobs=true and a value in [0, 20]", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(state, req, max_tokens, len(prompt), (req.top_logprobs or 0) if req.logprobs else None,
                       chat=True)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = _Tracker(state.metrics)
    it = state.engine.generate(rid, prompt, params, req.n)
    head = await _first(it)
    created = int(time.time())
    parsers = [chat_format.ChatStreamParser(thinking=thinking) for _ in range(req.n)]
    base = {"id": rid, "created": created, "model": state.model_name}

    def finish_reason(i: int, out: StepOutput, result) -> str:
        if result.tool_calls:
            return "tool_calls"
        return out.finish_reason or "stop"

    if req.stream:
        async def events() -> AsyncIterator[str]:
            usage = [0, 0, 0]
            call_ids: list[str] = []
            try:
                for i in range(req.n):
                    yield _sse({**base, "object": "chat.completion.chunk",
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
                async for _, out in _merge([_chain(head, it)]):
                    tracker.tokens(len(out.new_tokens))
                    i = out.index
                    evs = parsers[i].feed(out.text) if out.text else []
                    lp = {"content": _chat_logprobs(state, out.new_logprobs)} if req.logprobs else None
                    for ev in evs:
                        yield _sse({**base, "object": "chat.completion.chunk",
                                    "choices": [{"index": i, "delta": _delta(ev, call_ids), "logprobs": lp,
                                                 "finish_reason": None}]})
                        lp = None
                    if lp and lp["content"]:
                        yield _sse({**base, "object": "chat.completion.chunk",
                                    "choices": [{"index": i, "delta": {}, "logprobs": lp, "finish_reason": None}]})
                    if out.finished:
                        result = parsers[i].finish()
                        for ev in result.flushed:
                            yield _sse({**base, "object": "chat.completion.chunk",
                                        "choices": [{"index": i, "delta": _delta(ev, call_ids), "logprobs": None,
                                                     "finish_reason": None}]})
                        yield _sse({**base, "object": "chat.completion.chunk",
                                    "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish_reason(i, out, result)}]})
                        usage[0] = out.prompt_tokens
                        usage[1] += out.completion_tokens
                        usage[2] = out.cached_tokens
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": _usage(*usage)})
                yield "data: [DONE]\n\n"
            finally:
                tracker.done()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def collect():
        lps: dict[int, list] = {i: [] for i in range(req.n)}
        finals: dict[int, StepOutput] = {}
        usage = [0, 0, 0]
        async for _, out in _merge([_chain(head, it)]):
            tracker.tokens(len(out.new_tokens))
            if out.text:
                parsers[out.index].feed(out.text)
            lps[out.index].extend(out.new_logprobs)
            if out.finished:
                finals[out.index] = out
                usage[0] = out.prompt_tokens
                usage[1] += out.completion_tokens
                usage[2] = out.cached_tokens
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
                            "finish_reason": finish_reason(i, finals[i], result) if i in finals else "abort"})
        return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": _usage(*usage)})

    return await _until_disconnect(request, collect())


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

    return _BodyLimit(_APIKey(app, state.api_key), state.max_body_bytes)
