"""`dsv4 chat`: a terminal chat with a model loaded in this process, or with a running server (`--url`).

Replies stream as they come (reasoning dimmed in thinking mode). Ctrl-C during a reply stops that reply
(its sequence is aborted; what it wrote so far stays in the conversation) and returns to the prompt; at
the prompt, Ctrl-C once says how to leave, twice leaves, as Ctrl-D and /exit do. /help lists the
commands, /reset starts over (and says so). A message that cannot be sent (past the context, not UTF-8)
is refused with one line and the chat goes on; the exit code is then 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator

from .. import argtypes, options
from ..errors import UserError

HELP = """commands:
  /help          this list
  /reset         start a new conversation (the --system message is kept)
  /exit, /quit   leave (also Ctrl-D, or Ctrl-C twice at the prompt)
  Ctrl-C         during a reply: stop it and return to the prompt"""


def _server_model(base: str, headers: dict, model: str | None) -> str:
    import urllib.error
    import urllib.request

    if model is not None:
        return model
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/models", headers=headers), timeout=30) as r:
            return json.load(r)["data"][0]["id"]
    except urllib.error.HTTPError as e:
        raise UserError(f"{base}/models answered {e.code}: give --api-key, or --served-model-name") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot reach {base}: {getattr(e, 'reason', e)}") from None
    except (ValueError, KeyError, IndexError):
        raise UserError(f"{base}/models did not list a model: give --served-model-name") from None


def _stream_from_server(
    base: str,
    headers: dict,
    model: str,
    messages: list[dict],
    max_tokens: int,
    temperature: float,
    seed: int | None,
    thinking: bool,
) -> Iterator[tuple[str, str]]:
    """(kind, text) deltas of a running server's streaming chat endpoint (kind: content / reasoning). Closing
    the generator (Ctrl-C) closes the connection, which aborts the request on the server."""
    import urllib.error
    import urllib.request

    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if seed is not None:
        body["seed"] = seed
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
        except Exception:  # noqa: BLE001
            msg = str(e)
        raise UserError(f"the server refused the request: {msg}") from None
    except urllib.error.URLError as e:
        raise UserError(f"cannot reach {base}: {e.reason}") from None


def _event(ev) -> Iterator[tuple[str, str]]:
    from . import chat

    if isinstance(ev, chat.ReasoningDelta):
        yield "reasoning", ev.text
    elif isinstance(ev, chat.ContentDelta):
        yield "content", ev.text
    else:
        yield "content", f"[tool call {ev.call.name}({ev.call.arguments})]"


def _local_replier(args) -> tuple[Callable, str]:
    """(reply(messages) -> (kind, text) iterator, banner) for a model loaded in this process (with
    --tensor-parallel-size N > 1: this process is worker 0 of N, `dsv4.serve.workers`; the others stop
    when this one exits)."""
    import atexit
    import secrets

    from ..defaults import set_threads
    from ..engine import SamplingParams
    from . import chat
    from .startup import EngineSpec, load, load_tokenizer, make_engine

    spec = EngineSpec.from_args(args, detokenize=True)
    if spec.tensor_parallel_size > 1:
        from .workers import build_workers

        engine, info = build_workers(spec, own_process=False)
        atexit.register(engine.close)
        model, tokenizer, desc = engine.model, load_tokenizer(spec.source), info["desc"]
    else:
        set_threads(spec.threads)
        model, tokenizer, _name, desc = load(spec)
        engine = make_engine(spec, model, tokenizer)
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    counter = [0]

    def reply(messages):
        text = chat.encode_chat(messages, thinking=args.thinking)
        prompt = tokenizer.encode(text, bos=False)
        room = engine.max_model_len - len(prompt)
        if room < 1:
            more = ", or raise --max-model-len" if engine.max_model_len < model.cfg.max_seq_len else ""
            raise UserError(
                f"the conversation is {len(prompt)} tokens and the context is {engine.max_model_len} "
                f"tokens (prompt + output; the model's max_position_embeddings is "
                f"{model.cfg.max_seq_len}): /reset to start over{more}"
            )
        counter[0] += 1
        rid = f"chat-{counter[0]}"
        params = SamplingParams(
            max_tokens=min(args.max_new_tokens, room),
            temperature=args.temperature,
            seed=(seed + counter[0]) % 2**63,
            skip_special_tokens=False,
        )
        engine.add_request(rid, prompt, params)
        parser = chat.ChatStreamParser(thinking=args.thinking)
        try:
            while engine.has_work():
                for out in engine.step():
                    for ev in parser.feed(out.text):
                        yield from _event(ev)
            for ev in parser.finish().flushed:
                yield from _event(ev)
        finally:
            engine.abort(rid)  # a reply stopped by Ctrl-C frees its sequence
            while engine.has_work():  # (an overlapped step still in flight)
                engine.step()

    return reply, f"{desc} on {engine.device}"


def _url_replier(args) -> tuple[Callable, str]:
    base = args.url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    model = _server_model(base, headers, args.served_model_name)

    def reply(messages):
        return _stream_from_server(
            base, headers, model, messages, args.max_new_tokens, args.temperature, args.seed, args.thinking
        )

    return reply, f"{model} at {base}"


def cmd_chat(args: argparse.Namespace) -> int:
    reply, who = _url_replier(args) if args.url else _local_replier(args)
    interactive = sys.stdin.isatty()
    print(f"chatting with {who} (/help for commands; Ctrl-D or /exit to leave)", file=sys.stderr)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    refused = 0
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes as lone surrogates (refused per message
        sys.stdin.reconfigure(errors="surrogateescape")  # below) in any locale, not a crash mid-chat
    armed = False  # Ctrl-C once at the prompt: the next one leaves
    while True:
        try:  # the prompt and the commands: a Ctrl-C anywhere here is one at the prompt
            line = input("you> ") if interactive else sys.stdin.readline()
            armed = False
            if not interactive and line == "":
                break
            line = line.strip()
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/help":
                print(HELP, file=sys.stderr)
                continue
            if line == "/reset":
                messages = messages[:1] if args.system else []
                kept = ": the system message is kept)" if args.system else ")"
                print("(conversation reset" + kept, file=sys.stderr)
                continue
            if line.startswith("/") and " " not in line:
                print(f"error: unknown command {line} (/help lists them): not sent", file=sys.stderr)
                continue
            try:
                line.encode("utf-8")  # undecodable input bytes arrive as lone surrogates
            except UnicodeEncodeError as e:
                print(f"error: the message is not valid UTF-8 text (character {e.start}): not sent", file=sys.stderr)
                refused += 1
                continue
        except EOFError:
            break
        except KeyboardInterrupt:
            if not interactive or armed:
                print(file=sys.stderr)
                break
            armed = True
            print("\n(Ctrl-C again, Ctrl-D or /exit to leave)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        parts: dict[str, list[str]] = {"content": [], "reasoning": []}
        if interactive:
            sys.stdout.write("model> ")
        stream = reply(messages)
        try:
            for kind, text in stream:
                parts[kind].append(text)
                sys.stdout.write(text if kind == "content" else f"\x1b[2m{text}\x1b[0m" if interactive else text)
                sys.stdout.flush()
        except UserError as e:  # this message is refused (too long ...): say why, keep chatting
            sys.stdout.write("\n")
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            refused += 1
            continue
        except KeyboardInterrupt:  # stop this reply, keep what it wrote, back to the prompt
            stream.close()
            if not interactive:
                raise
            sys.stdout.write("\n")
            print("(reply stopped)", file=sys.stderr)
        sys.stdout.write("\n")
        msg = {"role": "assistant", "content": "".join(parts["content"])}
        if parts["reasoning"]:
            msg["reasoning_content"] = "".join(parts["reasoning"])
        messages.append(msg)
    return 2 if refused else 0


def add_chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in the terminal with a model (loaded here, or a running server)",
        description="Chat in the terminal with a model loaded in this process, or with a running "
        "server (--url). /help lists the commands; Ctrl-C stops a reply.",
    )
    options.model_options(p, "the shipped model")
    p.add_argument(
        "--url",
        default=None,
        type=argtypes.text,
        help="a running dsv4 serve (or other OpenAI-compatible) server, e.g. http://127.0.0.1:8000",
    )
    p.add_argument("--api-key", default=None, type=argtypes.text, help="with --url: the server's API key")
    p.add_argument(
        "--served-model-name",
        default=None,
        type=argtypes.text,
        help="model id on the server (default: its first model)",
    )
    p.add_argument("--system", default=None, type=argtypes.text, help="a system message")
    p.add_argument("--thinking", action="store_true", help="thinking mode (reasoning shown dimmed)")
    options.add(p, "max_new_tokens", default=256, note="per reply")
    options.add(p, "temperature", default=0.7)
    options.add(p, "seed", note="reply i samples with seed + i; none = a fresh one")
    from .cli import engine_args

    engine_args(p)
    p.set_defaults(func=cmd_chat)
