"""`dsv4 bench serve`: a load generator against a real `dsv4 serve` HTTP server, in one process.

The server (`dsv4 serve` itself, in a process of its own) listens on a loopback port; N
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
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import argtypes, options
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


def _scrape(host: str, port: int) -> dict[str, float]:
    """The server's counters of interest from /metrics (engine phase seconds, tokens, preemptions)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'dsv4_(engine_phase_seconds_total|generation_tokens_total|prompt_tokens_total|preemptions_total|'
                     r'prefix_cache_hit_tokens_total|spec_draft_tokens_total|spec_accepted_tokens_total|'
                     r'spec_acceptance_ratio|spec_tokens_per_verify)\{([^}]*)\} (\S+)', line)
        if m:
            phase = re.search(r'phase="(\w+)"', m.group(2))
            out[m.group(1) + (f".{phase.group(1)}" if phase else "")] = float(m.group(3))
    return out


def _server_argv(args: argparse.Namespace) -> list[str]:
    """`dsv4 serve` with this benchmark's model and engine settings, on a free loopback port."""
    argv = [sys.executable, "-m", "dsv4", "serve", "--host", "127.0.0.1", "--port", "0"]
    for flag in ("preset", "model", "config", "device", "dtype", "quant_mode", "max_num_seqs", "max_model_len",
                 "max_batch_tokens", "page_size", "cache_pages", "speculative", "threads"):
        value = getattr(args, flag, None)
        if value is not None and not (flag in ("speculative", "threads") and not value):
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    for flag in ("keep_quantized", "no_prefix_caching", "deterministic"):
        if getattr(args, flag, False):
            argv.append(f"--{flag.replace('_', '-')}")
    if not getattr(args, "cuda_graph", True):
        argv.append("--no-cuda-graph")
    return argv


def _start_server(argv: list[str]) -> tuple[subprocess.Popen, str, int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"ready: http://([^:/]+):(\d+)/v1", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()      # keep the pipe drained
            return proc, m.group(1), int(m.group(2)), "".join(lines)
    proc.wait()
    raise UserError("the server did not start:\n" + "".join(lines[-20:]))


def run_serve_bench(args: argparse.Namespace) -> int:
    from ..serve.cli import _load

    for name in ("clients", "requests", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.spread < 1:
        raise UserError("--spread must be in [0, 1)")
    args.max_num_seqs = args.max_num_seqs or args.clients
    model, _tokenizer, name, desc = _load(args)
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
    # the peers first, in this process; then the server in its own process (its own interpreter: the load
    # generator's Python must not share a lock with the server's)
    if not args.no_raw:
        result["raw_decode"] = _raw_decode_rate(model, args.clients, args.prompt_len, max(16, args.output_len), device)
    if args.hf:
        same = [p for p, _ in work[:args.clients]]
        result["hf_generate"] = _hf_rate(model, same, args.output_len, args.hf, device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    proc, host, port, banner = _start_server(_server_argv(args))
    result["server"] = banner.strip().splitlines()[-2:]
    try:
        idle = []
        for i in range(3):                                  # warm-up and the idle time to first token
            r = asyncio.run(_drive(host, port, name, [work[i % len(work)]], 1))[0][0]
            if r.error:
                raise UserError(f"the server refused a warm-up request: {r.error}")
            idle.append(r.ttft)
        results, wall = asyncio.run(_drive(host, port, name, work, args.clients))
        result["server_metrics"] = _scrape(host, port)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [r.error for r in results if r.error]
    ttft = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    out_tokens = sum(r.tokens for r in results)
    result.update({
        "errors": len(errors), "first_errors": errors[:3], "wall_s": wall, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall, "ttft_idle_s": statistics.median(idle),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99)})
    if result["ttft_p50_s"] and result["ttft_idle_s"]:
        result["ttft_load_over_idle"] = result["ttft_p50_s"] / result["ttft_idle_s"]
    if "raw_decode" in result:
        result["fraction_of_raw_decode"] = result["output_tokens_per_s"] / result["raw_decode"]["tokens_per_s"]
    if "hf_generate" in result:
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
    sm = r.get("server_metrics", {})
    if sm.get("spec_draft_tokens_total"):
        print(f"  speculative     {sm.get('spec_acceptance_ratio', 0):.0%} of drafts accepted, "
              f"{sm.get('spec_tokens_per_verify', 0):.2f} tokens per verify step")
    phases = {k.split(".", 1)[1]: v for k, v in r.get("server_metrics", {}).items()
              if k.startswith("engine_phase") and "." in k}
    if phases:
        total = sum(phases.values())
        print("  engine host time: " + ", ".join(f"{k} {v / total:.0%}" for k, v in phases.items())
              + f" of {total:.1f} s")
    for e in r["first_errors"]:
        print(f"  error: {e}")


def add_bench_serve_parser(subparsers) -> None:
    from ..loading import add_model_args
    from ..serve.cli import engine_args

    p = subparsers.add_parser("serve", help="load-test a dsv4 serve HTTP server: throughput, TTFT, inter-token "
                                            "latency, against the raw batched decode rate (and transformers)")
    add_model_args(p, "the shipped model")
    p.add_argument("--clients", type=argtypes.positive_int, default=16,
                   help="concurrent streaming clients (default 16)")
    p.add_argument("--requests", type=argtypes.positive_int, default=64, help="requests in all (default 64)")
    p.add_argument("--prompt-len", type=argtypes.positive_int, default=128, help="mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=argtypes.positive_int, default=64, help="mean output tokens (default 64)")
    p.add_argument("--spread", type=argtypes.float_in(0.0, 1.0, hi_open=True), default=0.25,
                   help="lengths uniform in mean*(1 +- spread) (default 0.25)")
    options.add(p, "seed", default=0, note="of the drawn prompts and lengths")
    p.add_argument("--no-raw", action="store_true", help="skip the raw batched decode measurement")
    p.add_argument("--hf", type=argtypes.positive_int, nargs="*", default=None, metavar="BATCH",
                   help="also time transformers' generate at these batch sizes (e.g. --hf 16 64)")
    options.add(p, "json")
    engine_args(p)
    p.set_defaults(func=run_serve_bench)
