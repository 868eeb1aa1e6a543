"""The HTTP application in this process over a fake engine: no model, no subprocess, no socket.

`create_app` is driven by starlette's TestClient (an httpx client whose transport calls the ASGI app). The
fake engine implements what the app calls on `dsv4.engine.client.EngineClient` (`generate`, `alive`) and,
like `EngineProcess`, hands every step's outputs with an engine metrics dict to `ServerMetrics.on_step`.
Its tokens are letters computed from the prompt, so every expected text, usage number and counter below
is derived from what the fake produced for the request, never written in by hand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field

import pytest
from starlette.testclient import TestClient

from dsv4.engine.sampling import SamplingParams
from dsv4.engine.sequence import RequestError, StepOutput, TokenLogprob
from dsv4.serve import chat
from dsv4.serve.app import ServerState, create_app
from dsv4.serve.metrics import ServerMetrics
from dsv4.tokenizer import ByteTokenizer

KEY = "sk-app-test"
NAME = "fake-model"
PER_OUTPUT = 2  # tokens per output of one choice (the last one may have fewer)


@dataclass
class Sent:
    """One engine request as the fake saw it, and every output it yielded for it."""

    prompt: list[int]
    params: SamplingParams
    n: int
    outputs: list[StepOutput] = field(default_factory=list)


class FakeEngine:
    """`EngineClient` without a model. Choice i of a request emits `plan(prompt, i, max_tokens)`, PER_OUTPUT
    tokens per output, the choices of a step in turn; choice i ends i tokens early ("stop"), so the choices
    of n > 1 differ in length; len(prompt) // 4 prompt tokens count as cached."""

    def __init__(self, tokenizer: ByteTokenizer, on_step=None):
        self.tokenizer, self.on_step = tokenizer, on_step
        self.alive = True
        self.info: dict = {}
        self.sent: dict[str, Sent] = {}
        self.refuse: str | None = None  # refuse every request with this (the engine's RequestError)
        self.fail_after: int | None = None  # raise after yielding this many outputs of a request
        self.after_first = None  # called once a request's first output was taken
        self.totals = {
            "running": 0,
            "waiting": 0,
            "cache_usage": 0.0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "prefix_hit_tokens": 0,
            "graph_steps": 0,
            "eager_steps": 0,
            "burst_steps": 0,
        }

    @staticmethod
    def plan(prompt: list[int], i: int, max_tokens: int) -> list[int]:
        return [ord("a") + (sum(prompt) + 7 * i + k) % 26 for k in range(max(1, max_tokens - i))]

    @staticmethod
    def cached(prompt: list[int]) -> int:
        return len(prompt) // 4

    @staticmethod
    def logprob(k: int) -> float:
        return -0.25 * (k + 1)  # token k of a choice

    def _output(self, rid: str, sent: Sent, i: int, plan: list[int], start: int) -> StepOutput:
        new = plan[start : start + PER_OUTPUT]
        done = start + len(new)
        finished = done == len(plan)
        reason = ("length" if len(plan) == sent.params.max_tokens else "stop") if finished else None
        lps = []
        if sent.params.logprobs is not None:
            lps = [
                TokenLogprob(
                    t, self.logprob(start + j), [(t, self.logprob(start + j)), (t + 1, -9.0)][: sent.params.logprobs]
                )
                for j, t in enumerate(new)
            ]
        return StepOutput(
            rid,
            i,
            new,
            lps,
            finished,
            reason,
            len(sent.prompt),
            done,
            self.cached(sent.prompt),
            text=self.tokenizer.decode(new),
        )

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, n: int = 1):
        if self.refuse is not None:
            raise RequestError(self.refuse)
        sent = self.sent[request_id] = Sent(list(prompt), params, n)
        plans = [self.plan(prompt, i, params.max_tokens) for i in range(n)]
        done = [0] * n
        self.totals["prompt_tokens"] += len(prompt) - self.cached(prompt)
        self.totals["prefix_hit_tokens"] += self.cached(prompt)
        while any(d < len(p) for d, p in zip(done, plans)):
            step = [self._output(request_id, sent, i, p, done[i]) for i, p in enumerate(plans) if done[i] < len(p)]
            for out in step:
                done[out.index] += len(out.new_tokens)
            self.totals["generated_tokens"] += sum(len(o.new_tokens) for o in step)
            if self.on_step is not None:
                self.on_step(dict(self.totals), step, 0.001)
            for out in step:
                if self.fail_after is not None and len(sent.outputs) >= self.fail_after:
                    raise RuntimeError("the device fell off the bus")
                sent.outputs.append(out)
                yield out
                if len(sent.outputs) == 1 and self.after_first is not None:
                    self.after_first()
                await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self, timeout: float = 10.0) -> None:
        self.alive = False


@dataclass
class Served:
    client: TestClient
    engine: FakeEngine
    state: ServerState
    tokenizer: ByteTokenizer

    def post(self, path: str, body: dict | bytes, **kw):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.client.post(path, content=raw, headers={"Content-Type": "application/json"}, **kw)

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value of every sample /metrics shows."""
        r = self.client.get("/metrics")
        assert r.status_code == 200
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", r.text, re.M)}


def build(api_key: str | None = KEY, max_body_bytes: int = 1 << 16, **client_kw):
    tokenizer = ByteTokenizer(0, 1)
    metrics = ServerMetrics(NAME)
    engine = FakeEngine(tokenizer, on_step=metrics.on_step)
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=NAME,
        max_model_len=512,
        api_key=api_key,
        metrics=metrics,
        max_body_bytes=max_body_bytes,
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return Served(TestClient(create_app(state), headers=headers, **client_kw), engine, state, tokenizer)


@pytest.fixture
def srv():
    s = build()
    with s.client:
        yield s
    s.state.executor.shutdown(wait=True)


# ------------------------------------------------------------------------------------------ helpers
def events(text: str) -> list:
    """The server-sent events of a stream: parsed chunks, then the closing "[DONE]"."""
    parts = text.split("\n\n")
    assert parts[-1] == "" and all(p.startswith("data: ") for p in parts[:-1]), text[:300]
    return [p[6:] if p == "data: [DONE]" else json.loads(p[6:]) for p in parts[:-1]]


def engine_requests(s: Served, rid: str, prompts: int) -> list[Sent]:
    """The engine requests an HTTP request of `prompts` prompts made (ids: its own, or its own + "-i")."""
    return [s.engine.sent[rid]] if prompts == 1 else [s.engine.sent[f"{rid}-{i}"] for i in range(prompts)]


def choice_plans(sents: list[Sent]) -> list[list[int]]:
    """Every choice's tokens in the order of the answer's indices (prompt-major, then n)."""
    return [FakeEngine.plan(s.prompt, i, s.params.max_tokens) for s in sents for i in range(s.n)]


def expected_usage(sents: list[Sent]) -> dict:
    prompt = sum(len(s.prompt) for s in sents)  # each prompt once, whatever n
    completion = sum(len(p) for p in choice_plans(sents))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(FakeEngine.cached(s.prompt) for s in sents)},
    }


def finish_reason(plan: list[int], max_tokens: int) -> str:
    return "length" if len(plan) == max_tokens else "stop"


# ------------------------------------------------------------------------------------------ completions
def test_completion_text_usage_and_shape(srv):
    r = srv.post("/v1/completions", {"model": NAME, "prompt": "hello there", "max_tokens": 5})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["model"] == NAME and body["id"].startswith("cmpl-")
    (sent,) = engine_requests(srv, body["id"], 1)
    assert sent.prompt == srv.tokenizer.encode("hello there", bos=True)  # BOS + the prompt's bytes
    (plan,) = choice_plans([sent])
    assert body["choices"] == [
        {"index": 0, "text": srv.tokenizer.decode(plan), "logprobs": None, "finish_reason": finish_reason(plan, 5)}
    ]
    assert body["usage"] == expected_usage([sent])


def test_completion_n_and_batched_prompts_count_each_prompt_once(srv):
    r = srv.post("/v1/completions", {"model": NAME, "prompt": ["ab", "wxyz"], "n": 3, "max_tokens": 4})
    body = r.json()
    sents = engine_requests(srv, body["id"], 2)
    plans = choice_plans(sents)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [srv.tokenizer.decode(p) for p in plans]
    assert [c["finish_reason"] for c in body["choices"]] == [finish_reason(p, 4) for p in plans]
    assert len({len(p) for p in plans}) > 1  # the choices differ, so the sum is a real check
    assert body["usage"] == expected_usage(sents)


@pytest.mark.parametrize("include_usage", [True, False])
def test_completion_stream_says_what_the_whole_answer_says(srv, include_usage):
    req = {"model": NAME, "prompt": ["one", "three"], "n": 2, "max_tokens": 5}
    full = srv.post("/v1/completions", req).json()
    r = srv.post("/v1/completions", {**req, "stream": True, "stream_options": {"include_usage": include_usage}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"text_completion"}
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            assert reasons.get(ch["index"]) is None  # nothing after a choice's finish
            text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
            reasons[ch["index"]] = ch["finish_reason"]
    assert text == {c["index"]: c["text"] for c in full["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in full["choices"]}
    usage = [c for c in chunks if "usage" in c]
    if include_usage:
        assert usage == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == expected_usage(engine_requests(srv, chunks[0]["id"], 2)) == full["usage"]
    else:
        assert usage == []


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_engines(srv, stream):
    r = srv.post("/v1/completions", {"model": NAME, "prompt": "lp", "max_tokens": 5, "logprobs": 1, "stream": stream})
    if stream:
        chunks = events(r.text)[:-1]
        rid = chunks[0]["id"]
        lps = [c["choices"][0]["logprobs"] for c in chunks]
        got = {
            k: [v for lp in lps if lp for v in lp[k]]
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
    else:
        rid, got = r.json()["id"], r.json()["choices"][0]["logprobs"]
    (sent,) = engine_requests(srv, rid, 1)
    lps = [lp for o in sent.outputs for lp in o.new_logprobs]
    assert len(lps) == len(choice_plans([sent])[0])
    texts = [srv.tokenizer.decode([lp.token]) for lp in lps]
    assert got["tokens"] == texts
    assert got["token_logprobs"] == [lp.logprob for lp in lps]
    assert got["top_logprobs"] == [{srv.tokenizer.decode([t]): v for t, v in lp.top} for lp in lps]
    assert got["text_offset"] == [sum(len(t) for t in texts[:k]) for k in range(len(texts))]


# ------------------------------------------------------------------------------------------ chat
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_chat_message_usage_and_shape(srv):
    r = srv.post(
        "/v1/chat/completions",
        {"model": NAME, "messages": MESSAGES, "n": 2, "max_tokens": 6, "logprobs": True, "top_logprobs": 2},
    )
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (sent,) = engine_requests(srv, body["id"], 1)
    assert sent.prompt == srv.tokenizer.encode(chat.encode_chat(MESSAGES), bos=False)
    plans = choice_plans([sent])
    for i, (c, plan) in enumerate(zip(body["choices"], plans, strict=True)):
        assert c["index"] == i and c["finish_reason"] == finish_reason(plan, 6)
        assert c["message"] == {"role": "assistant", "content": srv.tokenizer.decode(plan)}
        content = c["logprobs"]["content"]
        assert [t["token"] for t in content] == [chr(t) for t in plan]
        assert [t["logprob"] for t in content] == [FakeEngine.logprob(k) for k in range(len(plan))]
        assert all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode()) for t in content)
    assert body["usage"] == expected_usage([sent])


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_says_what_the_whole_answer_says(srv, include_usage):
    req = {"model": NAME, "messages": MESSAGES, "n": 3, "max_tokens": 5, "logprobs": True}
    full = srv.post("/v1/chat/completions", req).json()
    r = srv.post("/v1/chat/completions", {**req, "stream": True, "stream_options": {"include_usage": include_usage}})
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
    content: dict[int, str] = {}
    reasons: dict[int, str] = {}
    lps: dict[int, list] = {}
    for c in chunks:
        for ch in c["choices"]:
            content[ch["index"]] = content.get(ch["index"], "") + ch["delta"].get("content", "")
            lps.setdefault(ch["index"], []).extend((ch["logprobs"] or {"content": []})["content"])
            if ch["finish_reason"]:
                reasons[ch["index"]] = ch["finish_reason"]
    assert content == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert reasons == {c["index"]: c["finish_reason"] for c in full["choices"]}
    assert lps == {c["index"]: c["logprobs"]["content"] for c in full["choices"]}
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
        assert full["usage"] == expected_usage(engine_requests(srv, chunks[0]["id"], 1))
    else:
        assert all("usage" not in c for c in chunks)


def test_the_openai_client_reads_the_answers():
    openai = pytest.importorskip("openai")
    s = build()
    with s.client:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=s.client, max_retries=0)
        full = client.completions.create(model=NAME, prompt="abc", max_tokens=4, n=2)
        sents = engine_requests(s, full.id, 1)
        assert [c.text for c in full.choices] == [s.tokenizer.decode(p) for p in choice_plans(sents)]
        assert full.usage.model_dump(exclude_none=True) == expected_usage(sents)
        chunks = list(
            client.chat.completions.create(
                model=NAME, messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
            )
        )
        (plan,) = choice_plans(engine_requests(s, chunks[0].id, 1))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == s.tokenizer.decode(plan)
        assert chunks[-1].usage.completion_tokens == len(plan)
        assert [m.id for m in client.models.list().data] == [NAME]
        assert client.models.retrieve(NAME).id == NAME
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
    s.state.executor.shutdown(wait=True)


# ------------------------------------------------------------------------------------------ the end of a request
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_requests_ended_by_the_shutdown_finish_with_abort_and_count_what_they_got(srv, path, stream):
    srv.engine.after_first = srv.state.end_in_flight  # the grace period ends after one output
    body = {"model": NAME, "n": 2, "max_tokens": 8, "stream": stream}
    body.update({"stream_options": {"include_usage": True}} if stream else {})
    body.update({"prompt": "grace"} if path == "/v1/completions" else {"messages": MESSAGES})
    r = srv.post(path, body)
    assert r.status_code == 200
    if stream:
        chunks = events(r.text)[:-1]
        rid, usage = chunks[0]["id"], chunks[-1]["usage"]
        reasons = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    else:
        rid, usage = r.json()["id"], r.json()["usage"]
        reasons = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
    (sent,) = engine_requests(srv, rid, 1)
    first = sent.outputs[0]  # the one output the request took
    assert reasons == {0: "abort", 1: "abort"}
    assert srv.metrics()[f'dsv4_requests_finished_total{{model="{NAME}",reason="abort"}}'] == 2
    assert usage == {
        "prompt_tokens": len(sent.prompt),
        "completion_tokens": len(first.new_tokens),
        "total_tokens": len(sent.prompt) + len(first.new_tokens),
        "prompt_tokens_details": {"cached_tokens": FakeEngine.cached(sent.prompt)},
    }


def test_draining_refuses_new_requests_and_health_says_so(srv):
    srv.state.begin_drain()
    r = srv.post("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert srv.client.get("/health").json() == {"status": "draining"}
    srv.engine.alive = False
    h = srv.client.get("/health")
    assert h.status_code == 503 and h.json() == {"status": "dead"}


# ------------------------------------------------------------------------------------------ errors
def test_a_chat_is_answered_only_where_the_format_opens_a_reply(srv):
    """After a system message or a finished assistant turn the V4 format opens no reply (the model would
    start a new document): a 400 naming the way out. A last assistant message with DeepSeek's `prefix:
    true` is continued - its `wo_eos` rendering - and the answer is its content even in thinking mode (the
    prompt has closed the reasoning)."""
    user, done = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"}
    for messages in ([{"role": "system", "content": "be brief"}], [user, done]):
        e = error_of(srv.post("/v1/chat/completions", {"model": NAME, "messages": messages}), 400)
        assert e["param"] == "messages" and "opens no reply" in e["message"], e
    for bad, says in [
        ([user, {**done, "prefix": "yes"}], "messages[1].prefix: must be true or false"),
        ([{**user, "prefix": True}], "messages[0].prefix: only the last message"),
        ([{**done, "prefix": True}, user], "messages[0].prefix: only the last message"),
    ]:
        e = error_of(srv.post("/v1/chat/completions", {"model": NAME, "messages": bad}), 400)
        assert e["param"] == "messages" and e["message"].startswith(says), e
    assert srv.engine.sent == {}
    for thinking in (False, True):
        body = {"model": NAME, "messages": [user, {**done, "prefix": True}], "max_tokens": 6, "thinking": thinking}
        r = srv.post("/v1/chat/completions", body)
        (sent,) = engine_requests(srv, r.json()["id"], 1)
        continued = chat.encode_chat([user, {**done, "wo_eos": True}], thinking=thinking)
        assert continued.endswith(chat.THINK_END + "Hi")
        assert sent.prompt == srv.tokenizer.encode(continued, bos=False)
        (plan,) = choice_plans([sent])
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": srv.tokenizer.decode(plan)}


def test_chat_format_errors_name_the_field_they_are_about(srv):
    good = {"model": NAME, "messages": MESSAGES}
    for extra, param in [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{}], "tool_choice": "none"}, "tools"),  # tools left out of the prompt are checked too
        ({"reasoning_effort": "ultra"}, "reasoning_effort"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ]:
        e = error_of(srv.post("/v1/chat/completions", {**good, **extra}), 400)
        assert e["param"] == param and e["message"].startswith(param), (extra, e)
    assert srv.engine.sent == {}


def error_of(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_bodies_get_400_in_openai_shape(srv, path):
    good = {"model": NAME, "prompt": "x"} if path == "/v1/completions" else {"model": NAME, "messages": MESSAGES}
    for body, param in [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({k: v for k, v in good.items() if k != "model"}, "model"),
        ({**good, "max_tokens": "many"}, "max_tokens"),
        ({**good, "temperature": -1}, "temperature"),
        ({**good, "n": 0}, "n"),
    ]:
        e = error_of(srv.post(path, body), 400)
        assert e["type"] == "invalid_request_error" and e["param"] == param, (body, e)
    e = error_of(srv.post(path, {**good, "model": "nope"}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model" and "nope" in e["message"]
    assert srv.engine.sent == {}  # none of them reached the engine


def test_too_large_bodies_and_unknown_paths(srv):
    small = build(max_body_bytes=64)
    with small.client:
        e = error_of(small.post("/v1/completions", {"model": NAME, "prompt": "x" * 100}), 413)
        assert e["code"] == "request_too_large" and "64 bytes" in e["message"]
    small.state.executor.shutdown(wait=True)
    assert error_of(srv.client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert error_of(srv.client.get("/v1/completions"), 405)["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,param", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_an_engine_refusal_is_a_400_naming_the_prompt(srv, path, param):
    srv.engine.refuse = "the prompt needs 900 cache positions; the cache holds 512"
    body = {"model": NAME, "prompt": "x"} if param == "prompt" else {"model": NAME, "messages": MESSAGES}
    e = error_of(srv.post(path, body), 400)
    assert e == {
        "message": srv.engine.refuse,
        "type": "invalid_request_error",
        "param": param,
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_engine_failure_mid_request(path):
    s = build(raise_server_exceptions=False)
    with s.client:
        s.engine.fail_after = 1
        body = {"model": NAME, "max_tokens": 6}
        body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})
        e = error_of(s.post(path, body), 500)
        assert e["type"] == "server_error" and "fell off the bus" in e["message"]
        evs = events(s.post(path, {**body, "stream": True}).text)
        assert evs[-1] == "[DONE]" and evs[-2]["error"]["type"] == "server_error"
        assert "fell off the bus" in evs[-2]["error"]["message"]
    s.state.executor.shutdown(wait=True)


def test_the_api_key_guards_every_endpoint_but_health():
    s = build()
    bare = TestClient(s.client.app)  # no Authorization header
    with s.client, bare:
        for client, headers in [
            (bare, {}),
            (s.client, {"Authorization": "Bearer wrong"}),
            (s.client, {"Authorization": KEY}),
        ]:
            for method, path in [
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
            ]:
                e = error_of(client.request(method, path, headers=headers), 401)
                assert e["code"] == "invalid_api_key"
        assert bare.get("/health").json() == {"status": "ok"}
        assert s.client.get("/v1/models").status_code == 200
    s.state.executor.shutdown(wait=True)
    open_ = build(api_key=None)
    with open_.client:
        assert open_.client.get("/v1/models").status_code == 200
        assert open_.post("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1}).status_code == 200
    open_.state.executor.shutdown(wait=True)


# ------------------------------------------------------------------------------------------ the rest
def test_models_and_health(srv):
    body = srv.client.get("/v1/models").json()
    assert body == {
        "object": "list",
        "data": [
            {
                "id": NAME,
                "object": "model",
                "created": srv.state.created,
                "owned_by": "dsv4",
                "max_model_len": srv.state.max_model_len,
            }
        ],
    }
    assert srv.client.get("/health").json() == {"status": "ok"}
    assert srv.client.head("/health").status_code == 200
    assert srv.client.get(f"/v1/models/{NAME}").json() == body["data"][0]
    e = error_of(srv.client.get("/v1/models/org/other"), 404)
    assert e["code"] == "model_not_found" and "org/other" in e["message"]


def test_stream_options_need_a_stream(srv):
    for path, good in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        body = {"model": NAME, **good, "stream_options": {"include_usage": True}}
        e = error_of(srv.post(path, body), 400)
        assert e["param"] == "stream_options" and "stream: true" in e["message"]
        assert error_of(srv.post(path, {**body, "stream": False}), 400)["param"] == "stream_options"
    assert srv.engine.sent == {}


def test_metrics_count_the_requests_and_their_tokens(srv):
    m = f'{{model="{NAME}"}}'
    before = srv.metrics()
    assert before.get(f"dsv4_request_latency_seconds_count{m}", 0.0) == 0.0
    srv.engine.totals["burst_steps"] = 3  # (the engine's count since it started; the counter follows it)
    ids = [
        srv.post("/v1/completions", {"model": NAME, "prompt": "metrics", "n": 2, "max_tokens": 5}).json()["id"],
        events(
            srv.post(
                "/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": 3, "stream": True}
            ).text
        )[0]["id"],
    ]
    sents = [srv.engine.sent[rid] for rid in ids]
    after = srv.metrics()
    assert after[f"dsv4_request_latency_seconds_count{m}"] == len(ids)
    assert after[f"dsv4_time_to_first_token_seconds_count{m}"] == len(ids)
    # a gap between every two outputs with tokens of the same HTTP request
    assert after[f"dsv4_inter_token_latency_seconds_count{m}"] == sum(len(s.outputs) - 1 for s in sents)
    plans = choice_plans(sents)
    assert after[f"dsv4_generation_tokens_total{m}"] == sum(len(p) for p in plans)
    assert after[f"dsv4_prompt_tokens_total{m}"] == sum(len(s.prompt) - FakeEngine.cached(s.prompt) for s in sents)
    assert after[f"dsv4_prefix_cache_hit_tokens_total{m}"] == sum(FakeEngine.cached(s.prompt) for s in sents)
    assert after[f"dsv4_engine_burst_steps_total{m}"] == 3
    for reason in ("length", "stop"):
        want = sum(
            finish_reason(FakeEngine.plan(s.prompt, i, s.params.max_tokens), s.params.max_tokens) == reason
            for s in sents
            for i in range(s.n)
        )
        assert after.get(f'dsv4_requests_finished_total{{model="{NAME}",reason="{reason}"}}', 0.0) == want


def test_one_log_line_per_request_with_its_tokens(srv, caplog):
    with caplog.at_level(logging.DEBUG, logger="dsv4.serve"):
        rid = srv.post("/v1/completions", {"model": NAME, "prompt": "log me", "max_tokens": 4}).json()["id"]
        srv.client.get("/health")
        srv.post("/v1/completions", b"{bad")
    (sent,) = engine_requests(srv, rid, 1)
    usage = expected_usage([sent])
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "dsv4.serve"]
    assert len(lines) == 3
    assert lines[0][0] == logging.INFO and re.fullmatch(
        rf"POST /v1/completions 200 {usage['prompt_tokens']}\+{usage['completion_tokens']} tokens \d+\.\d\d s",
        lines[0][1],
    )
    assert lines[1][0] == logging.DEBUG and lines[1][1].startswith("GET /health 200 ")
    assert lines[2][0] == logging.INFO and re.fullmatch(r"POST /v1/completions 400 \d+\.\d\d s", lines[2][1])


def test_the_warm_up_runs_every_kind_of_request_and_counts_in_no_request_metric(caplog):
    """`warm_up` (what each HTTP process runs before it says ready): completions and chat, streamed and
    whole, through the application (the API key included); the engine sees them (marked "warmup-"), the
    request metrics and the request log do not, and the next request is counted as the first."""
    from dsv4.serve.warmup import warm_up

    s = build()
    with s.client, caplog.at_level(logging.INFO, logger="dsv4.serve"):
        seconds = asyncio.run(warm_up(s.client.app, NAME, KEY))
        assert seconds >= 0 and len(s.engine.sent) == 4
        assert all(rid.startswith(("warmup-cmpl-", "warmup-chatcmpl-")) for rid in s.engine.sent)
        assert all(sent.outputs and sent.params.max_tokens == 1 for sent in s.engine.sent.values())
        m = s.metrics()
        assert not any(
            k.startswith(("dsv4_requests_finished_total", "dsv4_time_to_first_token_seconds_count")) for k in m
        )
        assert m['dsv4_generation_tokens_total{model="fake-model"}'] == 4  # the engine's own count has them
        assert not [r for r in caplog.records if "POST" in r.getMessage()]
        r = s.post("/v1/completions", {"model": NAME, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and not r.json()["id"].startswith("warmup-")
        m = s.metrics()
        assert sum(v for k, v in m.items() if k.startswith("dsv4_requests_finished_total")) == 1
        assert m['dsv4_time_to_first_token_seconds_count{model="fake-model"}'] == 1
    s.state.executor.shutdown(wait=True)
