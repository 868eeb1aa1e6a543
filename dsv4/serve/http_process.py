"""One HTTP process of `dsv4 serve`: the application over an engine link, served by uvicorn on a socket
that is already listening, until a signal (a graceful drain) or the engine's end. The first process runs
it after starting the engine; with --api-servers N, so do the N-1 others (`dsv4.serve.api_servers`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable


def log_to_stderr(level: str, prefix: str = "dsv4 serve") -> None:
    """dsv4's own server log lines (dsv4.serve, dsv4.engine) on stderr, one line each."""
    logger = logging.getLogger("dsv4")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def max_connections(args: argparse.Namespace) -> int:
    """This process's share of --max-connections, lowered to fit its descriptor limit."""
    from .http_guard import connection_limit

    return connection_limit(-(-args.max_connections // max(1, getattr(args, "api_servers", 1) or 1)))


def watch(server, engine, others, died: list[str]) -> threading.Thread:
    """A thread that stops `server` when the engine or another HTTP process dies (its line in `died`)."""

    def run() -> None:
        while not server.should_exit:
            if not engine.alive:
                code = getattr(engine, "exitcode", None)  # (known to the process that started it)
                how = f" (exit code {code})" if code is not None else ""
                died.append(f"dsv4 serve: the engine process stopped{how}: shutting down")
                server.should_exit = True
                return
            line = others.dead() if others is not None else None
            if line:
                died.append(line)
                server.should_exit = True
                return
            time.sleep(0.2)

    thread = threading.Thread(target=run, name="dsv4-engine-watch", daemon=True)
    thread.start()
    return thread


def run_http(
    args: argparse.Namespace,
    engine,
    tokenizer,
    name: str,
    metrics,
    info: dict,
    sock,
    on_started: Callable[[], None] | None = None,
    others=None,
) -> int:
    """Serve until stopped; 0, or 1 when the engine (or, in the first process, another HTTP process `others`)
    died. `on_started` runs once uvicorn accepts connections."""
    import uvicorn

    from ..engine.engine_process import freeze_heap
    from .app import ServerState, create_app
    from .http_guard import GracefulServer, guarded_protocol
    from .validate import Limits
    from .warmup import warm_up

    limits = Limits(
        vocab_size=info["vocab_size"],
        max_model_len=info["max_model_len"],
        max_sequence_tokens=info["max_sequence_tokens"],
        max_n=info["max_n"],
        max_seqs_per_request=args.max_seqs_per_request,
        max_messages=args.max_messages,
        max_prompt_chars=args.max_prompt_chars,
    )
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        max_model_len=info["max_model_len"],
        api_key=args.api_key,
        metrics=metrics,
        max_body_bytes=args.max_body_bytes,
        limits=limits,
    )
    app = create_app(state)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        http=guarded_protocol(args.header_timeout, args.body_timeout, max_connections(args)),
        timeout_graceful_shutdown=args.shutdown_grace + 5,
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)

    def drain() -> None:
        state.begin_drain()
        if others is not None:
            others.drain()

    server = GracefulServer(config, args.shutdown_grace, drain, state.end_in_flight)
    died: list[str] = []
    watch(server, engine, others, died)

    def announce() -> None:  # once uvicorn listens: the warm-up, then "ready"
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if not server.started:
            return
        try:
            asyncio.run_coroutine_threadsafe(warm_up(app, name, args.api_key), server.loop).result()
        except Exception as e:  # noqa: BLE001 - a server that did not warm up still serves
            logging.getLogger("dsv4.serve").warning(f"warm-up failed: {type(e).__name__}: {e}")
        if on_started is not None:
            on_started()

    threading.Thread(target=announce, name="dsv4-started", daemon=True).start()
    freeze_heap()  # start-up's objects: out of every full collection's walk
    try:
        server.run(sockets=[sock])
    finally:
        state.executor.shutdown(wait=False, cancel_futures=True)
    if died:
        print(died[0], file=sys.stderr, flush=True)
        return 1
    return 0
