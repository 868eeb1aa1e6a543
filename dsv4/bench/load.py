"""The load of `dsv4 bench serve`: streaming clients of /v1/completions, from one or more processes.

Each client keeps one request in flight over a raw HTTP/1.1 connection and times every streamed token.
Without a request rate the clients are a closed loop: every client sends at the start, and again as soon as
its answer ends. With one (`arrivals`), request i is sent at its Poisson arrival time (or as soon as a
client is free after it), so the load is a steady stream rather than one burst.
Several load processes start together: each imports this module only (no torch), says it is ready, and
waits for the common start the parent sends once all are ready, so that the wall time measures the
server, not how long a process takes to start.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from dataclasses import dataclass, field

READY_TIMEOUT_S = 120.0


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    sent: float | None = None  # seconds from the start of the load to the request's send


def closed_loop_ceiling(outputs: list[int], clients: int) -> float:
    """The most a closed loop of `clients` over requests of these output lengths (in order) lets any engine
    reach, as a fraction of the raw batched decode rate at batch `clients`: an engine whose every step
    costs the raw decode step, prompts included, and that refills a seat in the step after it empties.
    Each step every running request makes one token, so a request of n tokens holds its seat n steps;
    the seats the last requests leave empty while the longest ones finish are the loss.
    -> tokens / (steps x clients)."""
    if clients < 1 or not outputs:
        raise ValueError("a closed loop needs at least one client and one request")
    queue, running, steps = deque(outputs), [], 0
    while queue or running:
        while queue and len(running) < clients:
            running.append(queue.popleft())
        steps += 1
        running = [n - 1 for n in running if n > 1]
    return sum(outputs) / (steps * clients)


def after_opening_wave(results: list[Result], clients: int) -> list[Result]:
    """The requests of a closed loop after its opening wave: all but the `clients` sent first (every client's
    first request, sent together at the start: a burst the load makes, which later arrivals, spread by the
    requests' own lengths, do not repeat)."""
    if clients < 1:
        raise ValueError("a closed loop needs at least one client")
    order = sorted(range(len(results)), key=lambda i: (results[i].sent is None, results[i].sent or 0.0, i))
    later = set(order[clients:])
    return [r for i, r in enumerate(results) if i in later]


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n Poisson arrival times at `rate` requests/s (seconds from the start; exponential gaps)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def _stream(host: str, port: int, body: dict) -> Result:
    """POST /v1/completions with stream=true over a raw connection; time each streamed token."""
    res = Result()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    try:
        status = (await reader.readline()).decode()
        chunked = False
        while True:
            line = (await reader.readline()).decode().strip().lower()
            if not line:
                break
            chunked |= line.startswith("transfer-encoding:") and "chunked" in line
        if " 200 " not in status:
            res.error = status.strip() + " " + (await reader.read()).decode()[:200]
            return res
        buf, last = "", None
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                piece = (await reader.readexactly(size + 2))[:-2].decode()
            else:
                piece = (await reader.read(65536)).decode()
                if not piece:
                    break
            buf += piece
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                if not event.startswith("data: ") or event == "data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                n = sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in chunk.get("choices", []))
                if n:
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    elif last is not None:
                        res.gaps.extend([(now - last) / n] * n)
                    last = now
                    res.tokens += n
    finally:
        writer.close()
    return res


async def _drive(
    host: str,
    port: int,
    model: str,
    work: list[tuple[int, tuple[list[int], int]]],
    clients: int,
    at: dict[int, float] | None = None,
    temperature: float = 1.0,
) -> tuple[list[Result], float]:
    """`clients` clients over the numbered work items, item i not before at[i] seconds when given.
    -> (results in work order, wall seconds)."""
    queue = list(work)
    results: dict[int, Result] = {}
    t0 = time.perf_counter()

    async def client() -> None:
        while queue:
            i, (prompt, n) = queue.pop(0)
            if at is not None:
                await asyncio.sleep(max(0.0, t0 + at[i] - time.perf_counter()))
            sent = time.perf_counter() - t0
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": n,
                "temperature": temperature,
                "seed": i,
                "ignore_eos": True,
                "logprobs": 0,
                "stream": True,
            }
            try:
                results[i] = await _stream(host, port, body)
            except Exception as e:  # noqa: BLE001 - counted
                results[i] = Result(error=f"{type(e).__name__}: {e}")
            results[i].sent = sent

    await asyncio.gather(*(client() for _ in range(min(clients, len(work)))))
    return [results[i] for i, _ in work], time.perf_counter() - t0


def _share(
    conn, host: str, port: int, model: str, work, clients: int, at: dict[int, float] | None, temperature: float
) -> None:
    """One load process: say ready, wait for the common start, drive its share, send back (results, start,
    end) in wall-clock seconds."""
    conn.send("ready")
    start_at = conn.recv()
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    results, _ = asyncio.run(_drive(host, port, model, work, clients, at, temperature))
    conn.send((results, began, time.time()))


def drive(
    host: str,
    port: int,
    model: str,
    work: list[tuple[list[int], int]],
    clients: int,
    procs: int = 1,
    at: list[float] | None = None,
    temperature: float = 1.0,
) -> tuple[list[Result], float]:
    """The load, from `procs` processes (one Python process parses at most some ten thousand streamed events
    a second: at high rates the load generator, not the server, would be measured); work item i not sent
    before at[i] seconds from the start (`arrivals`) when given. -> (results in work order, wall seconds from
    the common start to the last response). Every request samples at `temperature` (0: greedy) with its own
    seed and asks for its tokens' log-probabilities (the stream's token count)."""
    numbered = list(enumerate(work))
    times = dict(enumerate(at)) if at is not None else None
    procs = max(1, min(procs, clients))
    if procs == 1:
        return asyncio.run(_drive(host, port, model, numbered, clients, times, temperature))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    shares = [numbered[k::procs] for k in range(procs)]
    per = [clients // procs + (k < clients % procs) for k in range(procs)]
    conns, workers = [], []
    try:
        for k in range(procs):
            mine, theirs = ctx.Pipe()
            args = (theirs, host, port, model, shares[k], per[k], times, temperature)
            p = ctx.Process(target=_share, args=args, daemon=True)
            p.start()
            theirs.close()
            conns.append(mine)
            workers.append(p)
        for k, conn in enumerate(conns):
            try:
                if not conn.poll(READY_TIMEOUT_S):
                    raise RuntimeError(f"load process {k} was not ready in {READY_TIMEOUT_S:.0f} s")
                conn.recv()
            except EOFError:
                raise RuntimeError(
                    f"load process {k} exited (code {workers[k].exitcode}) before it was ready"
                ) from None
        start_at = time.time() + 0.05
        for conn in conns:
            conn.send(start_at)
        parts = []
        for k, (conn, p) in enumerate(zip(conns, workers)):
            try:
                while not conn.poll(1.0):
                    if not p.is_alive():
                        raise EOFError
                parts.append(conn.recv())
            except EOFError:
                raise RuntimeError(f"load process {k} exited (code {p.exitcode}) before its results") from None
    finally:
        for p in workers:
            p.join(5)
            if p.is_alive():
                p.terminate()
    by_index = {i: r for share, (res, _, _) in zip(shares, parts) for (i, _), r in zip(share, res)}
    return [by_index[i] for i in range(len(work))], max(end for _, _, end in parts) - start_at
