"""The engine in its own thread, for asyncio callers (the HTTP server).

The engine thread owns the model and the cache: it takes new requests and cancellations from an inbox
between steps, runs steps while there is work, and hands each request's outputs to the asyncio loop that
asked for them. HTTP handling therefore never blocks a decode step, and a step never waits for a client.
A failing step fails the requests it was running (their streams end with an error) and the engine goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .engine import Engine, StepOutput
from .sampling import SamplingParams

log = logging.getLogger("dsv4.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n_open: int
    arrival: float = field(default_factory=time.monotonic)


async def stream_outputs(owner, request_id: str, stream: _Stream,
                         abort_on_error: bool = True) -> AsyncIterator[StepOutput]:
    """Yield a request's outputs from its stream until each of its sequences finished, then forget the
    stream (`owner._streams` under `owner._lock`). A consumer that leaves early (a client that disconnected)
    calls `owner.abort(request_id)`; an error item is raised, after an abort too where abort_on_error.
    Callers iterate it under `contextlib.aclosing`, so that leaving their own iteration closes (and aborts)
    this one at once rather than when it is collected."""
    finished = False
    try:
        while stream.n_open > 0:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                finished = not abort_on_error
                raise item
            if item.finished:
                stream.n_open -= 1
            yield item
        finished = True
    finally:
        if not finished:
            owner.abort(request_id)
        with owner._lock:
            owner._streams.pop(request_id, None)


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def deliver(owner, request_id: str, item: StepOutput | BaseException) -> None:
    """Hand one item (an output, or the error that ends the request) to its stream in `owner._streams`."""
    with owner._lock:
        stream = owner._streams.get(request_id)
    if stream is not None:
        with contextlib.suppress(RuntimeError):          # the client's loop is gone: nothing to tell
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def deliver_all(owner, outputs: list[StepOutput]) -> None:
    """Hand a step's outputs to their streams: one wake-up per event loop, not one per output."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
    with owner._lock:
        for out in outputs:
            stream = owner._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):          # the client's loop is gone: nothing to tell
            loop.call_soon_threadsafe(_put_all, items)


class AsyncEngine:
    def __init__(self, engine: Engine, on_step=None):
        self.engine = engine
        self._inbox: list[tuple] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._on_step = on_step              # callback(engine, outputs, step_seconds) for metrics
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._ids = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def new_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}-{self._ids}-{int(time.time() * 1000)}"

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       n: int = 1) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs as they come. Validates first (RequestError). Leaving
        the iteration early (a client that disconnected) aborts the request and frees its pages."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt, params, n)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), n)
        with self._lock:
            self._streams[request_id] = stream
            self._inbox.append(("add", request_id, prompt, params, n))
        self._wake.set()
        async with contextlib.aclosing(stream_outputs(self, request_id, stream)) as items:
            async for item in items:
                yield item

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------ the engine thread
    def _deliver(self, request_id: str, item) -> None:
        deliver(self, request_id, item)

    def _deliver_all(self, outputs: list[StepOutput]) -> None:
        deliver_all(self, outputs)

    def _drain_inbox(self) -> bool:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for cmd in inbox:
            if cmd[0] == "add":
                _, rid, prompt, params, n = cmd
                try:
                    self.engine.add_request(rid, prompt, params, n)
                except Exception as e:                      # noqa: BLE001 - reported to the caller
                    self._deliver(rid, e)
            else:
                self.engine.abort(cmd[1])
        return bool(inbox)

    def _report(self, outputs: list, seconds: float) -> None:
        if self._on_step is not None:
            with contextlib.suppress(Exception):
                self._on_step(self.engine.metrics(), outputs, seconds)

    def _loop(self) -> None:
        while not self._stop:
            if self._drain_inbox():
                self._report([], 0.0)                       # admissions and aborts change the gauges too
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:                          # noqa: BLE001 - the engine must survive a bad step
                log.exception("engine step failed; failing the requests it was running")
                self._fail_all(e)
                continue
            self._report(outputs, time.monotonic() - t0)
            self._deliver_all(outputs)

    def _fail_all(self, error: Exception) -> None:
        rids = list(self.engine.requests)
        for rid in rids:
            self.engine.abort(rid)
            self._deliver(rid, RuntimeError(f"the engine failed while running this request: {error}"))
