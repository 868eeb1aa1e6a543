"""The load generator of `dsv4 bench serve` (`dsv4.bench.load`), against a minimal streaming HTTP server.

What makes its numbers the server's: the load processes start from a light module (no torch), and the
clock starts once every one of them is ready; each client's tokens, first-token time and gaps are its
own request's.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from dsv4.bench.load import Result, after_opening_wave, arrivals, drive


class SSEServer:
    """Answers POST /v1/completions with max_tokens streamed chunks of one token each (chunked encoding, as
    uvicorn sends them), then [DONE]."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.requests = 0
        self.temperatures: list[float] = []
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = 0
        while line := (await reader.readline()).strip():
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        self.requests += 1
        self.temperatures.append(body["temperature"])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        def chunk(text: str) -> bytes:
            data = text.encode()
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        for i in range(body["max_tokens"]):
            event = {"choices": [{"index": 0, "text": "x", "logprobs": {"tokens": [str(i)]}}]}
            writer.write(chunk(f"data: {json.dumps(event)}\n\n"))
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.write(chunk("data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()


@pytest.fixture(scope="module")
def server():
    s = SSEServer()
    yield s
    s.loop.call_soon_threadsafe(s.loop.stop)


@pytest.mark.parametrize("procs", [1, 2])
def test_every_request_samples_at_the_temperature_asked(server, procs):
    before = len(server.temperatures)
    results, _ = drive("127.0.0.1", server.port, "m", [([1], 2)] * 3, clients=2, procs=procs, temperature=0.0)
    assert [r.error for r in results] == [None] * 3
    assert server.temperatures[before:] == [0.0] * 3


@pytest.mark.parametrize("procs", [1, 2])
def test_every_request_streams_its_own_tokens_in_work_order(server, procs):
    work = [([1, 2, 3], n) for n in (3, 7, 1, 5, 2, 4)]
    results, wall = drive("127.0.0.1", server.port, "m", work, clients=4, procs=procs)
    assert [r.error for r in results] == [None] * len(work)
    assert [r.tokens for r in results] == [n for _, n in work]
    assert all(r.ttft is not None and r.ttft > 0 for r in results)
    assert [len(r.gaps) for r in results] == [n - 1 for _, n in work]
    assert wall > 0


def test_load_processes_do_not_import_torch():
    """A load process imports dsv4.bench.load only: its start-up is not torch's (seconds on a GPU host)."""
    code = "import sys, dsv4.bench.load; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_refused_request_is_an_error_not_a_hang(server):
    results, _ = drive("127.0.0.1", 1, "m", [([1], 2)], clients=1)  # nothing listens on port 1
    assert results[0].error is not None and results[0].tokens == 0


def test_poisson_arrivals_have_the_asked_rate():
    """The gaps are exponential at the rate: their mean is 1/rate within 5 standard errors (1/rate/sqrt(n)),
    and the same seed draws the same times."""
    n, rate = 20000, 40.0
    t = arrivals(n, rate, seed=3)
    gaps = [b - a for a, b in zip([0.0, *t], t)]
    assert all(g > 0 for g in gaps) and t == arrivals(n, rate, seed=3) and t != arrivals(n, rate, seed=4)
    assert abs(sum(gaps) / n - 1 / rate) < 5 * (1 / rate) / n**0.5


@pytest.mark.parametrize("procs", [1, 2])
def test_no_request_is_sent_before_its_arrival(server, procs):
    work = [([1, 2], 2)] * 8
    at = [0.05 * k for k in range(8)]
    results, wall = drive("127.0.0.1", server.port, "m", work, clients=8, procs=procs, at=at)
    assert [r.error for r in results] == [None] * 8 and [r.tokens for r in results] == [2] * 8
    assert all(r.sent is not None and r.sent >= a for r, a in zip(results, at))
    assert wall >= at[-1]


def test_closed_loop_ceiling_counts_the_seats_left_empty():
    """Equal requests that fill every seat in waves lose nothing; otherwise the ceiling is the tokens over
    steps x seats of a loop whose seats refill at once (worked by hand below)."""
    from dsv4.bench.load import closed_loop_ceiling

    assert closed_loop_ceiling([5] * 8, 4) == 1.0
    assert closed_loop_ceiling([5, 3], 4) == 8 / (5 * 4)  # two of four seats, 5 steps
    # seats: [3, 1] -> step 2 refills the second seat with the third request: [2, 1] -> [1] -> done
    assert closed_loop_ceiling([3, 1, 1], 2) == 5 / (3 * 2)
    with pytest.raises(ValueError):
        closed_loop_ceiling([], 2)


def test_the_opening_wave_is_each_clients_first_request():
    """A closed loop's clients send their first requests together; the requests after that wave are the
    rest, in work order, whatever order the sends came in (and with a send time missing, last)."""
    sent = [0.0, 0.001, 0.4, 0.0005, 0.9, None, 0.3]
    results = [Result(ttft=float(i), sent=t) for i, t in enumerate(sent)]
    assert [r.ttft for r in after_opening_wave(results, 3)] == [2.0, 4.0, 5.0, 6.0]
    assert after_opening_wave(results, 7) == [] and len(after_opening_wave(results, 1)) == 6
    with pytest.raises(ValueError):
        after_opening_wave(results, 0)
