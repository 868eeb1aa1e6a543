"""The engine in a process of its own, for the HTTP server (`EngineClient`).

A server's event loop and the engine's step loop are both Python: in one process they share one
interpreter lock, and every time the engine waits for the device the loop takes the lock for up to a
switch interval (5 ms), which is a whole decode step. Here the engine runs in a child process (spawned,
as CUDA requires) that owns the model and the cache; the server process sends it typed commands
(`dsv4.engine.client`) through one pipe and receives each step's token outputs, with the engine's metrics,
through another. Text is made in the server process (`TextStreams`: detokenization and stop strings), so
the engine's step loop never waits for it; a stop string aborts its sequence in the engine.

One HTTP process streams some 15-30 thousand tokens/s before its own CPU is the limit (every token is a
server-sent event through asyncio, the ASGI stack and a socket write). So the engine process can serve
several (`dsv4 serve --api-servers N`): each has a link of its own (`EngineLink`: a command pipe and a
result pipe), and a request's outputs go back through the link it came in on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait

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
from .params import SamplingParams
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
            o.timing,
        )
        for o in outputs
    ]


def unpack_outputs(rows: list[tuple]) -> list[StepOutput]:
    return [
        StepOutput(rid, i, toks, [TokenLogprob(*lp) for lp in lps], fin, why, pt, ct, cached, timing=timing)
        for rid, i, toks, lps, fin, why, pt, ct, cached, timing in rows
    ]


def freeze_heap() -> int:
    """After a collection, move every object alive now out of the cycle collector's sight (`gc.freeze`);
    how many. A serving process's start-up leaves some 300 thousand objects (torch, FastAPI, the model's
    modules), and every full collection walked them all: 100-300 ms in which an engine step, or every
    stream of an HTTP process, stood still (the H200's inter-token p99 at 256 clients was 17x its p50).
    What start-up made lives as long as the process; only what serving makes is still collected. At exit
    the objects are handed back, so the interpreter's last collection frees them (frozen, triton's bindings
    reported each as leaked: some sixty lines on every shutdown)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


def _child(links: list[tuple], build: Callable, build_args: tuple) -> None:
    """The engine process: build the engine, say ready (on the first link), then serve commands and steps
    until told to stop. links[i] = (commands, results) of HTTP process i."""
    results = links[0][1]
    try:
        engine, info = build(*build_args)
    except BaseException as e:  # noqa: BLE001 - reported, then exit
        results.send(Failed(f"{type(e).__name__}: {e}"))
        return
    freeze_heap()
    results.send(Ready(info))
    try:
        _serve(engine, links)
    finally:
        engine.close()


def _serve(engine, links: list[tuple]) -> None:
    """The engine process's loop over the links of its HTTP processes (links[i] = (commands, results)).
    A request's outputs go to the link that sent it; the first link's end ends the loop (the server that
    started the engine is gone), another's aborts that process's requests."""
    # the loop's own time beside the engine's step phases: "idle" waiting for requests with no work, "io"
    # receiving commands and sending results (both reported with the phases: where a server's time goes)
    from ..ops import compiles  # (the engine's side only: an HTTP process loads no torch)

    loop = {"io": 0.0, "idle": 0.0}
    said = [0]  # kernel compilations after ready already logged
    owner: dict[str, int] = {}  # request id -> the link it came from
    open_links = {conn: i for i, (conn, _) in enumerate(links)}

    def metrics() -> dict:
        m = engine.metrics()
        m["step_seconds"] = {**m.get("step_seconds", {}), **loop}
        return m

    def send(i: int, msg) -> None:
        with contextlib.suppress(OSError):  # an HTTP process that is gone: its requests are aborted below
            links[i][1].send(msg)

    def failed(rid: str, message: str, bad_request: bool) -> None:
        send(owner.pop(rid, 0), RequestFailed(rid, message, bad_request))

    def handle(i: int, cmd) -> bool:
        """Run one command of link i; False when the loop must end."""
        if isinstance(cmd, AddRequest):
            owner[cmd.request_id] = i
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.n)
            except RequestError as e:
                failed(cmd.request_id, str(e), True)
            except Exception as e:  # noqa: BLE001 - the caller's error
                failed(cmd.request_id, f"{type(e).__name__}: {e}", False)
        elif isinstance(cmd, Abort):
            if cmd.index is None:
                engine.abort(cmd.request_id)
                owner.pop(cmd.request_id, None)
            else:
                engine.abort_sequence(cmd.request_id, cmd.index)
                if cmd.request_id not in engine.requests:  # its last choice: no output will end it here
                    owner.pop(cmd.request_id, None)
        elif isinstance(cmd, Stop):
            return False
        return True

    def lost(conn) -> bool:
        """Link of `conn` closed: False when it was the first (the loop ends); else abort its requests."""
        i = open_links.pop(conn)
        if i == 0:
            return False
        orphans = [r for r, o in owner.items() if o == i]
        for rid in orphans:
            engine.abort(rid)
            del owner[rid]
        if orphans:
            log.warning(f"HTTP process {i} is gone: aborted its {len(orphans)} requests")
        return True

    while True:
        start = time.monotonic()
        waited = stepped = 0.0
        timeout = 0.0 if engine.has_work() else 0.5
        handled = False
        while True:
            t = time.monotonic()
            ready = mp_wait(list(open_links), timeout)
            if timeout:
                waited += time.monotonic() - t
            if not ready:
                break
            timeout, handled = 0.0, True
            for conn in ready:
                try:
                    cmd = conn.recv()
                except EOFError:  # that HTTP process is gone
                    if not lost(conn):
                        return
                    continue
                if not handle(open_links[conn], cmd):
                    return
        if handled and not engine.has_work():  # admissions and aborts move the gauges (a step reports them too)
            send(0, Outputs([], metrics(), 0.0))
        if engine.has_work():
            t = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - fail its requests, go on
                log.exception("engine step failed")
                for rid in list(engine.requests):
                    engine.abort(rid)
                    failed(rid, f"the engine failed while running this request: {e}", False)
                continue
            stepped = time.monotonic() - t
            by_link: dict[int, list[StepOutput]] = {}
            for o in outputs:
                by_link.setdefault(owner.get(o.request_id, 0), []).append(o)
                if o.finished and o.request_id not in engine.requests:
                    owner.pop(o.request_id, None)
            m = metrics()
            late = m.get("kernel_compiles_after_ready") or 0
            if late > said[0]:  # a step waited for a compilation: say which kernel, once
                names = compiles.names((compiles.count() or 0) - (late - said[0])) or ["?"]
                log.warning(f"kernel compiled after the server was ready (a step waited): {', '.join(names)}")
                said[0] = late
            for i in sorted({0, *by_link}):  # the first link every step: it reports the engine's metrics
                send(i, Outputs(pack_outputs(by_link.get(i, [])), m, stepped))
        loop["idle"] += waited
        loop["io"] += time.monotonic() - start - waited - stepped


class EngineLink:
    """`EngineClient` over one link to the engine process (the pipes `commands` and `results`): what an
    HTTP process holds. Text is made here with `tokenizer`; `on_step(metrics, outputs, seconds)` sees
    every message of a step. The engine process is `EngineProcess`'s; a link that closes (`close`) has its
    requests aborted there."""

    def __init__(self, commands: Connection, results: Connection, tokenizer=None, on_step=None):
        self._cmd_send, self._res_recv = commands, results
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._text = TextStreams(tokenizer, self._stop_sequence) if tokenizer is not None else None
        self._on_step = on_step
        self._reader: threading.Thread | None = None
        self._stopped = False
        self.info: dict = {}

    def listen(self) -> None:
        """Start receiving the engine's outputs (a thread)."""
        self._reader = threading.Thread(target=self._read, name="dsv4-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._stopped

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close this link (the engine aborts its requests; the engine process goes on for the others)."""
        self._stopped = True
        for conn in (self._cmd_send, self._res_recv):
            with contextlib.suppress(OSError):
                conn.close()

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


class EngineProcess(EngineLink):
    """The engine in a child process, and this process's link to it (`EngineClient`). With `links` > 1 the
    engine serves that many HTTP processes: this one, and those started with `link_ends(i)`, i >= 1."""

    def __init__(self, build: Callable, build_args: tuple, tokenizer=None, on_step=None, links: int = 1):
        ctx = mp.get_context("spawn")
        pipes = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(links)]
        # link i: the engine reads commands from cmd_recv and writes results to res_send
        child_ends = [(cmd_recv, res_send) for (cmd_recv, _), (_, res_send) in pipes]
        self._ends = [(cmd_send, res_recv) for (_, cmd_send), (res_recv, _) in pipes]
        super().__init__(*self._ends[0], tokenizer=tokenizer, on_step=on_step)
        # not a daemon: an engine on several workers starts them as its own children (it ends when the
        # server's pipe closes, whatever ended the server)
        self._proc = ctx.Process(target=_child, args=(child_ends, build, build_args), name="dsv4-engine", daemon=False)
        self._child_ends = child_ends

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 1800.0) -> dict:
        """Spawn the engine process and wait until its engine is built (model loaded, graphs captured)."""
        self._proc.start()
        for ends in self._child_ends:  # the child holds them
            for conn in ends:
                conn.close()
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
        self.listen()
        return self.info

    def link_ends(self, i: int) -> tuple[Connection, Connection]:
        """(commands, results) of link i >= 1, for `EngineLink` in another HTTP process. Once that process
        has them, `release_link(i)`: a copy left open here would hide that process's end from the engine."""
        return self._ends[i]

    def release_link(self, i: int) -> None:
        for conn in self._ends[i]:
            with contextlib.suppress(OSError):
                conn.close()

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
