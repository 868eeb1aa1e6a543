"""The HTTP layer's defences against clients that are slow, many or gone, and the graceful shutdown.

- `guarded_protocol`: uvicorn's h11 protocol with a header read timeout (from a connection's first byte,
  or its opening, to the end of a request's headers: `--header-timeout`), a body read timeout (from the
  end of the headers to the end of the body: `--body-timeout`), both answered 408 and closed, and a limit
  on open connections (`--max-connections`, kept below the process's descriptor limit): at the limit the
  oldest connection that has not sent a whole request header is closed to make room (slow clients cannot
  starve prompt ones), and when every connection runs a request the new one is reset at once, so its
  descriptor is free again and the accept loop never runs out of them.
- `RateLimitedLog`: at most one line per kind of trouble per interval, with the count of those left
  out; the event loop's accept errors ("Too many open files") go through it instead of one traceback per
  failed accept.
- `GracefulServer`: on SIGTERM / SIGINT the server stops accepting, answers new requests on open
  connections with 503, lets the requests in flight run for the grace period (`--shutdown-grace`), then
  ends those still running with a proper final chunk (`ServerState.end_in_flight`), and returns - the
  process exits 0 after the engine stops, instead of being killed by the re-raised signal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dsv4.serve")


class RateLimitedLog:
    """One warning per `key` per `every` seconds; the next one says how many were left out meanwhile."""

    def __init__(self, logger: logging.Logger, every: float = 10.0):
        self.logger, self.every = logger, every
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, key: str, message: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) < self.every:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return False
        skipped = self._skipped.pop(key, 0)
        self._last[key] = now
        self.logger.warning(message + (f" ({skipped} more like it in the last {self.every:.0f} s)" if skipped else ""))
        return True


_TROUBLE = RateLimitedLog(log)


def connection_limit(requested: int, reserve: int = 32) -> int:
    """`requested`, lowered so that every connection has a descriptor: the soft RLIMIT_NOFILE minus the
    descriptors open now (model files, pipes, the listening socket) minus a reserve."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return requested
    if soft == getattr(resource, "RLIM_INFINITY", -1):
        return requested
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    return max(1, min(requested, soft - used - reserve))


_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def _timeout_reply(what: str, seconds: float) -> bytes:
    body = (
        f'{{"error": {{"message": "the request {what} did not arrive within {seconds:g} s", '
        f'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}}}'
    ).encode()
    return _TIMEOUT_408 % (len(body), body)


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with these limits (uvicorn instantiates it per connection: `http=` of its Config)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None

        _opened = 0.0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections and not self._evict_one():
                self.transport = transport
                _TROUBLE.warning(
                    "limit",
                    f"{len(self.connections)} connections open, each running a request "
                    f"(--max-connections {max_connections}): new ones are reset until "
                    "some close",
                )
                transport.abort()  # the descriptor is free at once
                return
            super().connection_made(transport)
            self._opened = time.monotonic()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _evict_one(self) -> bool:
            """At the limit, make room by closing the oldest connection that has not sent a whole request
            header (a slow or idle client): it has nothing running, and a client that sends its request at
            once is never the one waiting longest. False when every connection runs a request."""
            idle = [
                c
                for c in self.connections
                if getattr(c, "conn", None) is not None
                and c.conn.their_state is h11.IDLE
                and not c.transport.is_closing()
            ]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._opened)
            _TROUBLE.warning(
                "evict",
                f"{len(self.connections)} connections open (--max-connections "
                f"{max_connections}): closing those that have not sent a request, oldest "
                "first",
            )
            oldest.connections.discard(oldest)
            oldest.transport.abort()
            return True

        def connection_lost(self, exc) -> None:
            self._cancel_timers()
            if self.flow is None:  # reset by the connection limit
                self.connections.discard(self)
                return
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:  # a new request begins
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)
            super().data_received(data)
            state = self.conn.their_state
            if state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if state is h11.SEND_BODY and self._body_timer is None:
                self._body_timer = self.loop.call_later(body_timeout, self._body_late)
            elif state is not h11.SEND_BODY and self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._body_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                _TROUBLE.warning(
                    "headers",
                    f"closed a connection whose request headers took over {header_timeout:g} s (--header-timeout)",
                )
                self.transport.write(_timeout_reply("headers", header_timeout))
                self.transport.close()

        def _body_late(self) -> None:
            self._body_timer = None
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                _TROUBLE.warning(
                    "body", f"closed a connection whose request body took over {body_timeout:g} s (--body-timeout)"
                )
                if self.cycle is None or not self.cycle.response_started:
                    self.transport.write(_timeout_reply("body", body_timeout))
                self.transport.close()

    return GuardedH11Protocol


def _loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Accept errors (descriptors or memory exhausted) as one rate-limited line; the rest as asyncio logs it."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
        _TROUBLE.warning(
            "accept",
            f"cannot accept connections: {exc.strerror or exc} (the server retries; "
            "lower --max-connections or raise the descriptor limit, ulimit -n)",
        )
        return
    loop.default_exception_handler(context)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with dsv4's shutdown (see the module doc). `on_drain()` runs at the first signal,
    `on_grace_over()` `grace` seconds later if the server is still waiting for requests."""

    def __init__(self, config: uvicorn.Config, grace: float, on_drain, on_grace_over):
        super().__init__(config)
        self.grace, self.on_drain, self.on_grace_over = grace, on_drain, on_grace_over
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop it serves on (None before it starts)."""
        return self._loop

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_loop_exception_handler)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it when done and the default handler
        # would kill the process before the engine stops
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        self.should_exit = True
        if not self._draining and self._loop is not None:
            self._draining = True
            self._loop.call_soon_threadsafe(self._drain, signal.Signals(sig).name)

    def _drain(self, name: str) -> None:
        in_flight = len(self.server_state.tasks)
        log.warning(
            f"{name}: shutting down: no new requests; {in_flight} in flight get up to {self.grace:g} s "
            "(--shutdown-grace)"
        )
        self.on_drain()
        self._loop.call_later(self.grace, self._grace_over)

    def _grace_over(self) -> None:
        if self.server_state.tasks:
            log.warning(
                f"shutdown grace of {self.grace:g} s is over: ending {len(self.server_state.tasks)} "
                "requests still running (finish_reason 'abort')"
            )
        self.on_grace_over()
