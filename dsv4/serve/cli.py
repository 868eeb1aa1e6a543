"""`dsv4 serve` (the OpenAI-compatible server) and `dsv4 chat` (a terminal chat, local or against a server)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

from .. import argtypes, options
from ..errors import UserError


def engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options (`serve`, `chat`, `bench serve`): the shared ones from dsv4.options, then its own."""
    g = p.add_argument_group("engine")
    options.device_options(g)
    options.add(g, "quant_mode")
    g.add_argument("--keep-quantized", action="store_true", help="keep FP8/FP4 weights quantized in memory")
    g.add_argument(
        "--max-num-seqs",
        type=argtypes.positive_int,
        default=None,
        help="sequences running at once (default 32; `bench serve`: its --clients)",
    )
    options.add(g, "max_model_len", note="at most 8192 by default")
    g.add_argument(
        "--max-batch-tokens",
        type=argtypes.positive_int,
        default=None,
        help="tokens per engine step, shared by prompt chunks and decodes (default: 2048 or "
        "--max-num-seqs + 512 on a GPU, 512 on a CPU)",
    )
    g.add_argument(
        "--page-size",
        type=argtypes.positive_int,
        default=None,
        help="positions per cache page (default: model-derived)",
    )
    g.add_argument(
        "--cache-pages",
        type=argtypes.positive_int,
        default=None,
        help="compressed-cache pages (default: every running sequence at full length)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the cache of shared prefixes")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant numbers: a request's tokens do not depend on the other requests "
        "(float64 accumulation on the reference ops; slower)",
    )
    options.add(g, "cuda_graph")
    options.add(g, "speculative", note="requests with repetition/frequency/presence penalties decode plainly")
    options.add(g, "speculative_threshold")
    options.add(g, "tensor_parallel_size", note="cuda:0 ... cuda:N-1, or N CPU processes with --device cpu")
    options.add(g, "enable_expert_parallel")
    options.add(g, "worker_timeout")


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ..engine.engine_process import EngineProcess
    from ..loading import resolve_config
    from .app import ServerState, create_app
    from .http_guard import GracefulServer, connection_limit, guarded_protocol
    from .metrics import ServerMetrics
    from .startup import EngineSpec, build_engine, check_engine_options, load_tokenizer
    from .validate import Limits
    from .workers import build_workers

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections queue from "ready" on, before uvicorn accepts them
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    import torch

    torch.set_num_threads(1)  # this process parses and streams; the engine process computes
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # (the tokenizer's thread pool too)
    spec = EngineSpec.from_args(args, detokenize=False)  # text is made in this process
    check_engine_options(spec, resolve_config(spec.source))  # before the engine process reads any weights
    tokenizer = load_tokenizer(spec.source)
    name = spec.served_name
    metrics = ServerMetrics(name)
    build = build_workers if spec.tensor_parallel_size > 1 else build_engine
    engine = EngineProcess(build, (spec,), tokenizer=tokenizer, on_step=metrics.on_step)
    try:
        info = engine.start()
    except RuntimeError as e:
        raise UserError(str(e)) from None
    metrics.on_ready(info)
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
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    max_conn = connection_limit(args.max_connections)
    print(
        f"dsv4 serve: {info['desc']} as '{name}' on {info['device']}, {info['max_model_len']}-token context, "
        f"{info['max_seqs']} sequences, {info['threads']} compute threads, cache {info['cache_mib']:.1f} MiB "
        f"(at most "
        f"{info['max_sequence_tokens']} positions per sequence), up to {max_conn} connections"
        + (f", {info['graphs']} CUDA graphs captured in {info['warmup_s']:.1f} s" if info.get("graphs") else ""),
        flush=True,
    )
    print(f"ready: http://{host}:{port}/v1", flush=True)
    _log_to_stderr(args.log_level)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        http=guarded_protocol(args.header_timeout, args.body_timeout, max_conn),
        timeout_graceful_shutdown=args.shutdown_grace + 5,
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = GracefulServer(config, args.shutdown_grace, state.begin_drain, state.end_in_flight)
    died: list[str] = []

    def watch() -> None:  # an engine (or worker) that dies takes the server down
        while not server.should_exit:
            if not engine.alive:
                died.append(f"dsv4 serve: the engine process stopped (exit code {engine.exitcode}): shutting down")
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="dsv4-engine-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        state.executor.shutdown(wait=False, cancel_futures=True)
    if died:
        print(died[0], file=sys.stderr, flush=True)
        return 1
    print("dsv4 serve: stopped", file=sys.stderr, flush=True)
    return 0


def _log_to_stderr(level: str) -> None:
    """dsv4's own server log lines (dsv4.serve, dsv4.engine) on stderr, one line each."""
    import logging

    logger = logging.getLogger("dsv4")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dsv4 serve: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


# ------------------------------------------------------------------------------------------ parsers
def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (continuous batching, streaming)",
        description="Serve a model over the OpenAI API: POST /v1/chat/completions, /v1/completions; "
        "GET /v1/models, /health, /metrics. With no arguments: the shipped model on "
        "127.0.0.1:8000. One log line per request (method, path, status, tokens, "
        "latency) with --log-level info.",
    )
    options.model_options(p, "the shipped model")
    p.add_argument(
        "--host", default="127.0.0.1", type=argtypes.text, help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=argtypes.port, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        type=argtypes.text,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        type=argtypes.text,
        help="the model id clients send (default: directory name)",
    )
    p.add_argument(
        "--max-body-bytes", type=argtypes.positive_int, default=8 * 2**20, help="largest request body (default 8 MiB)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info: a line per request and the shutdown; warning: trouble only; debug: also uvicorn's access log",
    )
    g = p.add_argument_group("limits per request and per client")
    g.add_argument(
        "--max-messages",
        type=argtypes.positive_int,
        default=1024,
        help="chat messages per request (default 1024; more: a 400)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=argtypes.positive_int,
        default=1 << 20,
        help="characters of text per prompt (a chat: its messages together), token ids per prompt "
        "(default 1048576; more: a 400)",
    )
    g.add_argument(
        "--max-seqs-per-request",
        type=argtypes.positive_int,
        default=64,
        help="sequences one request may start: prompts x n (default 64; more: a 400)",
    )
    g.add_argument(
        "--max-connections",
        type=argtypes.positive_int,
        default=1000,
        help="open connections; more are reset at once (default 1000, lowered to fit the descriptor limit, ulimit -n)",
    )
    g.add_argument(
        "--header-timeout",
        type=argtypes.float_in(0.0, 3600.0, lo_open=True),
        default=10.0,
        help="seconds a client may take to send a request's headers (default 10; then 408)",
    )
    g.add_argument(
        "--body-timeout",
        type=argtypes.float_in(0.0, 3600.0, lo_open=True),
        default=30.0,
        help="seconds a client may take to send a request's body (default 30; then 408)",
    )
    g.add_argument(
        "--shutdown-grace",
        type=argtypes.float_in(0.0, 86400.0),
        default=30.0,
        help="on SIGTERM / Ctrl-C: seconds the requests in flight may still run before they are "
        "ended with finish_reason 'abort' (default 30; new requests get 503 at once)",
    )
    engine_args(p)
    p.set_defaults(func=cmd_serve)
