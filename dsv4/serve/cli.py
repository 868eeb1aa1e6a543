"""`dsv4 serve` (the OpenAI-compatible server) and `dsv4 chat` (a terminal chat, local or against a server)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

from .. import argtypes
from ..errors import UserError


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None, type=argtypes.device,
                   help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="weights and activations (default: bf16 on cuda, fp32 on cpu; fp16 for hardware without "
                        "bf16: the ops whose range needs it stay in fp32)")
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
    g.add_argument("--tensor-parallel-size", type=argtypes.int_in(1, 64), default=1, metavar="N",
                   help="serve on N worker processes, one per device (cuda:0 ... cuda:N-1, or N CPU processes with "
                        "--device cpu): the routed experts are split by expert over them and attention is "
                        "replicated (expert parallelism, the only split dsv4 has; --enable-expert-parallel is "
                        "implied); one scheduler, every step on every worker (default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="split the routed experts by expert over the --tensor-parallel-size workers (what dsv4 "
                        "does with N > 1 anyway; accepted for vLLM's command lines)")
    g.add_argument("--worker-timeout", type=argtypes.positive_float, default=300.0, metavar="S",
                   help="with N > 1: seconds a worker waits for the others in a collective before it gives up "
                        "(a dead or hung worker then stops the server) (default 300)")
    g.add_argument("--speculative", type=argtypes.int_in(0, 15), default=0, metavar="K",
                   help="speculative decoding: the model's draft (its MTP block, or a DSpark draft: K at most its "
                        "block size) drafts K tokens per step and the model verifies them in one pass (output "
                        "unchanged: greedy tokens are those of plain decoding, sampled tokens follow the same "
                        "distribution); 0 = off (default). Requests with repetition/frequency/presence penalties "
                        "decode plainly")
    g.add_argument("--speculative-threshold", type=argtypes.float_in(0.0, 1.0), default=0.0, metavar="T",
                   help="DSpark draft: verify only the drafts whose survival probability (its confidence head's) "
                        "is at least T, at most K per step; 0 = always K (default)")


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
    """(engine, info) from `dsv4 serve`'s options: what the engine process runs first (with
    --tensor-parallel-size N > 1, after starting the other workers: `dsv4.serve.workers`)."""
    if (options.get("tensor_parallel_size") or 1) > 1:
        from .workers import build_workers

        return build_workers(options)
    args = argparse.Namespace(**options)
    model, tokenizer, name, desc = _load(args)
    engine = _engine(args, model, tokenizer, detokenize=False)       # text is made in the server's process
    graphs = engine.warmup()
    info = {"desc": desc, "device": str(engine.device), "max_model_len": engine.max_model_len,
            "max_seqs": engine.config.max_seqs, "cache_mib": engine.cache.nbytes() / 2**20,
            "graphs": graphs, "warmup_s": engine.runner.warmup_seconds}
    return engine, info


def _load(args, rank: int = 0, world_size: int = 1):
    import torch

    from ..loading import load_model
    from ..train.tokenizer import ByteTokenizer

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: this torch has no CUDA device (torch {torch.__version__})")
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    model, tokenizer, desc = load_model(args, rank=rank, world_size=world_size)
    if tokenizer is None:
        tokenizer = ByteTokenizer(model.cfg.bos_token_id, model.cfg.eos_token_id)
    return model, tokenizer, _model_name(args), desc


def _engine(args, model, tokenizer, detokenize: bool = True, mirror=None):
    from ..engine import Engine, EngineConfig
    from ..loading import speculative_problem

    problem = speculative_problem(model.cfg, getattr(args, "speculative", 0) or 0,
                                  getattr(args, "speculative_threshold", 0.0) or 0.0)
    if problem:
        raise UserError(problem)
    for flag in ("max_num_seqs", "max_batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_model_len is not None and not 2 <= args.max_model_len <= model.cfg.max_seq_len:
        raise UserError(f"--max-model-len must be in [2, {model.cfg.max_seq_len}] (the model's context)")
    config = EngineConfig(max_seqs=args.max_num_seqs or 32, max_model_len=args.max_model_len,
                          max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
                          cache_pages=args.cache_pages, prefix_caching=not args.no_prefix_caching,
                          deterministic=args.deterministic, cuda_graphs=not args.no_cuda_graph,
                          speculative=getattr(args, "speculative", 0) or 0,
                          speculative_threshold=getattr(args, "speculative_threshold", 0.0) or 0.0)
    try:
        return Engine(model, config, tokenizer=tokenizer, detokenize=detokenize, mirror=mirror)
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from ..engine.engine_process import EngineProcess
    from .app import ServerState, create_app
    from .metrics import ServerMetrics

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
    from ..loading import resolve_config, speculative_problem

    problem = speculative_problem(resolve_config(args), getattr(args, "speculative", 0) or 0,
                                  getattr(args, "speculative_threshold", 0.0) or 0.0)
    if problem:                             # before the engine process loads any weights
        raise UserError(problem)
    for flag in ("max_num_seqs", "max_batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    tokenizer = _load_tokenizer(args)
    name = _model_name(args)
    metrics = ServerMetrics(name)
    options = {k: v for k, v in vars(args).items() if k != "func"}
    engine = EngineProcess(build_engine, (options,), tokenizer=tokenizer, on_step=metrics.on_step)
    try:
        info = engine.start()
    except RuntimeError as e:
        raise UserError(str(e)) from None
    metrics.on_ready(info)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name=name, max_model_len=info["max_model_len"],
                        api_key=args.api_key, metrics=metrics, max_body_bytes=args.max_body_bytes)
    app = create_app(state)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dsv4 serve: {info['desc']} as '{name}' on {info['device']}, {info['max_model_len']}-token context, "
          f"{info['max_seqs']} sequences, cache {info['cache_mib']:.1f} MiB"
          + (f", {info['graphs']} CUDA graphs captured in {info['warmup_s']:.1f} s" if info.get("graphs") else ""),
          flush=True)
    print(f"ready: http://{host}:{port}/v1", flush=True)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    died: list[str] = []

    def watch() -> None:                    # an engine (or worker) that dies takes the server down
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
    if died:
        print(died[0], file=sys.stderr, flush=True)
        return 1
    return 0


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
