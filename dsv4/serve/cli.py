"""`dsv4 serve` (the OpenAI-compatible server) and `dsv4 chat` (a terminal chat, local or against a server)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import argtypes, options
from ..errors import UserError
from .api_servers import MAX_API_SERVERS


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
        "--max-prefill-tokens",
        type=argtypes.positive_int,
        default=None,
        help="tokens per step when no sequence is decoding (a burst of new prompts delays no stream, so "
        "it is computed in fewer, larger steps; each prompt's chunk stays within --max-batch-tokens). "
        "Default on a GPU: 8192, or 4 x --max-batch-tokens if less (halved while such a step's "
        "activations would take over 5%% of the GPU's memory); on a CPU --max-batch-tokens",
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
    from .api_servers import default_count, listen, shared_metrics

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_servers is None:
        from .. import defaults

        args.api_servers = default_count(str(defaults.resolve_device(args.device or "auto")), defaults.cores())
    socks = listen(args.host, args.port, args.api_servers)
    with shared_metrics(args.api_servers):  # before prometheus_client is imported
        return _serve(args, socks)


def _serve(args: argparse.Namespace, socks) -> int:
    import torch

    from ..engine.engine_process import EngineProcess
    from ..loading import resolve_config
    from .api_servers import APIServers
    from .http_process import log_to_stderr, max_connections, run_http
    from .metrics import ServerMetrics
    from .startup import EngineSpec, build_engine, check_engine_options, load_tokenizer
    from .workers import build_workers

    torch.set_num_threads(1)  # this process parses and streams; the engine process computes
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # (the tokenizer's thread pool too)
    spec = EngineSpec.from_args(args, detokenize=False)  # text is made in the HTTP processes
    check_engine_options(spec, resolve_config(spec.source))  # before the engine process reads any weights
    tokenizer = load_tokenizer(spec.source)
    name = spec.served_name
    metrics = ServerMetrics(name)
    build = build_workers if spec.tensor_parallel_size > 1 else build_engine
    engine = EngineProcess(build, (spec,), tokenizer=tokenizer, on_step=metrics.on_step, links=args.api_servers)
    others = None
    try:
        try:
            info = engine.start()
        except RuntimeError as e:
            raise UserError(str(e)) from None
        metrics.on_ready(info)
        if args.api_servers > 1:
            others = APIServers(args, info, engine, socks[1:], tokenizer)
            others.wait_ready()
        port = socks[0].getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host

        def ready() -> None:  # every HTTP process listens and is warm
            print(
                f"dsv4 serve: {info['desc']} as '{name}' on {info['device']}, {info['max_model_len']}-token "
                f"context, {info['max_seqs']} sequences, {info['threads']} compute threads, cache "
                f"{info['cache_mib']:.1f} MiB (at most {info['max_sequence_tokens']} positions per sequence), "
                f"{args.api_servers} HTTP process{'es' if args.api_servers > 1 else ''} of up to "
                f"{max_connections(args)} connections"
                + (
                    f", {info['graphs']} CUDA graphs captured in {info['warmup_s']:.1f} s" if info.get("graphs") else ""
                ),
                flush=True,
            )
            print(f"ready: http://{host}:{port}/v1", flush=True)

        log_to_stderr(args.log_level)
        code = run_http(args, engine, tokenizer, name, metrics, info, socks[0], on_started=ready, others=others)
    finally:
        if others is not None:
            others.drain()
            others.stop(args.shutdown_grace + 10)
        engine.shutdown()
    if code == 0:
        print("dsv4 serve: stopped", file=sys.stderr, flush=True)
    return code


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
    p.add_argument(
        "--api-servers",
        type=argtypes.int_in(1, MAX_API_SERVERS),
        default=None,
        metavar="N",
        help="HTTP processes over the one engine, sharing the port (each streams some 15-30k tokens/s; "
        "default: 1 on a CPU, else one per 2 cores, at most 8); --max-connections is shared among them",
    )
    engine_args(p)
    p.set_defaults(func=cmd_serve)
