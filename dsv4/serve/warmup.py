"""Each HTTP process's own warm-up, before it says it is ready: one request of each kind (completion and
chat, streamed and whole) through its application, in its event loop, over its engine link.

A process's first requests pay for what runs once: the handlers' deferred imports, the validators' first
use, the worker threads' start, the tokenizer's and the chat encoder's first calls. On the H200 that made a
fresh process's first time to first token some 50 ms longer than the next ones, paid by the first clients
(and, in `dsv4 bench serve`, by the idle figure the loaded one is compared with). The warm-up requests go
through the ASGI application directly (no socket: with several processes on one port, a connection could
land on another process), marked in their scope: they count in no request metric, only in the engine's
token counters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

log = logging.getLogger("dsv4.serve")

WARMUP_SCOPE_KEY = "dsv4.warmup"  # in a warm-up request's ASGI scope (no client can set a scope key)
WARMUP_PREFIX = "warmup-"  # of a warm-up request's id: the metrics leave its outputs out


def _requests(model: str) -> list[tuple[str, dict]]:
    prompt = {"prompt": "a"}
    chat = {"messages": [{"role": "user", "content": "a"}]}
    return [
        (path, {"model": model, "max_tokens": 1, "stream": stream, **body})
        for path, body in (("/v1/completions", prompt), ("/v1/chat/completions", chat))
        for stream in (True, False)
    ]


async def _call(app, path: str, body: dict, api_key: str | None) -> int:
    """POST `body` to `path` through the ASGI `app`; its status (the body is read and dropped)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
        WARMUP_SCOPE_KEY: True,
    }
    sent = [False]
    status = [0]
    done = asyncio.Event()

    async def receive() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": data, "more_body": False}
        await done.wait()  # the "client" stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            status[0] = msg["status"]
        elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
            done.set()

    await app(scope, receive, send)
    done.set()
    return status[0]


async def warm_up(app, model: str, api_key: str | None, timeout: float = 120.0) -> float:
    """Run the warm-up requests; their seconds. A refusal (a model whose context cannot hold them) is said
    at debug level, an error (5xx) as a warning; neither stops the server."""
    t0 = time.monotonic()
    for path, body in _requests(model):
        try:
            status = await asyncio.wait_for(_call(app, path, body, api_key), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning(f"warm-up: {path} did not answer within {timeout:g} s")
            continue
        if status >= 500:
            log.warning(f"warm-up: {path} answered {status}")
        elif status != 200:
            log.debug(f"warm-up: {path} answered {status}")
    return time.monotonic() - t0
