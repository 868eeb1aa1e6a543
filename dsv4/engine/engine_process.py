"""The engine in a process of its own, for the HTTP server (`EngineClient`).

A server's event loop and the engine's step loop are both Python: in one process they share one
interpreter lock, and every time the engine waits for the device the loop takes the lock for up to a
switch interval (5 ms), which is a whole decode step. Here the engine runs in a child process (spawned,
as CUDA requires) that owns the model and the cache; the server process sends it typed commands
(`dsv4.engine.client`) through one pipe and receives each step's token outputs, with the engine's metrics,
through another. Text is made in the server process (`TextStreams`: detokenization and stop strings), so
the engine's step loop never waits for it; a stop string aborts its sequence in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable

from .client import (
    Abort,
    AddRequest,
    EngineDeadError,
    Failed,
    Outputs,
    Ready,
    RequestFailed,
    Stop,
    Stream,
    deliver,
    stream_outputs,
)
from .output import TextStreams
from .sampling import SamplingParams
from .sequence import RequestError, StepOutput, TokenLogprob

log = logging.getLogger("dsv4.engine")


def pack_outputs(outputs: list[StepOutput]) -> list[tuple]:
    """Plain tuples (several times faster to pickle than dataclasses: the pipe carries every step)."""
    return [
        (
            o.request_id,
            o.index,
            o.new_tokens,
            [(lp.token, lp.logprob, lp.top) for lp in o.new_logprobs],
            o.finished,
            o.finish_reason,
            o.prompt_tokens,
            o.completion_tokens,
            o.cached_tokens,
        )
        for o in outputs
    ]


def unpack_outputs(rows: list[tuple]) -> list[StepOutput]:
    return [
        StepOutput(rid, i, toks, [TokenLogprob(*lp) for lp in lps], fin, why, pt, ct, cached)
        for rid, i, toks, lps, fin, why, pt, ct, cached in rows
    ]


def _child(commands, results, build: Callable, build_args: tuple) -> None:
    """The engine process: build the engine, say ready, then serve commands and steps until told to stop."""
    try:
        engine, info = build(*build_args)
    except BaseException as e:  # noqa: BLE001 - reported, then exit
        results.send(Failed(f"{type(e).__name__}: {e}"))
        return
    results.send(Ready(info))
    try:
        _serve(engine, commands, results)
    finally:
        engine.close()


def _serve(engine, commands, results) -> None:
    # the loop's own time beside the engine's step phases: "idle" waiting for requests with no work, "io"
    # receiving commands and sending results (both reported with the phases: where a server's time goes)
    loop = {"io": 0.0, "idle": 0.0}

    def metrics() -> dict:
        m = engine.metrics()
        m["step_seconds"] = {**m.get("step_seconds", {}), **loop}
        return m

    while True:
        start = time.monotonic()
        waited = stepped = 0.0
        timeout = 0.0 if engine.has_work() else 0.5
        handled = False
        while True:
            t = time.monotonic()
            ready = commands.poll(timeout)
            if timeout:
                waited += time.monotonic() - t
            if not ready:
                break
            timeout, handled = 0.0, True
            try:
                cmd = commands.recv()
            except EOFError:  # the server is gone
                return
            if isinstance(cmd, AddRequest):
                try:
                    engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.n)
                except RequestError as e:
                    results.send(RequestFailed(cmd.request_id, str(e), True))
                except Exception as e:  # noqa: BLE001 - the caller's error
                    results.send(RequestFailed(cmd.request_id, f"{type(e).__name__}: {e}", False))
            elif isinstance(cmd, Abort):
                if cmd.index is None:
                    engine.abort(cmd.request_id)
                else:
                    engine.abort_sequence(cmd.request_id, cmd.index)
            elif isinstance(cmd, Stop):
                return
        if handled and not engine.has_work():  # admissions and aborts move the gauges (a step reports them too)
            results.send(Outputs([], metrics(), 0.0))
        if engine.has_work():
            t = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail its requests, go on
                log.exception("engine step failed")
                for rid in list(engine.requests):
                    engine.abort(rid)
                    results.send(RequestFailed(rid, f"the engine failed while running this request: {e}", False))
                continue
            stepped = time.monotonic() - t
            results.send(Outputs(pack_outputs(outputs), metrics(), stepped))
        loop["idle"] += waited
        loop["io"] += time.monotonic() - start - waited - stepped


class EngineProcess:
    """`EngineClient` with the engine in a child process; text made here with `tokenizer`."""

    def __init__(self, build: Callable, build_args: tuple, tokenizer=None, on_step=None):
        ctx = mp.get_context("spawn")
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, self._res_send = ctx.Pipe(duplex=False)
        # not a daemon: an engine on several workers starts them as its own children (it ends when the
        # server's pipe closes, whatever ended the server)
        self._proc = ctx.Process(
            target=_child, args=(self._cmd_recv, self._res_send, build, build_args), name="dsv4-engine", daemon=False
        )
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._text = TextStreams(tokenizer, self._stop_sequence) if tokenizer is not None else None
        self._on_step = on_step
        self._reader: threading.Thread | None = None
        self._stopped = False
        self.info: dict = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 1800.0) -> dict:
        """Spawn the engine process and wait until its engine is built (model loaded, graphs captured)."""
        self._proc.start()
        self._res_send.close()  # the child holds the writing end
        self._cmd_recv.close()
        deadline = time.monotonic() + timeout
        while not self._res_recv.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process was not ready in time")
        msg = self._res_recv.recv()
        if not isinstance(msg, Ready):
            raise RuntimeError(f"the engine could not start: {msg.message}")
        self.info = msg.info
        self._reader = threading.Thread(target=self._read, name="dsv4-engine-reader", daemon=True)
        self._reader.start()
        return self.info

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        with contextlib.suppress(OSError, ValueError):
            self._send(Stop())
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()

    @property
    def alive(self) -> bool:
        return not self._stopped and self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def _send(self, msg) -> None:
        with self._send_lock:
            self._cmd_send.send(msg)

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs; leaving early aborts it (frees its pages)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), n)
        with self._lock:
            self._streams[request_id] = stream
            if self._text is not None:
                self._text.add(request_id, prompt, params, n)
        self._send(AddRequest(request_id, list(prompt), params, n))
        # an error item: the engine already dropped the request, nothing to abort
        async with contextlib.aclosing(stream_outputs(self, request_id, stream, abort_on_error=False)) as items:
            async for item in items:
                yield item

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._send(Abort(request_id))

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            if self._text is not None:
                self._text.drop(request_id)

    def _stop_sequence(self, request_id: str, index: int) -> None:
        """A stop string ended one choice: the engine stops computing it."""
        with contextlib.suppress(OSError, ValueError):
            self._send(Abort(request_id, index))

    # ------------------------------------------------------------------ outputs
    def _read(self) -> None:
        while True:
            try:
                msg = self._res_recv.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Outputs):
                outputs = unpack_outputs(msg.outputs)
                with self._lock:
                    if self._text is not None:
                        outputs = self._text.process(outputs)
                    deliver(self._streams, [(o.request_id, o) for o in outputs])
                if self._on_step is not None:
                    with contextlib.suppress(Exception):
                        self._on_step(msg.metrics, outputs, msg.seconds)
            elif isinstance(msg, RequestFailed):
                error = RequestError(msg.message) if msg.bad_request else RuntimeError(msg.message)
                with self._lock:
                    deliver(self._streams, [(msg.request_id, error)])
        self._stopped = True
        with self._lock:
            deliver(self._streams, [(rid, EngineDeadError("the engine process stopped")) for rid in self._streams])
