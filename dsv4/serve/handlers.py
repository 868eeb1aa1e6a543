"""The endpoints of the OpenAI-compatible API: each answers from the `ServerState` it is given.

`completions` and `chat_completions` read the request body (503 while the server drains), prepare it in a
worker thread (`dsv4.serve.prepare`), send its prompts to the engine and answer with JSON or with
server-sent events exactly as OpenAI streams them (`data: {chunk}` ... `data: [DONE]`). Both answers of
both endpoints read the engine's outputs through one `Accounting` (`dsv4.serve.usage`), which makes their
`usage`, the latency metrics and the log line's token counts. A request ended by the shutdown grace gets
finish_reason "abort" on its unfinished choices; an engine that fails mid-stream ends the stream with an
error event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..engine.sequence import StepOutput
from . import chat
from .middleware import TALLY
from .prepare import Prepared, check_model, prepare_chat, prepare_completion
from .protocol import APIError
from .state import ServerState
from .streams import chain, close_all, first, merge, until_disconnect
from .usage import Accounting
from .warmup import WARMUP_PREFIX, WARMUP_SCOPE_KEY

DONE = "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------ plain endpoints
async def health(state: ServerState):
    if not state.engine.alive:
        return JSONResponse({"status": "dead"}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "dsv4",
        "max_model_len": state.max_model_len,
    }


async def models(state: ServerState):
    return {"object": "list", "data": [_model_card(state)]}


async def model(state: ServerState, model_id: str):
    """GET /v1/models/{id}: the served model's card (the openai client's `models.retrieve`)."""
    check_model(model_id, state.model_name)
    return _model_card(state)


async def metrics(state: ServerState):
    if state.metrics is None:
        raise APIError(404, "metrics are off")
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


# ------------------------------------------------------------------------------------------ helpers
async def _body(state: ServerState, request: Request) -> bytes:
    if state.draining:
        raise APIError(
            503,
            "the server is shutting down and takes no new requests",
            type_="server_error",
            code="server_shutting_down",
        )
    try:
        return await request.body()
    except ClientDisconnect:  # gone mid-body (or cut off by the body timeout): nobody to answer
        raise APIError(499, "the client disconnected before sending the whole request body") from None


def _accounting(state: ServerState, request: Request, prep: Prepared) -> Accounting:
    """The request's counts; its prompt tokens go to its log line (`middleware.RequestLog`) at once."""
    tally = request.scope.setdefault(TALLY, {})
    tally["prompt"] = sum(len(p) for p in prep.prompts)
    metrics = None if request.scope.get(WARMUP_SCOPE_KEY) else state.metrics  # a warm-up request counts nowhere
    return Accounting(metrics, tally, prep.req.n, len(prep.prompts))


def _token_text(state: ServerState, tok: int) -> str:
    return state.tokenizer.decode([tok], skip_special_tokens=False)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(e: BaseException) -> str:
    err = (
        e
        if isinstance(e, APIError)
        else APIError(500, f"the engine failed while running this request: {e}", type_="server_error")
    )
    return _sse(err.body())


def _usage_chunk(prep: Prepared, base: dict, acct: Accounting) -> list[str]:
    """A stream's last chunk before [DONE] (no choices, the usage), where the request asked for it."""
    opts = prep.req.stream_options
    return [_sse({**base, "choices": [], "usage": acct.body()})] if opts and opts.include_usage else []


async def _submit(
    state: ServerState, rid: str, prep: Prepared, param: str
) -> tuple[list[AsyncIterator[StepOutput]], list[StepOutput | None]]:
    """Send every prompt of a request to the engine and wait for each one's first output, concurrently; a
    refusal of any of them closes (aborts) all of them and answers the request with it."""
    streams = [
        state.engine.generate(f"{rid}-{i}" if len(prep.prompts) > 1 else rid, p, sp, prep.req.n)
        for i, (p, sp) in enumerate(zip(prep.prompts, prep.params))
    ]
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
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_token_text(state, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


async def completions(state: ServerState, request: Request):
    raw = await _body(state, request)
    prep = await state.offload(prepare_completion, raw, state.limits, state.tokenizer, state.model_name)
    rid = _request_id(request, "cmpl")
    return await until_disconnect(request, _completions(state, prep, _accounting(state, request, prep), rid))


def _request_id(request: Request, kind: str) -> str:
    """A fresh id; a warm-up request's (`dsv4.serve.warmup`, set in its ASGI scope, which no client can
    reach) is marked so that the metrics leave it out."""
    return f"{WARMUP_PREFIX if request.scope.get(WARMUP_SCOPE_KEY) else ''}{kind}-{uuid.uuid4().hex}"


async def _completions(state: ServerState, prep: Prepared, acct: Accounting, rid: str):
    req = prep.req
    streams, heads = await _submit(state, rid, prep, "prompt")
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    n_choices = len(prep.prompts) * req.n
    outputs = merge([chain(h, it) for h, it in zip(heads, streams)], state.endings)
    if req.stream:
        return StreamingResponse(
            _completion_events(state, prep, base, n_choices, acct, outputs), media_type="text/event-stream"
        )
    texts: dict[int, list[str]] = {i: [] for i in range(n_choices)}
    lps: dict[int, list] = {i: [] for i in range(n_choices)}
    reasons: dict[int, str | None] = {}
    async with acct.counted(outputs) as counted:
        async for _, idx, out in counted:
            texts[idx].append(out.text)
            lps[idx].extend(out.new_logprobs)
            if out.finished:
                reasons[idx] = out.finish_reason
    choices = [
        {
            "index": i,
            "text": "".join(texts[i]),
            "logprobs": _completion_logprobs(state, lps[i], -len(prep.params[i // req.n].heal_text))
            if req.logprobs is not None
            else None,
            "finish_reason": reasons.get(i, "abort"),
        }
        for i in range(n_choices)
    ]
    return JSONResponse({**base, "choices": choices, "usage": acct.body()})


async def _completion_events(
    state: ServerState, prep: Prepared, base: dict, n_choices: int, acct: Accounting, outputs
) -> AsyncIterator[str]:
    req = prep.req
    offsets: dict[int, int] = {}
    finished: set[int] = set()
    try:
        async with acct.counted(outputs) as counted:
            async for si, idx, out in counted:
                lp = None
                if req.logprobs is not None and out.new_logprobs:
                    # offsets run over the tokens' own texts, as the whole answer's do: a healed prompt's first
                    # tokens spell its removed end again, which the visible text leaves out
                    start = offsets.get(idx, -len(prep.params[si].heal_text))
                    lp = _completion_logprobs(state, out.new_logprobs, start)
                    offsets[idx] = start + sum(map(len, lp["tokens"]))
                if out.text or out.finished or lp:
                    reason = out.finish_reason if out.finished else None
                    yield _sse(
                        {**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp, "finish_reason": reason}]}
                    )
                if out.finished:
                    finished.add(idx)
    except Exception as e:  # noqa: BLE001 - the stream ends in words
        yield _sse_error(e)
        yield DONE
        return
    for idx in range(n_choices):  # ended by the shutdown: a proper last chunk
        if idx not in finished:
            yield _sse({**base, "choices": [{"index": idx, "text": "", "logprobs": None, "finish_reason": "abort"}]})
    for chunk in _usage_chunk(prep, base, acct):
        yield chunk
    yield DONE


# ------------------------------------------------------------------------------------------ chat
def _chat_logprobs(state: ServerState, lps) -> list[dict]:
    out = []
    for lp in lps:
        tok = _token_text(state, lp.token)
        out.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := _token_text(state, i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                    for i, v in lp.top
                ],
            }
        )
    return out


def _delta(event, call_ids: list[str]) -> dict:
    if isinstance(event, chat.ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, chat.ContentDelta):
        return {"content": event.text}
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    call_ids.append(call_id)
    return {
        "tool_calls": [
            {
                "index": event.index,
                "id": call_id,
                "type": "function",
                "function": {"name": event.call.name, "arguments": event.call.arguments},
            }
        ]
    }


def _chat_finish_reason(out: StepOutput, result) -> str:
    if result.tool_calls:
        return "tool_calls"
    return out.finish_reason or "stop"


async def chat_completions(state: ServerState, request: Request):
    raw = await _body(state, request)
    prep = await state.offload(prepare_chat, raw, state.limits, state.tokenizer, state.model_name)
    rid = _request_id(request, "chatcmpl")
    return await until_disconnect(request, _chat(state, prep, _accounting(state, request, prep), rid))


async def _chat(state: ServerState, prep: Prepared, acct: Accounting, rid: str):
    req = prep.req
    streams, heads = await _submit(state, rid, prep, "messages")
    parsers = [chat.ChatStreamParser(thinking=prep.thinking) for _ in range(req.n)]
    base = {"id": rid, "created": int(time.time()), "model": state.model_name}
    outputs = merge([chain(heads[0], streams[0])], state.endings)
    if req.stream:
        return StreamingResponse(
            _chat_events(state, prep, base, parsers, acct, outputs), media_type="text/event-stream"
        )
    lps: dict[int, list] = {i: [] for i in range(req.n)}
    finals: dict[int, StepOutput] = {}
    async with acct.counted(outputs) as counted:
        async for _, i, out in counted:
            if out.text:
                parsers[i].feed(out.text)
            lps[i].extend(out.new_logprobs)
            if out.finished:
                finals[i] = out
    choices = []
    for i in range(req.n):
        result = parsers[i].finish()
        msg: dict = {"role": "assistant", "content": result.content}
        if result.reasoning_content is not None:
            msg["reasoning_content"] = result.reasoning_content
        if result.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in result.tool_calls
            ]
        choices.append(
            {
                "index": i,
                "message": msg,
                "logprobs": {"content": _chat_logprobs(state, lps[i])} if req.logprobs else None,
                "finish_reason": _chat_finish_reason(finals[i], result) if i in finals else "abort",
            }
        )
    return JSONResponse({**base, "object": "chat.completion", "choices": choices, "usage": acct.body()})


async def _chat_events(
    state: ServerState, prep: Prepared, base: dict, parsers: list, acct: Accounting, outputs
) -> AsyncIterator[str]:
    req = prep.req
    base = {**base, "object": "chat.completion.chunk"}

    def chunk(i: int, delta: dict, reason: str | None = None, lp=None) -> str:
        return _sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]})

    call_ids: list[str] = []
    finished: set[int] = set()
    try:
        async with acct.counted(outputs) as counted:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for _, i, out in counted:
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
                    yield chunk(i, {}, _chat_finish_reason(out, result))
    except Exception as e:  # noqa: BLE001 - the stream ends in words
        yield _sse_error(e)
        yield DONE
        return
    for i in range(req.n):  # ended by the shutdown: a proper last chunk
        if i not in finished:
            for ev in parsers[i].finish().flushed:
                yield chunk(i, _delta(ev, call_ids))
            yield chunk(i, {}, "abort")
    for c in _usage_chunk(prep, base, acct):
        yield c
    yield DONE
