"""`dsv4 bench serve`: a load generator against a real `dsv4 serve` HTTP server, in one process.

The server (the same app, engine thread and uvicorn as `dsv4 serve`) listens on a loopback port; N
concurrent clients send streaming /v1/completions requests (prompts of random token ids, lengths drawn
from a fixed distribution with a fixed seed, a fixed number of requests, `ignore_eos` so every request
produces its drawn length). Reported, all from the same run:
- throughput: output tokens / wall time of the load;
- time to first token (p50, p99) under load, against the same on an idle server;
- inter-token latency (p50, p99): gaps between a request's streamed tokens;
- the raw batched decode rate: `model.decode_step` on a lockstep cache of `clients` sequences (replayed
  from a CUDA graph on CUDA, as `dsv4 bench decode`), and the server's throughput as a fraction of it;
- with --hf, Hugging Face transformers' `generate` on the same prompts (greedy, same lengths) at the batch
  sizes given, and dsv4's throughput as a multiple of the best of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import UserError


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def _stream(host: str, port: int, body: dict) -> Result:
    """POST /v1/completions with stream=true over a raw connection; time each streamed token."""
    res = Result()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
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


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def _drive(host: str, port: int, model: str, work: list[tuple[list[int], int]], clients: int) -> tuple:
    queue = list(enumerate(work))
    results: list[Result] = [Result() for _ in work]

    async def client() -> None:
        while queue:
            i, (prompt, n) = queue.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 1.0, "seed": i,
                    "ignore_eos": True, "logprobs": 0, "stream": True}
            try:
                results[i] = await _stream(host, port, body)
            except Exception as e:                                               # noqa: BLE001 - counted
                results[i] = Result(error=f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


def _raw_decode_rate(model, batch: int, prompt_len: int, steps: int, device: torch.device) -> dict:
    """Tokens/s of model.decode_step on a lockstep cache of `batch` sequences (a CUDA graph on CUDA)."""
    from ..engine.graphs import GraphedDecoder

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, model.cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    with torch.no_grad():
        cache = model.new_cache(batch, prompt_len + 2 * steps + 8)
        nxt = model.prefill(prompt, cache)[:, -1].argmax(-1, keepdim=True)
        step = GraphedDecoder(model, cache).step if device.type == "cuda" else (
            lambda t: model.decode_step(t, cache))
        for _ in range(3):
            nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = step(nxt)[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
    return {"batch": batch, "steps": steps, "tokens_per_s": batch * steps / sec, "ms_per_step": sec / steps * 1e3}


def _hf_rate(model, prompts: list[list[int]], new_tokens: int, batches: list[int], device) -> dict:
    """Hugging Face transformers' generate on the same weights and prompts (greedy, fixed lengths)."""
    from ..check.hf import build_hf_model

    hf = build_hf_model(model).to(device).eval()
    out = {}
    for b in batches:
        rows = [p for p in prompts for _ in range(max(1, b // len(prompts) + 1))][:b]
        width = max(len(p) for p in rows)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        with torch.no_grad():
            kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            hf.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False)   # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            sec = time.perf_counter() - t0
        out[str(b)] = {"tokens_per_s": b * new_tokens / sec, "s": sec}
    return out


def run_serve_bench(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from ..serve.app import ServerState, create_app
    from ..serve.cli import _engine, _load

    for name in ("clients", "requests", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.spread < 1:
        raise UserError("--spread must be in [0, 1)")
    args.max_num_seqs = args.max_num_seqs or args.clients
    model, tokenizer, name, desc = _load(args)
    device = model.embed.weight.device
    rng = random.Random(args.seed)

    def draw(mean: int) -> int:
        return max(1, round(mean * (1 + args.spread * (2 * rng.random() - 1))))

    work = []
    for _ in range(args.requests):
        n = draw(args.prompt_len)
        work.append(([rng.randrange(2, model.cfg.vocab_size) for _ in range(n)], draw(args.output_len)))
    longest = max(len(p) + n for p, n in work)
    if args.max_model_len is None:
        args.max_model_len = min(model.cfg.max_seq_len, max(longest + 1, 256))
    result: dict = {"model": desc, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "clients": args.clients,
                    "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                    "spread": args.spread, "dtype": args.dtype}
    if not args.no_raw:
        result["raw_decode"] = _raw_decode_rate(model, args.clients, args.prompt_len, max(16, args.output_len), device)
    engine = _engine(args, model, tokenizer)
    engine.warmup()
    aengine = AsyncEngine(engine)
    state = ServerState(engine=aengine, tokenizer=tokenizer, model_name=name, max_model_len=engine.max_model_len)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="error"))
    aengine.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        # warm-up (graphs, kernels) and the idle time to first token
        idle = []
        for i in range(3):
            r = asyncio.run(_drive("127.0.0.1", port, name, [work[i % len(work)]], 1))[0][0]
            if r.error:
                raise UserError(f"the server refused a warm-up request: {r.error}")
            idle.append(r.ttft)
        results, wall = asyncio.run(_drive("127.0.0.1", port, name, work, args.clients))
    finally:
        server.should_exit = True
        thread.join(10)
        aengine.shutdown()
    errors = [r.error for r in results if r.error]
    ttft = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    out_tokens = sum(r.tokens for r in results)
    result.update({
        "errors": len(errors), "first_errors": errors[:3], "wall_s": wall, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall, "ttft_idle_s": statistics.median(idle),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99), "engine": engine.metrics()})
    if result["ttft_p50_s"] and result["ttft_idle_s"]:
        result["ttft_load_over_idle"] = result["ttft_p50_s"] / result["ttft_idle_s"]
    if "raw_decode" in result:
        result["fraction_of_raw_decode"] = result["output_tokens_per_s"] / result["raw_decode"]["tokens_per_s"]
    if args.hf:
        same = [p for p, _ in work[:args.clients]]
        result["hf_generate"] = _hf_rate(model, same, args.output_len, args.hf, device)
        best = max(v["tokens_per_s"] for v in result["hf_generate"].values())
        result["speedup_over_hf"] = result["output_tokens_per_s"] / best
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 1 if errors else 0


def _print(r: dict) -> None:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    print(f"{r['device']}  torch {r['torch']}  {r['date']}  {r['model']}  {r['dtype']}")
    print(f"  load: {r['clients']} streaming clients, {r['requests']} requests, prompt ~{r['prompt_len']}, output "
          f"~{r['output_len']} (+-{r['spread']:.0%})")
    print(f"  throughput      {r['output_tokens_per_s']:10.1f} output tokens/s  ({r['output_tokens']} tokens in "
          f"{r['wall_s']:.1f} s, {r['errors']} errors)")
    print(f"  TTFT            p50 {ms(r['ttft_p50_s'])}  p99 {ms(r['ttft_p99_s'])}  (idle {ms(r['ttft_idle_s'])}"
          + (f", {r['ttft_load_over_idle']:.1f}x" if "ttft_load_over_idle" in r else "") + ")")
    print(f"  inter-token     p50 {ms(r['itl_p50_s'])}  p99 {ms(r['itl_p99_s'])}")
    if "raw_decode" in r:
        raw = r["raw_decode"]
        print(f"  raw decode      {raw['tokens_per_s']:10.1f} tokens/s at batch {raw['batch']} "
              f"({raw['ms_per_step']:.2f} ms/step): the server reaches {r['fraction_of_raw_decode']:.0%} of it")
    if "hf_generate" in r:
        for b, v in r["hf_generate"].items():
            print(f"  transformers generate, batch {b}: {v['tokens_per_s']:.1f} tokens/s")
        print(f"  dsv4 serve / best transformers: {r['speedup_over_hf']:.1f}x")
    for e in r["first_errors"]:
        print(f"  error: {e}")


def add_bench_serve_parser(subparsers) -> None:
    from ..cli import add_model_args
    from ..serve.cli import _engine_args

    p = subparsers.add_parser("serve", help="load-test a dsv4 serve HTTP server: throughput, TTFT, inter-token "
                                            "latency, against the raw batched decode rate (and transformers)")
    add_model_args(p, "the shipped model")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (default 16)")
    p.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="mean output tokens (default 64)")
    p.add_argument("--spread", type=float, default=0.25, help="lengths uniform in mean*(1 +- spread) (default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-raw", action="store_true", help="skip the raw batched decode measurement")
    p.add_argument("--hf", type=int, nargs="*", default=None, metavar="BATCH",
                   help="also time transformers' generate at these batch sizes (e.g. --hf 16 64)")
    p.add_argument("--json", action="store_true")
    _engine_args(p)
    p.set_defaults(func=run_serve_bench)
