"""The engine in a process of its own, for the HTTP server.

A server's event loop and the engine's step loop are both Python: in one process they share one
interpreter lock, and every time the engine waits for the device the loop takes the lock for up to a
switch interval (5 ms), which is a whole decode step. Here the engine runs in a child process (spawned,
as CUDA requires) that owns the model and the cache; the server process sends it requests and aborts
through one pipe and receives each step's outputs, with the engine's metrics, through another. The
interface is `AsyncEngine`'s: `generate` (an async iterator of `StepOutput`), `abort`, `alive`,
`shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable

from .async_engine import EngineDeadError, _Stream, deliver, deliver_all, stream_outputs
from .engine import RequestError, StepOutput
from .sampling import SamplingParams

log = logging.getLogger("dsv4.engine")


def _child(commands, results, build: Callable, build_args: tuple) -> None:
    """The engine process: build the engine, say ready, then serve commands and steps until told to stop."""
    try:
        engine, info = build(*build_args)
    except BaseException as e:                                          # noqa: BLE001 - reported, then exit
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", info))
    while True:
        timeout = 0.0 if engine.has_work() else 0.5
        handled = False
        while commands.poll(timeout):
            timeout, handled = 0.0, True
            try:
                cmd = commands.recv()
            except EOFError:                                            # the server is gone
                return
            if cmd[0] == "add":
                _, rid, prompt, params, n = cmd
                try:
                    engine.add_request(rid, prompt, params, n)
                except RequestError as e:
                    results.send(("error", rid, "request", str(e)))
                except Exception as e:                                  # noqa: BLE001 - the caller's error
                    results.send(("error", rid, "server", f"{type(e).__name__}: {e}"))
            elif cmd[0] == "abort":
                engine.abort(cmd[1])
            elif cmd[0] == "stop":
                return
        if handled:                                             # admissions and aborts move the gauges
            results.send(("out", [], engine.metrics(), 0.0))
        if not engine.has_work():
            continue
        t0 = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as e:                                          # noqa: BLE001 - fail its requests, go on
            log.exception("engine step failed")
            for rid in list(engine.requests):
                engine.abort(rid)
                results.send(("error", rid, "server", f"the engine failed while running this request: {e}"))
            continue
        results.send(("out", outputs, engine.metrics(), time.monotonic() - t0))


class EngineProcess:
    def __init__(self, build: Callable, build_args: tuple, on_step=None):
        ctx = mp.get_context("spawn")
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, self._res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(self._cmd_recv, self._res_send, build, build_args),
                                 name="dsv4-engine", daemon=True)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._on_step = on_step
        self._reader: threading.Thread | None = None
        self._stopped = False
        self._ids = 0
        self.info: dict = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 1800.0) -> dict:
        """Spawn the engine process and wait until its engine is built (model loaded, graphs captured)."""
        self._proc.start()
        self._res_send.close()                      # the child holds the writing end
        self._cmd_recv.close()
        deadline = time.monotonic() + timeout
        while not self._res_recv.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process was not ready in time")
        kind, payload = self._res_recv.recv()
        if kind != "ready":
            raise RuntimeError(f"the engine could not start: {payload}")
        self.info = payload
        self._reader = threading.Thread(target=self._read, name="dsv4-engine-reader", daemon=True)
        self._reader.start()
        return payload

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        with contextlib.suppress(OSError, ValueError):
            self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()

    @property
    def alive(self) -> bool:
        return not self._stopped and self._proc.is_alive()

    def new_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}-{self._ids}-{int(time.time() * 1000)}"

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._cmd_send.send(msg)

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       n: int = 1) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs; leaving early aborts it (frees its pages)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), n)
        with self._lock:
            self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, n))
        # an error item: the engine already dropped the request, nothing to abort
        async with contextlib.aclosing(stream_outputs(self, request_id, stream, abort_on_error=False)) as items:
            async for item in items:
                yield item

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._send(("abort", request_id))

    # ------------------------------------------------------------------ outputs
    def _read(self) -> None:
        while True:
            try:
                msg = self._res_recv.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "out":
                _, outputs, metrics, seconds = msg
                if self._on_step is not None:
                    with contextlib.suppress(Exception):
                        self._on_step(metrics, outputs, seconds)
                self._deliver(outputs)
            elif msg[0] == "error":
                _, rid, kind, text = msg
                self._fail(rid, RequestError(text) if kind == "request" else RuntimeError(text))
        self._stopped = True
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._fail(rid, EngineDeadError("the engine process stopped"))

    def _deliver(self, outputs: list[StepOutput]) -> None:
        deliver_all(self, outputs)

    def _fail(self, rid: str, error: BaseException) -> None:
        deliver(self, rid, error)
