"""`dsv4 serve` as a real process on a loopback port, driven by the real `openai` client (and raw HTTP
for what a client library would refuse to send). The server runs the tiny preset with random weights,
bytes as tokens, in deterministic mode, so a request's text does not depend on the traffic around it."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from subproc import checkout_env

openai = pytest.importorskip("openai")  # a test dependency (pip install -e ".[test]")

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
SERVER_LINES: dict[str, list[str]] = {}
MODEL = "tiny"


def start_server(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `dsv4 serve` (cmd) and wait for its ready line: (the process, its /v1 URL)."""
    env = checkout_env(OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines = None, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready: (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()  # (drained)
    SERVER_LINES[url] = lines
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(request):
    cmd = [
        sys.executable,
        "-m",
        "dsv4",
        "serve",
        "--preset",
        "tiny",
        "--port",
        "0",
        "--api-key",
        KEY,
        "--deterministic",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "2048",
        "--max-batch-tokens",
        "64",
        "--max-body-bytes",
        "200000",
        "--device",
        "cpu",
    ]
    if request.param == "speculative":  # every test again with MTP drafts verified each step
        cmd += ["--speculative", "2"]
    proc, url = start_server(cmd)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def raw(server: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    host, port = server.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(data)
    except json.JSONDecodeError:
        return r.status, data


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = raw(server, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and body["status"] == "ok"


def test_completion_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == 1 + len("def f(x):")  # BOS + bytes
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streaming_equals_non_streaming(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_seeds_logprobs_and_choices(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0)
    a = client.completions.create(**kw, seed=11)
    b = client.completions.create(**kw, seed=11)
    c = client.completions.create(**kw, seed=12, n=3)
    assert a.choices[0].text == b.choices[0].text
    assert len(c.choices) == 3 and sorted(ch.index for ch in c.choices) == [0, 1, 2]
    lp = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=2).choices[0]
    assert len(lp.logprobs.token_logprobs) == 5
    assert all(v <= 0 for v in lp.logprobs.token_logprobs)
    # greedy: the chosen token is the most likely one (alternatives are keyed by text, which several
    # byte-less ids share, so the best listed one may be another id of equal text)
    assert all(v >= max(t.values()) - 1e-6 for t, v in zip(lp.logprobs.top_logprobs, lp.logprobs.token_logprobs))
    ch = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_stop_strings_end_the_text(client):
    # random weights, bytes as tokens: about a quarter of the tokens are bytes, so 64 tokens give text
    base = (
        client.completions.create(
            model=MODEL, prompt="q", max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert len(base) >= 4, repr(base)
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="q", max_tokens=64, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw).choices[0]
            text, reason = r.text, r.finish_reason
        assert text == base[: base.index(stop)] and reason == "stop"


def test_tool_messages_round_trip_through_the_chat_format(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    msgs = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 300  # the tool schema block is in the prompt
    think = client.chat.completions.create(
        model=MODEL, messages=msgs[:1], max_tokens=6, temperature=0, extra_body={"thinking": {"type": "enabled"}}
    )
    # in thinking mode, text before </think> is reasoning, never content
    assert think.choices[0].message.content == "" or "reasoning_content" in think.choices[0].message.model_extra


def test_concurrent_clients_get_their_own_answers(client):
    prompts = [f"prompt number {i} " * (1 + i % 4) for i in range(8)]

    def one(p: str) -> str:
        return client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text

    alone = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


def test_errors_have_the_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="x" * 2100, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=99)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="wrong", max_retries=0).models.list()
    cases = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -3}).encode(), 400),
        (b'{"model": "tiny", "prompt": "x", "top_p": NaN}', 400),
        (json.dumps({"model": MODEL, "prompt": "x" * 300_000}).encode(), 413),
        (json.dumps({"model": MODEL, "prompt": [5, 10**9]}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "echo": True}).encode(), 400),
    ]
    for body, status in cases:
        got, err = raw(server, "POST", "/v1/completions", body)
        assert got == status, (body[:80], got, err)
        assert set(err["error"]) >= {"message", "type", "param", "code"}
    got, err = raw(server, "GET", "/v1/nothing")
    assert got == 404 and "error" in err


def test_a_client_that_leaves_frees_its_sequence(server, client):
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=400, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(
            urllib.request.Request(f"{server.rsplit('/v1', 1)[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        ) as r:
            text = r.read().decode()
        running = float(re.search(r'dsv4_requests_running\{model="tiny"\} (\S+)', text).group(1))
        if running == 0:
            break
        time.sleep(0.2)
    assert running == 0
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices[0].finish_reason


def test_speculation_is_reported_in_metrics(server, client, request):
    client.completions.create(model=MODEL, prompt="def g(y):", max_tokens=16, temperature=0)
    with urllib.request.urlopen(
        urllib.request.Request(f"{server.rsplit('/v1', 1)[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    ) as r:
        text = r.read().decode()
    drafted = re.search(r'dsv4_spec_draft_tokens_total\{model="tiny"\} (\S+)', text)
    if request.node.callspec.params["server"] == "speculative":
        assert drafted is not None and float(drafted.group(1)) > 0
    else:
        assert drafted is None or float(drafted.group(1)) == 0


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(
        urllib.request.Request(f"{url.rsplit('/v1', 1)[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    ) as r:
        return r.read().decode()


def test_a_dspark_checkpoint_serves_speculatively(tmp_path):
    """`dsv4 serve --speculative 2` on a random checkpoint in Flash-0731's DSpark layout answers the openai
    client with plain greedy decoding's text and log-probabilities (computed here by the engine without
    speculation; the server's are float32, hence the tolerance), and /metrics reports the drafts, their
    acceptance and the verify lengths the confidence head chose."""
    from dsv4.checkpoint import load_pretrained, write_random
    from dsv4.engine import Engine, EngineConfig, SamplingParams
    from dsv4.tokenizer import ByteTokenizer

    src = write_random(tmp_path / "tiny-dspark", "tiny", draft="dspark")
    proc, url = start_server(
        [
            sys.executable,
            "-m",
            "dsv4",
            "serve",
            "--model",
            str(src),
            "--port",
            "0",
            "--api-key",
            KEY,
            "--deterministic",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "256",
            "--device",
            "cpu",
            "--speculative",
            "2",
            "--speculative-threshold",
            "0.2",
        ]
    )
    try:
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        got = client.completions.create(
            model="tiny-dspark", prompt="def f(x):", max_tokens=12, temperature=0, logprobs=1
        )
        text = metrics_text(url)
    finally:
        stop_server(proc)
    model = load_pretrained(src)
    tok = ByteTokenizer(model.cfg.bos_token_id, model.cfg.eos_token_id)
    engine = Engine(model, EngineConfig(max_seqs=1, max_model_len=256, deterministic=True), tokenizer=tok)
    engine.add_request("0", tok.encode("def f(x):", bos=True), SamplingParams(max_tokens=12, temperature=0, logprobs=1))
    want, lps = "", []
    while engine.has_work():
        for out in engine.step():
            want, lps = want + out.text, lps + [lp.logprob for lp in out.new_logprobs]
    assert (got.choices[0].text, got.usage.completion_tokens) == (want, len(lps))
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(lps, rel=1e-6)

    def value(name: str) -> float:
        return float(re.search(name + r'\{model="tiny-dspark"\} (\S+)', text).group(1))

    assert value("dsv4_spec_draft_tokens_total") > 0
    assert value("dsv4_spec_verify_length_count") >= value("dsv4_spec_verify_steps_total") > 0
    assert value("dsv4_spec_verify_length_sum") == value("dsv4_spec_draft_tokens_total")


def test_one_log_line_per_request(server, client):
    """The server logs method, path, status, prompt + completion tokens and seconds for each request."""
    r = client.completions.create(
        model=MODEL, prompt="abcd", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    deadline = time.monotonic() + 10
    want = re.compile(r"dsv4 serve( \[\d+\])?: POST /v1/completions 200 5\+3 tokens \d+\.\d\d s")  # [i]: HTTP process i
    while not any(want.search(x) for x in SERVER_LINES[server]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.usage.completion_tokens == 3 and any(want.search(x) for x in SERVER_LINES[server]), SERVER_LINES[server][
        -5:
    ]
    assert not any("GET /health" in x for x in SERVER_LINES[server])  # (at debug level only)


def test_chat_with_a_running_server_prints_the_same_banner(server):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4",
            "chat",
            "--url",
            server.rsplit("/v1", 1)[0],
            "--api-key",
            KEY,
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ],
        input="hello\n/reset\n",
        text=True,
        capture_output=True,
        cwd=ROOT,
        env=checkout_env(),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert f"chatting with {MODEL} at {server}" in res.stderr and "(conversation reset)" in res.stderr


def _ttft_sums(url: str) -> dict[str, float]:
    """The sums and counts of the time to first token and its parts (/metrics)."""
    text = metrics_text(url)
    out = {}
    for name in ("time_to_first_token", "request_transport", "request_queue", "request_prefill"):
        for kind in ("sum", "count"):
            m = re.search(rf'dsv4_{name}_seconds_{kind}\{{model="{MODEL}"\}} (\S+)', text)
            out[f"{name}_{kind}"] = float(m.group(1)) if m else 0.0
    return out


def test_the_time_to_first_token_is_split_into_its_parts(server, client):
    """/metrics splits each request's time to first token into the engine's queue and prefill (per
    sequence) and the rest, the transport: over one-choice requests the three add up to it."""
    before, deadline = _ttft_sums(server), time.monotonic() + 10
    while time.monotonic() < deadline:  # (an earlier test's request may still be counted as it ends)
        time.sleep(0.3)
        now = _ttft_sums(server)
        if now == before:
            break
        before = now
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="parts", max_tokens=3, temperature=0, stream=stream)
        list(r) if stream else r
    deadline = time.monotonic() + 10
    while (after := _ttft_sums(server))["request_transport_count"] < before["request_transport_count"] + 2:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    d = {k: after[k] - before[k] for k in after}
    assert d["time_to_first_token_count"] == d["request_transport_count"] == 2
    assert d["request_queue_count"] == d["request_prefill_count"] == 2
    assert d["request_prefill_sum"] > 0 and d["request_queue_sum"] >= 0 and d["request_transport_sum"] >= 0
    parts = d["request_transport_sum"] + d["request_queue_sum"] + d["request_prefill_sum"]
    # (the transport is the difference, so they agree to the roundings of a few sums of seconds)
    assert abs(d["time_to_first_token_sum"] - parts) <= 1e-9 * (1 + d["time_to_first_token_sum"])
