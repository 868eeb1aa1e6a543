"""The HTTP server's own ceiling: `dsv4 serve`'s HTTP processes and engine pipes, with a model-free engine.

    python3 scripts/bench_http_ceiling.py --clients 256 --step-ms 9 --requests 1024 [--repeats 3] [--api-servers N]

A synthetic engine (in the engine process, as `dsv4 serve` runs its engine) emits one token per running
sequence every --step-ms milliseconds; the HTTP processes are the real ones (`run_http`: the application,
the engine link, detokenization, server-sent events, uvicorn with dsv4's guarded HTTP protocol; with
--api-servers N, N of them on one port as `dsv4 serve --api-servers N` runs them); the load is `dsv4 bench
serve`'s (`dsv4.bench.load`). Reported per run: streamed tokens/s against the engine's ceiling (clients x
1000 / step-ms), the time to first token, and the HTTP processes' CPU time per streamed token, which is
what limits a server whose engine is fast: at 1 s of CPU per second a process, not the model, sets the
rate. Needs fastapi and uvicorn (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4.bench.load import drive  # noqa: E402
from dsv4.engine.sequence import StepOutput, TokenLogprob  # noqa: E402


class SyntheticEngine:
    """What the engine process's loop uses of an engine: every step, one token for every running sequence,
    at a fixed pace; a sequence ends at its max_tokens."""

    def __init__(self, step_s: float, max_seqs: int):
        self.step_s, self.max_seqs = step_s, max_seqs
        self.requests: dict[str, list[int]] = {}  # id -> [prompt tokens, max tokens, generated]
        self.waiting: list[tuple[str, int, int]] = []
        self.next_at = time.monotonic()
        self.steps = 0

    def add_request(self, request_id, prompt, params, n=1):
        self.waiting.append((request_id, len(prompt), params.max_tokens))

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def abort_sequence(self, request_id, index):
        self.requests.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.requests or self.waiting)

    def step(self) -> list[StepOutput]:
        while self.waiting and len(self.requests) < self.max_seqs:
            rid, prompt, max_tokens = self.waiting.pop(0)
            self.requests[rid] = [prompt, max_tokens, 0]
        self.next_at = max(self.next_at + self.step_s, time.monotonic())
        time.sleep(max(0.0, self.next_at - time.monotonic()))
        outputs = []
        for rid, seq in list(self.requests.items()):
            seq[2] += 1
            tok = 97 + seq[2] % 26
            done = seq[2] >= seq[1]
            lp = [TokenLogprob(tok, -1.0, [])]
            outputs.append(StepOutput(rid, 0, [tok], lp, done, "length" if done else None, seq[0], seq[2]))
            if done:
                del self.requests[rid]
        self.steps += 1
        return outputs

    def metrics(self) -> dict:
        return {"running": len(self.requests), "waiting": len(self.waiting), "cache_usage": 0.0, "steps": self.steps}

    def close(self) -> None:
        pass


def _build(step_s: float, max_seqs: int):
    info = {"desc": "synthetic", "device": "cpu", "max_model_len": 4096, "max_seqs": max_seqs, "cache_mib": 0.0}
    info |= {"vocab_size": 256 + 2, "max_n": 1, "max_sequence_tokens": 4096, "threads": 1, "graphs": 0}
    return SyntheticEngine(step_s, max_seqs), info | {"warmup_s": 0.0}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of this process (getrusage, nanosecond-based) and of the other
    processes in `pids` (their live threads' on-CPU nanoseconds from /proc/<pid>/task/*/schedstat; clock ticks
    from /proc/<pid>/stat, 10 ms each, where schedstat is absent). Ticks alone read 0 for a short run."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    total = ru.ru_utime + ru.ru_stime
    for pid in pids:
        if pid != os.getpid():
            total += _other_cpu_seconds(pid)
    return total


def _other_cpu_seconds(pid: int) -> float:
    tasks = Path(f"/proc/{pid}/task")
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat's 14, 15)


def _server(conn, step_s: float, max_seqs: int, api_servers: int) -> None:
    """The server: the real HTTP processes (`dsv4 serve`'s run_http, --api-servers of them) over the
    synthetic engine; answers "cpu" with their CPU time together."""
    import argparse
    import threading

    from dsv4.serve.api_servers import APIServers, listen, shared_metrics
    from dsv4.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--preset", "tiny", "--served-model-name", "synthetic", "--api-servers", str(api_servers)]
        + ["--log-level", "warning", "--max-connections", str(4096 * api_servers)]
    )
    socks = listen("127.0.0.1", 0, api_servers)
    with shared_metrics(api_servers):
        from dsv4.engine.engine_process import EngineProcess
        from dsv4.serve.http_process import run_http
        from dsv4.serve.metrics import ServerMetrics
        from dsv4.tokenizer import ByteTokenizer

        tok = ByteTokenizer(0, 1)
        metrics = ServerMetrics("synthetic")
        engine = EngineProcess(_build, (step_s, max_seqs), tokenizer=tok, on_step=metrics.on_step, links=api_servers)
        info = engine.start()
        others = APIServers(args, info, engine, socks[1:], tok) if api_servers > 1 else None
        if others is not None:
            others.wait_ready()
        ready = threading.Event()
        threading.Thread(
            target=run_http,
            args=(args, engine, tok, "synthetic", metrics, info, socks[0]),
            kwargs={"on_started": ready.set, "others": others},
            daemon=True,
        ).start()
        ready.wait(120)
        pids = [os.getpid()] + ([p.pid for p in others.procs] if others is not None else [])
        conn.send(socks[0].getsockname()[1])
        while conn.recv() == "cpu":
            conn.send(_cpu_seconds(pids))
        if others is not None:
            others.drain()
            others.stop(10)
        engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, help="per run (default: 4 x clients)")
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine's step time")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load-procs", type=int, help="load processes (default: one per 32 clients)")
    p.add_argument("--api-servers", type=int, default=1, help="HTTP processes (dsv4 serve --api-servers)")
    args = p.parse_args()
    requests = args.requests or 4 * args.clients
    procs = args.load_procs or max(1, -(-args.clients // 32))
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    server = ctx.Process(target=_server, args=(theirs, args.step_ms / 1e3, args.clients, args.api_servers))
    server.start()
    if not mine.poll(120):
        print("the server did not start", file=sys.stderr)
        server.terminate()
        return 1
    port = mine.recv()
    work = [([98] * args.prompt_len, args.output_len)] * requests
    drive("127.0.0.1", port, "synthetic", work[: args.clients], args.clients, procs)  # warm-up
    runs = []
    for _ in range(args.repeats):
        mine.send("cpu")
        c0 = mine.recv()
        results, wall = drive("127.0.0.1", port, "synthetic", work, args.clients, procs)
        mine.send("cpu")
        cpu = mine.recv() - c0
        tokens = sum(r.tokens for r in results)
        ttft = sorted(r.ttft for r in results if r.ttft is not None)
        errors = sum(r.error is not None for r in results)
        runs.append(
            {
                "tokens": tokens,
                "tokens_per_s": tokens / wall,
                "server_cpu_us_per_token": cpu / max(tokens, 1) * 1e6,
                "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3 if ttft else None,
                "errors": errors,
            }
        )
    mine.send("stop")
    server.join(15)
    ceiling = args.clients * 1000 / args.step_ms

    def spread(key: str) -> str:
        v = [r[key] for r in runs if r[key] is not None]
        return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "-"

    print(
        f"{args.clients} clients, step {args.step_ms} ms (ceiling {ceiling:.0f} tokens/s), {requests} requests x "
        f"{args.output_len} tokens, {args.api_servers} HTTP process(es), median (min-max) of {len(runs)}:"
    )
    print(f"  streamed tokens/s         {spread('tokens_per_s')}")
    print(f"  server CPU per token, us  {spread('server_cpu_us_per_token')} (its HTTP processes together)")
    print(f"  time to first token, ms   {spread('ttft_p50_ms')} (p50)")
    print(f"  errors                    {sum(r['errors'] for r in runs)}")
    print(json.dumps({"args": vars(args), "ceiling": ceiling, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
