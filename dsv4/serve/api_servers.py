"""Several HTTP processes over one engine (`dsv4 serve --api-servers N`).

One HTTP process streams some 15-30 thousand tokens/s before its own CPU is the limit: every token is a
server-sent event through asyncio, the ASGI stack and a socket write, at tens of microseconds each. A GPU
engine makes more at a few hundred clients. So the server can run N HTTP processes: this one (the first)
and N-1 more, each with its own listening socket on the same port (SO_REUSEPORT: the kernel spreads the
connections over them), its own event loop, tokenizer and text streams, and its own link to the one
engine process (`dsv4.engine.engine_process.EngineLink`). Metrics are shared through prometheus_client's
multiprocess files (`dsv4.serve.metrics`).

The first process starts the engine and the others, and owns the shutdown: on SIGTERM or Ctrl-C it
drains, and passes SIGTERM on to the others (each in a process group of its own, so a terminal's Ctrl-C
reaches only the first), which drain with the same grace. An HTTP process that dies takes the server
down with one line; if the first one dies, the engine process ends (its first link closed), and the
others end with it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from ..errors import UserError

MAX_API_SERVERS = 64
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's name, read when it is imported


def default_count(device: str, cores: int) -> int:
    """HTTP processes when --api-servers is not given: one on a CPU (the engine needs the cores), else one
    per 2 cores, at most 8. Each streams some 15-30k tokens/s, and a burst of new requests waits on their
    CPU: at 64 clients on one H100 (16 cores, beside the load generator's 8 processes) 8 processes against 4
    took the time to first token's p99 from 38.3 to 35.8-36.9 ms (two runs) at the same throughput, the
    inter-token p99 1.7-1.9x its p50 against 1.9x (BENCHMARKS.md, "HTTP processes at 64 clients")."""
    if device.startswith("cpu"):
        return 1
    return max(1, min(8, cores // 2))


def listen(host: str, port: int, n: int) -> list[socket.socket]:
    """N listening sockets on host:port (port 0: a free one, the same for all). One: a plain socket (a port
    in use is refused). More: one SO_REUSEPORT group, after checking that no other server holds the port
    (a second server joining the group would silently take a share of the connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bind(p: int, reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, p))
            sock.listen(2048)  # connections queue from "ready" on, before uvicorn accepts them
        except OSError as e:
            sock.close()
            raise UserError(f"cannot listen on {host}:{p}: {e.strerror}") from None
        return sock

    if n == 1:
        return [bind(port, False)]
    if not hasattr(socket, "SO_REUSEPORT"):
        raise UserError("--api-servers > 1 needs SO_REUSEPORT, which this system lacks")
    if port:
        bind(port, False).close()  # refused while anyone holds it, a SO_REUSEPORT group included
    first = bind(port, True)
    return [first] + [bind(first.getsockname()[1], True) for _ in range(n - 1)]


@contextlib.contextmanager
def shared_metrics(n: int):
    """With n > 1: a fresh directory for prometheus_client's multiprocess files, named in the environment
    before prometheus_client is imported (the processes started later inherit it), removed at the end."""
    if n == 1:
        yield None
        return
    if "prometheus_client" in sys.modules and not os.environ.get(MULTIPROC_ENV):
        raise RuntimeError("prometheus_client was imported before the metrics directory was set")
    made = None
    if not os.environ.get(MULTIPROC_ENV):
        made = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="dsv4-metrics-")
    try:
        yield os.environ[MULTIPROC_ENV]
    finally:
        if made is not None:
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(made, ignore_errors=True)


def _child(args: argparse.Namespace, info: dict, sock, ends, index: int, ready, tokenizer) -> None:
    """HTTP process `index` >= 1: its own application over its link to the engine, until told to stop.

    It imports nothing that loads torch (hundreds of MiB and a second of start-up in each process): the
    tokenizer comes from the first process, pickled, not through the checkpoint loader."""
    from ..engine.engine_process import EngineLink
    from .http_process import log_to_stderr, run_http
    from .metrics import ServerMetrics
    from .startup import EngineSpec

    os.setpgrp()  # a terminal's Ctrl-C reaches the first process, which passes SIGTERM on
    spec = EngineSpec.from_args(args, detokenize=False)
    metrics = ServerMetrics(spec.served_name, engine_wide=False)
    engine = EngineLink(*ends, tokenizer=tokenizer, on_step=metrics.on_step)
    engine.info = info
    engine.listen()
    log_to_stderr(args.log_level, f"dsv4 serve [{index}]")
    code = run_http(args, engine, tokenizer, spec.served_name, metrics, info, sock, on_started=ready.set)
    engine.shutdown()
    sys.exit(code)


class APIServers:
    """HTTP processes 1..N-1 of a server whose engine is `engine` (an `EngineProcess` with N links)."""

    def __init__(self, args: argparse.Namespace, info: dict, engine, socks: list[socket.socket], tokenizer):
        ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        self._ready = []
        for i, sock in enumerate(socks, start=1):
            ready = ctx.Event()
            proc = ctx.Process(
                target=_child,
                args=(args, info, sock, engine.link_ends(i), i, ready, tokenizer),
                name=f"dsv4-http-{i}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
            self._ready.append(ready)
        self._engine = engine

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every one listens (then this process's copies of their links and sockets are closed, so
        that the engine sees a process that ends)."""
        deadline = time.monotonic() + timeout
        for i, (proc, ready) in enumerate(zip(self.procs, self._ready, strict=True), start=1):
            while not ready.wait(0.2):
                if proc.exitcode is not None:
                    raise UserError(f"HTTP process {i} exited (code {proc.exitcode}) before it was ready")
                if time.monotonic() > deadline:
                    raise UserError(f"HTTP process {i} was not ready within {timeout:.0f} s")
            self._engine.release_link(i)

    def dead(self) -> str | None:
        """A line naming an HTTP process that exited, or None."""
        for i, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"dsv4 serve: HTTP process {i} exited (code {proc.exitcode}): shutting down"
        return None

    def drain(self) -> None:
        """Pass the shutdown on (each drains with the server's --shutdown-grace)."""
        for proc in self.procs:
            if proc.exitcode is None and proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s for them to end (after `drain`), then kill those left."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
