"""Several HTTP processes over one engine (`dsv4 serve --api-servers N`): the engine routes each request's
outputs to the process it came from, the processes share one port and one set of metrics, a shutdown
reaches them all, and one that dies takes the server down instead of leaving its clients hanging."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from subproc import checkout_env

from dsv4.engine.client import Abort, AddRequest, Outputs, Stop
from dsv4.engine.engine_process import _serve
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.sequence import StepOutput
from dsv4.errors import UserError
from dsv4.serve.api_servers import default_count, listen

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ the engine loop
class FakeEngine:
    """Each step: one token for every request, which finishes after `length` tokens."""

    def __init__(self, length: int = 3):
        self.length = length
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []

    def add_request(self, rid, prompt, params, n):
        self.requests[rid] = 0

    def abort(self, rid):
        self.aborted.append(rid)
        self.requests.pop(rid, None)

    def abort_sequence(self, rid, index):
        self.abort(rid)

    def has_work(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= self.length
            outs.append(StepOutput(rid, 0, [7], [], done, "length" if done else None, 1, self.requests[rid]))
            if done:
                del self.requests[rid]
        return outs

    def metrics(self):
        return {"running": len(self.requests)}


def _links(n: int):
    """n links: (the engine's ends, the HTTP processes' ends)."""
    engine_ends, server_ends = [], []
    for _ in range(n):
        cmd_recv, cmd_send = mp.Pipe(duplex=False)
        res_recv, res_send = mp.Pipe(duplex=False)
        engine_ends.append((cmd_recv, res_send))
        server_ends.append((cmd_send, res_recv))
    return engine_ends, server_ends


def _drain(conn, until: float = 0.3) -> list[Outputs]:
    got = []
    while conn.poll(until):
        got.append(conn.recv())
    return got


def test_each_request_s_outputs_go_back_through_its_own_link():
    engine = FakeEngine(length=3)
    engine_ends, (first, second) = _links(2)
    loop = threading.Thread(target=_serve, args=(engine, engine_ends), daemon=True)
    loop.start()
    first[0].send(AddRequest("a", [1], SamplingParams()))
    second[0].send(AddRequest("b", [1], SamplingParams()))
    got_first, got_second = _drain(first[1]), _drain(second[1])
    tokens = {
        name: [(o[0], o[7]) for msg in got for o in msg.outputs] for name, got in (("1", got_first), ("2", got_second))
    }
    assert tokens == {"1": [("a", 1), ("a", 2), ("a", 3)], "2": [("b", 1), ("b", 2), ("b", 3)]}
    # the first link hears of every step (the engine's metrics), the others only of their own requests
    assert all(isinstance(m, Outputs) and "running" in m.metrics for m in got_first + got_second)
    assert len(got_first) >= len(got_second) == 3
    first[0].send(Stop())
    loop.join(5)
    assert not loop.is_alive()


def test_a_link_that_closes_has_its_requests_aborted_and_the_first_one_ends_the_loop():
    engine = FakeEngine(length=10**9)
    engine_ends, (first, second) = _links(2)
    loop = threading.Thread(target=_serve, args=(engine, engine_ends), daemon=True)
    loop.start()
    first[0].send(AddRequest("mine", [1], SamplingParams()))
    second[0].send(AddRequest("theirs", [1], SamplingParams()))
    second[0].send(AddRequest("theirs too", [1], SamplingParams()))
    deadline = time.monotonic() + 5
    while len(engine.requests) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for conn in second:  # that HTTP process is gone
        conn.close()
    while len(engine.aborted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(engine.aborted) == ["theirs", "theirs too"] and list(engine.requests) == ["mine"]
    assert loop.is_alive()
    first[0].send(Abort("mine"))
    while engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.requests
    first[0].close()  # the first link's end: the server that started the engine is gone
    loop.join(5)
    assert not loop.is_alive()


# ------------------------------------------------------------------------------------------ sockets
def test_default_count_and_listening_sockets():
    assert default_count("cpu", 64) == 1
    assert default_count("cuda", 16) == 8 and default_count("cuda", 6) == 3 and default_count("cuda:1", 128) == 8
    assert default_count("cuda", 1) == 1
    socks = listen("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(socks) == 3 and len(ports) == 1
        port = ports.pop()
        # a second server on that port is refused, with or without a group of its own
        for n in (1, 2):
            with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port}"):
                listen("127.0.0.1", port, n)
    finally:
        for s in socks:
            s.close()
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    try:
        with pytest.raises(UserError, match="cannot listen"):
            listen("127.0.0.1", plain.getsockname()[1], 2)
    finally:
        plain.close()


# ------------------------------------------------------------------------------------------ a real server
class Server:
    def __init__(self, *args: str, tmp: Path):
        cmd = [sys.executable, "-m", "dsv4", "serve", "--preset", "tiny", "--device", "cpu", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            # (torch makes its compile cache in the temporary directory when it loads, unless told where:
            # elsewhere, so that `tmp` holds only what the server makes)
            env=checkout_env(OMP_NUM_THREADS="1", TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=f"{tmp}-inductor"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: list[str] = []
        self.url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"ready: (http://\S+)/v1", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines))
        self._reader = threading.Thread(
            target=lambda: [self.lines.append(x.decode()) for x in self.proc.stdout], daemon=True
        )
        self._reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def complete(self, prompt: str, stream: bool = False, max_tokens: int = 6) -> dict:
        """One request on a connection of its own (each lands on the port's group anew)."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": 0}
        if stream:
            body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
        if not stream:
            return json.loads(raw)
        chunks = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
        return {"text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), "usage": chunks[-1]["usage"]}

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + "{"))

    def children(self) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _mapped_files(pid: int) -> set[str] | None:
    """The files a process has mapped (Linux /proc), or None where that cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return None
    return {line.split()[-1] for line in lines if len(line.split()) >= 6}


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_two_http_processes_share_the_port_the_metrics_and_the_shutdown(tmp_path):
    s = Server("--api-servers", "2", "--deterministic", "--max-num-seqs", "8", tmp=tmp_path)
    try:
        assert "2 HTTP processes" in s.output()
        n = 48
        generated = s.metric("dsv4_generation_tokens_total")  # (the warm-up's tokens count there)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: s.complete(f"say {i % 4}", stream=bool(i % 2)), range(n)))
        # the same prompt gives the same text through either process, streamed or not
        texts: dict[int, set[str]] = {}
        for i, r in enumerate(results):
            texts.setdefault(i % 4, set()).add(r["text"] if i % 2 else r["choices"][0]["text"])
        assert all(len(v) == 1 for v in texts.values()), texts
        # both processes answered (48 connections hashed over 2 sockets: all on one has odds 2^-47)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            "dsv4 serve [1]: POST" in s.output() and "dsv4 serve: POST" in s.output()
        ):
            time.sleep(0.1)
        out = s.output()
        assert "dsv4 serve [1]: POST /v1/completions 200" in out and "dsv4 serve: POST /v1/completions 200" in out
        # /metrics, whichever process answers, counts every request once
        for _ in range(6):
            assert s.metric("dsv4_time_to_first_token_seconds_count") == n
            assert s.metric("dsv4_requests_finished_total") == n
            assert s.metric("dsv4_generation_tokens_total") - generated == sum(
                r["usage"]["completion_tokens"] for r in results
            )
        assert [p.name.startswith("dsv4-metrics-") for p in tmp_path.iterdir()] == [True]
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        s._reader.join(10)
        out = s.output()
        assert out.count("SIGTERM: shutting down") == 2 and "dsv4 serve: stopped" in out, out[-2000:]
        assert "Traceback" not in out, out[-3000:]
        assert not list(tmp_path.iterdir())  # the metrics files are gone with the server
    finally:
        s.stop()


def test_an_http_process_that_dies_takes_the_server_down(tmp_path):
    s = Server("--api-servers", "2", tmp=tmp_path)
    try:
        assert s.complete("hello")["choices"][0]["text"] is not None
        children = s.children()
        others = [p for p in children if _process_group(p) == p]  # the other HTTP process leads its group
        assert len(others) == 1
        # it never loaded torch (the engine process, the other child, did: the probe can see it)
        maps = {p: _mapped_files(p) for p in children}
        if all(m is not None for m in maps.values()):
            assert not any("libtorch" in f for f in maps[others[0]]), "the HTTP process loaded torch"
            assert any("libtorch" in f for p in children if p != others[0] for f in maps[p])
        os.kill(others[0], signal.SIGKILL)
        assert s.proc.wait(60) == 1
        s._reader.join(10)
        assert re.search(r"HTTP process 1 exited \(code -9\): shutting down", s.output()), s.output()[-2000:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_process_group(p) is not None for p in children):
            time.sleep(0.2)
        assert all(_process_group(p) is None for p in children)  # the engine process ended too
        assert not list(tmp_path.iterdir())
    finally:
        s.stop()
