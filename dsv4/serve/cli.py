"""`dsv4 serve` (the OpenAI-compatible server) and `dsv4 chat` (a terminal chat, local or against a server)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from .. import argtypes
from ..errors import UserError


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None, type=argtypes.device,
                   help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="weights and activations (default: bf16 on cuda, fp32 on cpu)")
    g.add_argument("--keep-quantized", action="store_true", help="keep FP8/FP4 weights quantized in memory")
    from ..loading import add_quant_mode_arg

    add_quant_mode_arg(g)
    g.add_argument("--max-num-seqs", type=argtypes.positive_int, default=None,
                   help="sequences running at once (default 32; `bench serve`: its --clients)")
    g.add_argument("--max-model-len", type=argtypes.int_in(2), default=None,
                   help="context per sequence, prompt + output (default: the model's, at most 8192)")
    g.add_argument("--max-batch-tokens", type=argtypes.positive_int, default=None,
                   help="tokens per engine step, shared by prompt chunks and decodes (default: 4096 on a GPU, "
                        "512 on a CPU)")
    g.add_argument("--page-size", type=argtypes.positive_int, default=None,
                   help="positions per cache page (default: model-derived)")
    g.add_argument("--cache-pages", type=argtypes.positive_int, default=None,
                   help="compressed-cache pages (default: every running sequence at full length)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the cache of shared prefixes")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numbers: a request's tokens do not depend on the other requests "
                        "(float64 accumulation on the reference ops; slower)")
    g.add_argument("--no-cuda-graph", action="store_true", help="run decode steps eagerly on CUDA")
    g.add_argument("--speculative", type=argtypes.int_in(0, 15), default=0, metavar="K",
                   help="speculative decoding: the model's MTP block drafts K tokens per step and the model "
                        "verifies them in one pass (output unchanged: greedy tokens are those of plain decoding, "
                        "sampled tokens follow the same distribution); 0 = off (default). Steps run eagerly. "
                        "Requests with repetition/frequency/presence penalties decode plainly")


def _model_name(args) -> str:
    from ..loading import default_model_dir

    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if getattr(args, "preset", None):
        return args.preset
    return Path(args.model).name if args.model else default_model_dir().name


def _load_tokenizer(args):
    """The tokenizer alone (the server process encodes prompts; the engine process holds the model)."""
    from ..loading import default_model_dir, resolve_config
    from ..train.tokenizer import ByteTokenizer, Tokenizer

    if getattr(args, "model", None) or not (getattr(args, "preset", None) or getattr(args, "config", None)):
        from ..checkpoint.hub import resolve_model_path

        path = resolve_model_path(args.model, weights=False) if args.model else default_model_dir()
        if path is not None and (path / "tokenizer.json").exists():
            return Tokenizer.from_file(path)
    cfg = resolve_config(args)
    return ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id)


def build_engine(options: dict):
    """(engine, info) from `dsv4 serve`'s options: what the engine process runs first."""
    import signal

    # Ctrl-C in a terminal reaches the whole process group: the HTTP process handles it (a graceful shutdown)
    # and stops this one through its pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = argparse.Namespace(**options)
    model, tokenizer, name, desc = _load(args)
    engine = _engine(args, model, tokenizer)
    engine.warmup()
    from .capacity import longest_sequence

    info = {"desc": desc, "device": str(engine.device), "max_model_len": engine.max_model_len,
            "max_seqs": engine.config.max_seqs, "cache_mib": engine.cache.nbytes() / 2**20,
            "vocab_size": engine.vocab, "max_n": engine.config.max_n,
            "max_sequence_tokens": longest_sequence(engine)}
    return engine, info


def _load(args):
    import torch

    from ..loading import load_model
    from ..train.tokenizer import ByteTokenizer

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: this torch has no CUDA device (torch {torch.__version__})")
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    model, tokenizer, desc = load_model(args)
    if tokenizer is None:
        tokenizer = ByteTokenizer(model.cfg.bos_token_id, model.cfg.eos_token_id)
    return model, tokenizer, _model_name(args), desc


def _engine(args, model, tokenizer):
    from ..engine import Engine, EngineConfig

    for flag in ("max_num_seqs", "max_batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_model_len is not None and not 2 <= args.max_model_len <= model.cfg.max_seq_len:
        raise UserError(f"--max-model-len must be in [2, {model.cfg.max_seq_len}] (the model's context)")
    config = EngineConfig(max_seqs=args.max_num_seqs or 32, max_model_len=args.max_model_len,
                          max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
                          cache_pages=args.cache_pages, prefix_caching=not args.no_prefix_caching,
                          deterministic=args.deterministic, cuda_graphs=not args.no_cuda_graph,
                          speculative=getattr(args, "speculative", 0) or 0)
    try:
        return Engine(model, config, tokenizer=tokenizer)
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ..engine.engine_process import EngineProcess
    from .app import ServerState, create_app
    from .http_guard import GracefulServer, connection_limit, guarded_protocol
    from .metrics import ServerMetrics
    from .validate import Limits

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)                   # connections queue from "ready" on, before uvicorn accepts them
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    import torch

    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: this torch has no CUDA device (torch {torch.__version__})")
    for flag in ("max_num_seqs", "max_batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    tokenizer = _load_tokenizer(args)
    name = _model_name(args)
    metrics = ServerMetrics(name)
    options = {k: v for k, v in vars(args).items() if k != "func"}
    engine = EngineProcess(build_engine, (options,), on_step=metrics.on_step)
    try:
        info = engine.start()
    except RuntimeError as e:
        raise UserError(str(e)) from None
    limits = Limits(vocab_size=info["vocab_size"], max_model_len=info["max_model_len"],
                    max_sequence_tokens=info["max_sequence_tokens"], max_n=info["max_n"],
                    max_seqs_per_request=args.max_seqs_per_request, max_messages=args.max_messages,
                    max_prompt_chars=args.max_prompt_chars)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name=name, max_model_len=info["max_model_len"],
                        api_key=args.api_key, metrics=metrics, max_body_bytes=args.max_body_bytes, limits=limits)
    app = create_app(state)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    max_conn = connection_limit(args.max_connections)
    print(f"dsv4 serve: {info['desc']} as '{name}' on {info['device']}, {info['max_model_len']}-token context, "
          f"{info['max_seqs']} sequences, cache {info['cache_mib']:.1f} MiB (at most "
          f"{info['max_sequence_tokens']} positions per sequence), up to {max_conn} connections", flush=True)
    print(f"ready: http://{host}:{port}/v1", flush=True)
    _log_to_stderr(args.log_level)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                            http=guarded_protocol(args.header_timeout, args.body_timeout, max_conn),
                            timeout_graceful_shutdown=args.shutdown_grace + 5)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = GracefulServer(config, args.shutdown_grace, state.begin_drain, state.end_in_flight)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        state.executor.shutdown(wait=False, cancel_futures=True)
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


# ------------------------------------------------------------------------------------------ chat
def _stream_from_server(url: str, api_key: str | None, model: str | None, messages: list[dict], max_tokens: int,
                        temperature: float, thinking: bool):
    """Yield (kind, text) deltas from a running server's streaming chat endpoint (kind: content/reasoning)."""
    import urllib.error
    import urllib.request

    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if model is None:
        req = urllib.request.Request(f"{base}/models", headers=headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "thinking": {"type": "enabled" if thinking else "disabled"}}
    req = urllib.request.Request(f"{base}/chat/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        yield "reasoning", delta["reasoning_content"]
                    if delta.get("content"):
                        yield "content", delta["content"]
                    for call in delta.get("tool_calls") or []:
                        yield "content", f"[tool call {call['function']['name']}({call['function']['arguments']})]"
    except urllib.error.HTTPError as e:
        try:
            msg = json.load(e)["error"]["message"]
        except Exception:                                               # noqa: BLE001
            msg = str(e)
        raise UserError(f"the server refused the request: {msg}") from None
    except urllib.error.URLError as e:
        raise UserError(f"cannot reach {url}: {e.reason}") from None


def cmd_chat(args: argparse.Namespace) -> int:
    from . import chat_format

    if args.url:
        def reply(messages):
            return _stream_from_server(args.url, args.api_key, args.served_model_name, messages, args.max_tokens,
                                       args.temperature, args.thinking)
    else:
        from ..engine import SamplingParams

        model, tokenizer, name, desc = _load(args)
        engine = _engine(args, model, tokenizer)
        print(f"chatting with {desc} on {engine.device} (Ctrl-D or /exit to leave, /reset to start over)",
              file=sys.stderr)
        counter = [0]

        def reply(messages):
            text = chat_format.encode_chat(messages, thinking=args.thinking)
            prompt = tokenizer.encode(text, bos=False)
            room = engine.max_model_len - len(prompt)
            if room < 1:
                raise UserError(f"the conversation is {len(prompt)} tokens and the context is {engine.max_model_len} "
                                f"tokens (prompt + output; the model's max_position_embeddings is "
                                f"{model.cfg.max_seq_len}): /reset to start over, or raise --max-model-len")
            counter[0] += 1
            params = SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature,
                                    seed=args.seed + counter[0], skip_special_tokens=False)
            engine.add_request(f"chat-{counter[0]}", prompt, params)
            parser = chat_format.ChatStreamParser(thinking=args.thinking)
            while engine.has_work():
                for out in engine.step():
                    for ev in parser.feed(out.text):
                        yield from _event(ev)
            for ev in parser.finish().flushed:
                yield from _event(ev)

    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    refused = 0
    if hasattr(sys.stdin, "reconfigure"):   # undecodable bytes as lone surrogates (refused per message
        sys.stdin.reconfigure(errors="surrogateescape")       # below) in any locale, not a crash mid-chat
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        try:
            line.encode("utf-8")            # undecodable input bytes arrive as lone surrogates
        except UnicodeEncodeError as e:
            print(f"error: the message is not valid UTF-8 text (character {e.start}): not sent", file=sys.stderr)
            refused += 1
            continue
        messages.append({"role": "user", "content": line})
        parts = {"content": [], "reasoning": []}
        if interactive:
            sys.stdout.write("model> ")
        try:
            for kind, text in reply(messages):
                parts[kind].append(text)
                sys.stdout.write(text if kind == "content" else f"\x1b[2m{text}\x1b[0m" if interactive else text)
                sys.stdout.flush()
        except UserError as e:              # this message is refused (too long ...): say why, keep chatting
            sys.stdout.write("\n")
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            refused += 1
            continue
        sys.stdout.write("\n")
        msg = {"role": "assistant", "content": "".join(parts["content"])}
        if parts["reasoning"]:
            msg["reasoning_content"] = "".join(parts["reasoning"])
        messages.append(msg)
    return 2 if refused else 0


def _event(ev):
    from . import chat_format

    if isinstance(ev, chat_format.ReasoningDelta):
        yield "reasoning", ev.text
    elif isinstance(ev, chat_format.ContentDelta):
        yield "content", ev.text
    else:
        yield "content", f"[tool call {ev.call.name}({ev.call.arguments})]"


# ------------------------------------------------------------------------------------------ parsers
def add_serve_parsers(sub) -> None:
    from ..loading import add_model_args

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, streaming)",
                       description="Serve a model over the OpenAI API: POST /v1/chat/completions, /v1/completions; "
                                   "GET /v1/models, /health, /metrics. With no arguments: the shipped model on "
                                   "127.0.0.1:8000.")
    add_model_args(p, "the shipped model")
    p.add_argument("--host", default="127.0.0.1", type=argtypes.text,
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, type=argtypes.text,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--served-model-name", default=None, type=argtypes.text,
                   help="the model id clients send (default: directory name)")
    p.add_argument("--max-body-bytes", type=argtypes.positive_int, default=8 * 2**20,
                   help="largest request body (default 8 MiB)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    g = p.add_argument_group("limits per request and per client")
    g.add_argument("--max-messages", type=argtypes.positive_int, default=1024,
                   help="chat messages per request (default 1024; more: a 400)")
    g.add_argument("--max-prompt-chars", type=argtypes.positive_int, default=1 << 20,
                   help="characters of text per prompt (a chat: its messages together), token ids per prompt "
                        "(default 1048576; more: a 400)")
    g.add_argument("--max-seqs-per-request", type=argtypes.positive_int, default=64,
                   help="sequences one request may start: prompts x n (default 64; more: a 400)")
    g.add_argument("--max-connections", type=argtypes.positive_int, default=1000,
                   help="open connections; more are reset at once (default 1000, lowered to fit the "
                        "descriptor limit, ulimit -n)")
    g.add_argument("--header-timeout", type=argtypes.float_in(0.0, 3600.0, lo_open=True), default=10.0,
                   help="seconds a client may take to send a request's headers (default 10; then 408)")
    g.add_argument("--body-timeout", type=argtypes.float_in(0.0, 3600.0, lo_open=True), default=30.0,
                   help="seconds a client may take to send a request's body (default 30; then 408)")
    g.add_argument("--shutdown-grace", type=argtypes.float_in(0.0, 86400.0), default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds the requests in flight may still run before they are "
                        "ended with finish_reason 'abort' (default 30; new requests get 503 at once)")
    _engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="chat in the terminal with a model (loaded here, or a running server)")
    add_model_args(p, "the shipped model")
    p.add_argument("--url", default=None, type=argtypes.text,
                   help="a running dsv4 serve (or other OpenAI-compatible) server")
    p.add_argument("--api-key", default=None, type=argtypes.text)
    p.add_argument("--served-model-name", default=None, type=argtypes.text,
                   help="model id on the server (default: its first model)")
    p.add_argument("--system", default=None, type=argtypes.text, help="a system message")
    p.add_argument("--thinking", action="store_true", help="thinking mode (reasoning shown dimmed)")
    p.add_argument("--max-tokens", type=argtypes.positive_int, default=256)
    p.add_argument("--temperature", type=argtypes.temperature, default=0.7)
    p.add_argument("--seed", type=argtypes.seed_int, default=0)
    _engine_args(p)
    p.set_defaults(func=cmd_chat)
