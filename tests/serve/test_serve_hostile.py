"""A server that one client cannot hurt: a real `dsv4 serve` process of the shipped model, with small limits,
against clients that send huge inputs, requests it can never hold, many sequences, slow or half requests,
thousands of connections, and signals. Each case states the property it checks; the real `openai`
client is used where a client library would send the request, raw sockets where it would not.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from subproc import checkout_env

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512
LIMITS = [
    "--max-messages",
    "50",
    "--max-prompt-chars",
    "300000",
    "--max-seqs-per-request",
    "8",
    "--header-timeout",
    "1.5",
    "--body-timeout",
    "2",
    "--max-connections",
    "64",
]


class Server:
    """A `dsv4 serve` process: its address, pid and every line it printed (collected in the background)."""

    def __init__(self, args: list[str], rlimit_nofile: int | None = None, startup_s: float = 240):
        def limits() -> None:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if rlimit_nofile is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (rlimit_nofile, rlimit_nofile))

        cmd = [sys.executable, "-m", "dsv4", "serve", "--port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=checkout_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=limits,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + startup_s
        self.host = self.port = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"ready: http://([\d.]+):(\d+)/v1", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                break
        if self.port is None:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines))
        self._drain = threading.Thread(target=lambda: [self.lines.append(x) for x in self.proc.stdout], daemon=True)
        self._drain.start()
        self.url = f"http://{self.host}:{self.port}/v1"
        self.pid = self.proc.pid

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def request(self, method: str, path: str, body: dict | bytes | None = None, timeout: float = 120):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode("utf-8", "replace")

    def metric(self, name: str) -> float:
        _, text = self.request("GET", "/metrics")
        m = re.search(rf'{name}\{{model="[^"]+"\}} (\S+)', text)
        return float(m.group(1)) if m else 0.0

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


@pytest.fixture(scope="module")
def srv():
    s = Server(
        [
            "--max-model-len",
            str(CONTEXT),
            "--max-num-seqs",
            "8",
            "--max-batch-tokens",
            "128",
            "--cache-pages",
            "2",
            *LIMITS,
        ]
    )
    yield s
    s.stop()


def _model(s: Server) -> str:
    return s.request("GET", "/v1/models")[1]["data"][0]["id"]


def _cache_limit(s: Server) -> int:
    m = re.search(r"at most (\d+) positions per sequence", s.output())
    assert m, s.output()
    return int(m.group(1))


# ------------------------------------------------------------------------------------------ admission
def test_requests_the_cache_can_never_hold_are_refused_at_admission(srv):
    """--cache-pages 2 holds fewer positions per sequence than the context: a request past it is a 400 that
    states the limit (not a 500 mid-generation), one exactly at it runs to its last token, and /metrics
    shows nothing running or held afterwards."""
    limit, model = _cache_limit(srv), _model(srv)
    assert limit < CONTEXT
    client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
    prompt = "def f(x):"
    n_prompt = client.completions.create(model=model, prompt=prompt, max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=limit - n_prompt + 1)
    err = info.value.body
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"at most {limit} per sequence" in err["message"] and "--cache-pages" in err["message"]
    assert f"at most {limit - n_prompt} new tokens fit" in err["message"]
    done = client.completions.create(
        model=model, prompt=prompt, max_tokens=limit - n_prompt, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == limit - n_prompt and done.choices[0].finish_reason == "length"
    assert srv.metric("dsv4_requests_running") == 0 and srv.metric("dsv4_cache_usage_ratio") == 0
    status, body = srv.request(
        "POST",
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": limit},
    )
    assert status == 400 and body["error"]["param"] == "max_tokens" and "--cache-pages" in body["error"]["message"]


def test_text_prompts_are_healed_and_token_id_prompts_are_not(srv):
    """Token healing on /v1/completions with the shipped tokenizer: a prompt ending in a newline goes on
    with an indented line; the re-spelled newline is the first logprobs token (text_offset -1) and not in
    the text; usage counts the healed prompt (one token fewer than with `token_healing: false`); a stream
    heals as well; the same prompt given as token ids runs as given."""
    from dsv4.loading import default_model_dir
    from dsv4.tokenizer import Tokenizer

    gcd = 'def gcd(a, b):\n    """Greatest common divisor by Euclid\'s algorithm."""\n'
    client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
    kw = dict(model=_model(srv), max_tokens=6, temperature=0)
    on = client.completions.create(prompt=gcd, logprobs=1, **kw)
    text = on.choices[0].text
    assert text.split("\n")[0].startswith("    ") and text.strip(), text
    lp = on.choices[0].logprobs
    assert "".join(lp.tokens).startswith("\n" + text) and lp.text_offset[0] == -1
    off = client.completions.create(prompt=gcd, extra_body={"token_healing": False}, **kw)
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=gcd, stream=True, **kw))
    assert streamed.split("\n")[0].startswith("    ") and streamed.strip(), streamed
    ids = Tokenizer.from_file(default_model_dir()).encode(gcd, bos=True)
    assert client.completions.create(prompt=ids, **kw).usage.prompt_tokens == len(ids) == off.usage.prompt_tokens


@pytest.mark.parametrize("prompt", ["def fo", "x = sel"])
def test_a_healed_streams_logprobs_are_the_whole_answers(srv, prompt):
    """Half a word healed: the first tokens re-spell the removed end in pieces (some carry no visible text
    of their own). The streamed chunks' logprobs, joined, are the unstreamed answer's, and the offsets run
    over the tokens' texts from minus the removed length."""
    client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
    kw = dict(model=_model(srv), prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = {k: [v for lp in chunks if lp for v in getattr(lp, k)] for k in ("tokens", "text_offset")}
    assert streamed == {"tokens": whole.tokens, "text_offset": whole.text_offset}
    removed = whole.text_offset[0]
    assert removed < 0 and "".join(whole.tokens)[:-removed] == prompt[removed:]
    assert all(b - a == len(t) for a, b, t in zip(whole.text_offset, whole.text_offset[1:], whole.tokens))


def test_prompts_times_n_is_capped_and_every_400_names_its_param(srv):
    model = _model(srv)
    cases = [  # body, param, words the message must hold
        ({"prompt": ["x"] * 300, "n": 17, "max_tokens": 1}, "n", "[1, 16]"),  # n past the server's 16
        ({"prompt": ["x"] * 300, "n": 16, "max_tokens": 1}, "prompt", "4800 sequences"),
        ({"prompt": ["x"] * 300, "n": 1, "max_tokens": 1}, "prompt", "--max-seqs-per-request"),
        ({"prompt": "x", "n": 9, "max_tokens": 1}, "n", "--max-seqs-per-request"),
        ({"prompt": "x", "top_k": 2**63, "max_tokens": 1}, "top_k", "[-1, "),
        ({"prompt": "x", "top_k": 10**6, "max_tokens": 1}, "top_k", "[-1, "),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
        ({"prompt": "x", "n": True}, "n", "integer"),
        ({"prompt": "x", "temperature": 2.5}, "temperature", "[0, 2]"),
        ({"prompt": "x", "temperature": "1"}, "temperature", "number"),
        ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "x", "presence_penalty": 2.01}, "presence_penalty", "[-2, 2]"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"prompt": "x", "seed": 2**70}, "seed", None),
        ({"prompt": "x", "stream": 1}, "stream", None),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
        ({"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids", None),
        ({"prompt": [[1, 2], [2**40]]}, "prompt", "vocabulary"),
        ({"prompt": "x" * 300_001}, "prompt", "--max-prompt-chars"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens", "context"),
    ]
    for body, param, words in cases:
        status, reply = srv.request("POST", "/v1/completions", {"model": model, **body})
        assert status == 400, (body, status, reply)
        err = reply["error"]
        assert err["param"] == param, (str(body)[:80], err)
        assert words is None or words in err["message"], (str(body)[:80], err)
    msg = {"role": "user", "content": "hi"}
    for body, param, words in [
        ({"messages": [msg] * 51}, "messages", "--max-messages"),
        ({"messages": [msg], "top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"messages": [msg], "max_completion_tokens": 0}, "max_completion_tokens", None),
        ({"messages": [{"role": "user", "content": "y" * 300_001}]}, "messages", "--max-prompt-chars"),
    ]:
        status, reply = srv.request("POST", "/v1/chat/completions", {"model": model, **body})
        assert status == 400 and reply["error"]["param"] == param, (param, reply)
        assert words is None or words in reply["error"]["message"], reply


# ------------------------------------------------------------------------------------------ the event loop
def _health_gaps(s: Server, stop: threading.Event, gaps: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        s.request("GET", "/health", timeout=60)
        gaps.append(time.monotonic() - t0)
        time.sleep(0.02)


@pytest.mark.parametrize("kind", ["long prompt", "many messages", "huge body"])
def test_large_inputs_do_not_stall_the_event_loop(srv, kind):
    """While a large input is parsed, tokenized or encoded (in a worker thread), /health keeps answering:
    its slowest answer is far below the time the large request took."""
    model = _model(srv)
    if kind == "long prompt":  # under --max-prompt-chars: tokenized, then past the context
        body = {"model": model, "prompt": "def f(x):\n    return x\n" * 12_000, "max_tokens": 1}
        path, want = "/v1/completions", "context"
    elif kind == "many messages":  # 10,000 messages: refused by count
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}] * 10_000}
        path, want = "/v1/chat/completions", "--max-messages"
    else:  # 8 MB of text in a body under the 8 MiB limit
        body = {"model": model, "prompt": "z" * 8_000_000}
        path, want = "/v1/completions", "--max-prompt-chars"
    stop, gaps = threading.Event(), []
    poller = threading.Thread(target=_health_gaps, args=(srv, stop, gaps))
    poller.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    status, reply = srv.request("POST", path, json.dumps(body).encode())
    took = time.monotonic() - t0
    stop.set()
    poller.join()
    assert status == 400 and want in reply["error"]["message"], reply
    assert len(gaps) >= 3 and max(gaps) < max(0.5, took / 2), (max(gaps), took)


# ------------------------------------------------------------------------------------------ slow clients
def _ended_by_server(s: socket.socket) -> bool:
    """Whether the server has ended this connection: its reply (if any) is followed by EOF or a reset,
    within 3 s (a connection the server still holds open times out instead)."""
    s.settimeout(3)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def test_slow_and_half_sent_requests_are_timed_out_and_cost_no_descriptors(srv):
    """300 connections that never finish their headers and 20 that stall mid-body: the server answers
    408 and closes them after --header-timeout / --body-timeout (or, past --max-connections, closes the
    oldest silent ones at once), its descriptors return to where they were, and normal requests are
    answered meanwhile. A client that disconnects mid-body leaves no traceback in the log."""
    model = _model(srv)
    before = srv.open_fds()
    body = []
    for _ in range(20):
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 5000\r\n\r\n{"model": '
        )
        body.append(s)
    time.sleep(0.5)  # (these 20 hold connections before the 300 come)
    socks = []
    for i in range(300):
        try:
            s = socket.create_connection((srv.host, srv.port), timeout=10)
        except OSError:
            continue
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
        socks.append(s)
    time.sleep(2.5)  # past both timeouts
    heads = [s.recv(4096) for s in body]
    assert all(h.startswith(b"HTTP/1.1 408") and b"request body did not arrive" in h for h in heads), heads[:2]
    assert all(_ended_by_server(s) for s in body)
    assert sum(_ended_by_server(s) for s in socks) == len(socks)
    status, _ = srv.request("POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2})
    assert status == 200
    # 30 clients that leave mid-body
    for _ in range(30):
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{"model": "')
        s.close()
    time.sleep(1.0)
    assert srv.request("GET", "/health")[0] == 200
    deadline = time.monotonic() + 10
    while srv.open_fds() > before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.open_fds() <= before + 4
    out = srv.output()
    assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]
    assert out.count("--max-connections") <= 3 and out.count("--header-timeout") <= 3  # rate-limited lines


def test_a_low_descriptor_limit_is_not_a_log_flood(tmp_path):
    """Under `ulimit -n 128`, 300 connections that send nothing: the server keeps descriptors for itself
    (its connection limit fits under the limit, said on its first line), writes a handful of log lines
    instead of one per failed accept, and a normal request is answered meanwhile (the oldest silent
    connection makes room for it)."""
    s = Server(
        ["--preset", "tiny", "--max-model-len", "256", "--max-num-seqs", "2", "--header-timeout", "30"],
        rlimit_nofile=128,
    )
    try:
        m = re.search(r"up to (\d+) connections", s.output())
        assert m and int(m.group(1)) < 128 - 14, s.output()
        socks = []
        for _ in range(300):
            try:
                socks.append(socket.create_connection((s.host, s.port), timeout=5))
            except OSError:
                pass
        time.sleep(1.0)
        status, _ = s.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 200
        for x in socks:
            x.close()
        assert s.open_fds() < 128
        assert len(s.lines) < 12, s.output()[-2000:]
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------ disconnects
def test_batched_prompts_of_a_client_that_leaves_are_all_aborted(srv):
    """8 prompts in one non-streaming request; the client leaves once they run: every sequence stops (far
    fewer tokens generated than asked), none keeps running."""
    model = _model(srv)
    before = srv.metric("dsv4_generation_tokens_total")
    body = json.dumps(
        {
            "model": model,
            "prompt": [f"def f{i}(x):" for i in range(8)],
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    s = socket.create_connection((srv.host, srv.port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    deadline = time.monotonic() + 60
    while srv.metric("dsv4_generation_tokens_total") - before < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metric("dsv4_requests_running") >= 1
    s.close()
    deadline = time.monotonic() + 30
    while srv.metric("dsv4_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.metric("dsv4_requests_running") == 0
    assert srv.metric("dsv4_generation_tokens_total") - before < 8 * 200 / 2


# ------------------------------------------------------------------------------------------ signals
def test_sigterm_drains_then_ends_every_request_properly():
    """SIGTERM: a short request in flight completes normally; new connections are refused; a long stream
    and a long non-streaming request run until the grace period (2 s) is over, then the stream gets a
    final chunk with finish_reason 'abort' and [DONE], the other a 200 with what it has; the process exits 0
    with a line saying so, and no traceback."""
    s = Server(["--preset", "tiny", "--max-model-len", "4096", "--max-num-seqs", "4", "--shutdown-grace", "2"])
    client = openai.OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=120)
    results: dict[str, object] = {}

    def stream() -> None:
        chunks = list(
            client.completions.create(
                model="tiny", prompt="a", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
            )
        )
        results["stream"] = chunks

    def whole() -> None:
        results["whole"] = client.completions.create(
            model="tiny", prompt="b", max_tokens=4000, extra_body={"ignore_eos": True}
        )

    def short() -> None:
        results["short"] = client.completions.create(model="tiny", prompt="c", max_tokens=3)

    try:
        threads = [threading.Thread(target=f) for f in (stream, whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while s.metric("dsv4_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        late = threading.Thread(target=short)
        late.start()
        while s.metric("dsv4_requests_running") < 3 and "short" not in results and time.monotonic() < deadline:
            time.sleep(0.01)
        t_term = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):  # no longer accepting
            socket.create_connection((s.host, s.port), timeout=5)
        for t in [*threads, late]:
            t.join(60)
        rc = s.proc.wait(30)
        assert rc == 0 and time.monotonic() - t_term < 2 + 10
        chunks = results["stream"]
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert results["whole"].choices[0].finish_reason == "abort"
        assert 0 < results["whole"].usage.completion_tokens < 4000
        assert results["short"].choices[0].finish_reason in ("length", "stop")
        s._drain.join(10)
        out = s.output()
        assert "SIGTERM: shutting down" in out and "grace of 2 s is over" in out and "dsv4 serve: stopped" in out
        assert "Traceback" not in out, out[-3000:]
    finally:
        s.stop()


def test_accept_errors_are_one_line_per_interval(caplog):
    """asyncio reports every failed accept of a full descriptor table (one per queued connection, each
    time it retries): through the server's loop handler they are one line per 10 s with a count."""
    import asyncio
    import errno
    import logging

    from dsv4.serve import http_guard

    loop = asyncio.new_event_loop()
    try:
        http_guard._TROUBLE._last.clear()
        with caplog.at_level(logging.WARNING, logger="dsv4.serve"):
            for _ in range(2000):
                http_guard._loop_exception_handler(
                    loop,
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                    },
                )
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "Too many open files" in lines[0] and "ulimit -n" in lines[0]
        http_guard._TROUBLE._last["accept"] -= 11  # 11 s later: the next line counts the rest
        with caplog.at_level(logging.WARNING, logger="dsv4.serve"):
            http_guard._loop_exception_handler(
                loop,
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                },
            )
        assert "(1999 more like it in the last 10 s)" in caplog.records[-1].getMessage()
    finally:
        loop.close()
