"""`dsv4 bench serve`: a load generator against a real `dsv4 serve` HTTP server.

The server (`dsv4 serve` itself, in a process of its own) listens on a loopback port; N
concurrent clients (`dsv4.bench.load`: one load process per 32 clients, started together once all are
ready) send streaming /v1/completions requests (prompts of random token ids, lengths drawn
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
from pathlib import Path

import torch

from .. import argtypes, options
from ..errors import UserError
from .load import after_opening_wave, arrivals, closed_loop_ceiling, drive


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def _raw_decode_rate(model, batch: int, prompt_len: int, steps: int, device: torch.device) -> dict:
    """Tokens/s of model.decode_step on a lockstep cache of `batch` sequences (a CUDA graph on CUDA)."""
    from .graphs import GraphedDecoder

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, model.cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    with torch.no_grad():
        cache = model.new_cache(batch, prompt_len + 2 * steps + 8)
        nxt = model.prefill(prompt, cache)[:, -1].argmax(-1, keepdim=True)
        step = GraphedDecoder(model, cache).step if device.type == "cuda" else (lambda t: model.decode_step(t, cache))
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
            hf.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
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
        part = re.match(r"dsv4_request_(queue|prefill|transport)_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)", line)
        if part:
            le = re.search(r'le="([^"]+)"', part.group(3))
            key = f"ttft_{part.group(1)}_{part.group(2)}" + (f".{le.group(1)}" if le else "")
            out[key] = float(part.group(4))
            continue
        m = re.match(
            r"dsv4_(engine_phase_seconds_total|generation_tokens_total|prompt_tokens_total|preemptions_total|"
            r"prefix_cache_hit_tokens_total|spec_draft_tokens_total|spec_accepted_tokens_total|"
            r"spec_acceptance_ratio|spec_tokens_per_verify|spec_verify_length_sum|spec_verify_length_count|"
            r"engine_graph_steps_total|"
            r"engine_eager_steps_total|engine_burst_steps_total|kernel_compilations_after_ready|warmup_seconds|"
            r"cuda_graphs)"
            r"\{([^}]*)\} (\S+)",
            line,
        )
        if m:
            phase = re.search(r'phase="(\w+)"', m.group(2))
            out[m.group(1) + (f".{phase.group(1)}" if phase else "")] = float(m.group(3))
    return out


IDLE_REQUESTS = 5  # one at a time, on a server with nothing else to do: the idle time to first token


def _server_argv(args: argparse.Namespace) -> list[str]:
    """`dsv4 serve` with this benchmark's model and engine settings, on a free loopback port."""
    argv = [sys.executable, "-m", "dsv4", "serve", "--host", "127.0.0.1", "--port", "0"]
    for flag in (
        "preset",
        "model",
        "config",
        "device",
        "dtype",
        "quant_mode",
        "max_num_seqs",
        "max_model_len",
        "max_batch_tokens",
        "max_prefill_tokens",
        "page_size",
        "cache_pages",
        "speculative",
        "speculative_threshold",
        "tensor_parallel_size",
        "worker_timeout",
        "threads",
        "api_servers",
    ):
        value = getattr(args, flag, None)
        if value is not None and not (flag in ("speculative", "speculative_threshold", "threads") and not value):
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    for flag in ("keep_quantized", "no_prefix_caching", "deterministic", "enable_expert_parallel"):
        if getattr(args, flag, False):
            argv.append(f"--{flag.replace('_', '-')}")
    if not getattr(args, "cuda_graph", True):
        argv.append("--no-cuda-graph")
    return argv


def _start_server(argv: list[str]) -> tuple[subprocess.Popen, str, int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"ready: http://([^:/]+):(\d+)/v1", line)
        if m:
            proc.warnings = []  # the server's warnings after it said ready (kept; the rest of its output drained)

            def drain() -> None:
                for line in proc.stdout:
                    if "warning" in line.lower():
                        proc.warnings.append(line.strip())

            threading.Thread(target=drain, daemon=True).start()
            return proc, m.group(1), int(m.group(2)), "".join(lines)
    proc.wait()
    raise UserError("the server did not start:\n" + "".join(lines[-20:]))


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def code_pool(tokenizer, held_out_pct: float = 2.0, max_docs: int = 64) -> list[list[int]]:
    """`--prompts code`: the token streams of (up to max_docs of) the Python standard library files that
    `dsv4 train` keeps out of training at held_out_pct (its default), BOS first: text like what the shipped
    model writes, which it has not seen."""
    from ..eval.heldout import held_out_documents
    from ..train.data import find_documents, read_text

    if tokenizer is None:
        raise UserError("--prompts code needs the model's tokenizer: give --model (a preset has none)")
    docs = held_out_documents(find_documents(None), held_out_pct)[:max_docs]
    pool = [[tokenizer.bos_id] + tokenizer.encode(read_text(path)) for _, path in docs]
    pool = [t for t in pool if len(t) > 1]
    if not pool:
        raise UserError("--prompts code: this Python has no held-out standard library sources")
    return pool


def _work(
    vocab: int, n: int, args: argparse.Namespace, seed: int, pool: list[list[int]] | None = None
) -> list[tuple[list[int], int]]:
    """n (prompt, output length) items, the lengths uniform in mean * (1 +- spread): random token ids, or
    with a pool (`code_pool`) a window at a random offset of a document longer than the prompt (of the
    longest where none is)."""
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        return max(1, round(mean * (1 + args.spread * (2 * rng.random() - 1))))

    def prompt(n_tokens: int) -> list[int]:
        if pool is None:
            return [rng.randrange(2, vocab) for _ in range(n_tokens)]
        long = [d for d in pool if len(d) > n_tokens] or [max(pool, key=len)]
        doc = long[rng.randrange(len(long))]
        at = rng.randrange(max(1, len(doc) - n_tokens))
        return doc[at : at + n_tokens]

    return [(prompt(draw(args.prompt_len)), draw(args.output_len)) for _ in range(n)]


def default_load_procs(clients: int, cores: int) -> int:
    """Load-generator processes: one per 8 clients, at most 8 and at most half the cores (the server needs
    the rest). One process parses some ten thousand streamed events a second; at 64 clients a GPU server
    streams about twenty thousand, and the two processes of one per 32 clients measured their own delays
    too (an H100: inter-token p99 2.12x its p50 with two processes, 1.96x with eight)."""
    return max(1, min(8, -(-clients // 8), cores // 2))


def _serve_runs(args: argparse.Namespace, name: str, vocab: int, clients: int) -> dict:
    """One server for `clients` clients: idle TTFT, then --repeats timed loads (fresh prompts each: the prefix
    cache must not serve a repeat)."""
    requests = args.requests or 4 * clients
    procs = args.load_procs or default_load_procs(clients, os.cpu_count() or 1)
    pool = args.code_pool
    runs_work = [_work(vocab, requests, args, args.seed + 1000 * r, pool) for r in range(args.repeats)]
    longest = max(len(p) + n for w in runs_work for p, n in w)
    sargs = argparse.Namespace(**vars(args))
    sargs.max_num_seqs = args.max_num_seqs or clients
    sargs.max_model_len = args.max_model_len or max(longest + 1, 256)
    proc, host, port, banner = _start_server(_server_argv(sargs))
    row: dict = {"clients": clients, "requests": requests, "server": banner.strip().splitlines()[-2:]}
    if not args.request_rate:  # (the median over the runs' workloads)
        ceilings = [closed_loop_ceiling([n for _, n in w], clients) for w in runs_work]
        row["closed_loop_ceiling"] = statistics.median(ceilings)
    http = re.search(r"(\d+) HTTP process", banner)
    row["api_servers"] = int(http.group(1)) if http else None
    try:
        idle = []
        warm = _work(vocab, 2 + IDLE_REQUESTS, args, args.seed + 999, pool)
        for k, item in enumerate(warm):  # warm-up (two), then the idle time to first token (the median of five)
            r = drive(host, port, name, [item], 1, temperature=args.temperature)[0][0]
            if r.error:
                raise UserError(f"the server refused a warm-up request: {r.error}")
            if k >= 2:
                idle.append(r.ttft)
        warm = _work(vocab, clients, args, args.seed + 998, pool)
        drive(host, port, name, warm, clients, procs, temperature=args.temperature)
        before = _scrape(host, port)
        runs = []
        for r, work in enumerate(runs_work):
            at = arrivals(len(work), args.request_rate, args.seed + r) if args.request_rate else None
            results, wall = drive(host, port, name, work, clients, procs, at, args.temperature)
            runs.append((results, wall))
        after = _scrape(host, port)
        warned = list(getattr(proc, "warnings", []))  # (before the stop: not its shutdown's messages)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    errors = [r.error for results, _ in runs for r in results if r.error]
    per_run = []
    for results, wall in runs:
        ttft = [r.ttft for r in results if r.ttft is not None]
        gaps = [g for r in results for g in r.gaps]
        per_run.append(
            {
                "tokens_per_s": sum(r.tokens for r in results) / wall,
                "ttft_p50_s": _pct(ttft, 50),
                "ttft_p99_s": _pct(ttft, 99),
                "itl_p50_s": _pct(gaps, 50),
                "itl_p99_s": _pct(gaps, 99),
            }
        )
        if not args.request_rate:  # a closed loop: the time to first token without its opening burst too
            later = [r.ttft for r in after_opening_wave(results, clients) if r.ttft is not None]
            per_run[-1]["ttft_p99_after_opening_s"] = _pct(later, 99)
    row.update({k: _spread([x[k] for x in per_run]) for k in per_run[0]})
    row["ttft_idle_s"] = statistics.median(idle)
    row["ttft_p99_over_idle"] = row["ttft_p99_s"]["median"] / row["ttft_idle_s"] if row["ttft_p99_s"] else None
    if row.get("ttft_p99_after_opening_s"):
        row["ttft_p99_after_opening_over_idle"] = row["ttft_p99_after_opening_s"]["median"] / row["ttft_idle_s"]
    row["itl_p99_over_p50"] = (
        row["itl_p99_s"]["median"] / row["itl_p50_s"]["median"]
        if row["itl_p50_s"] and row["itl_p50_s"]["median"]
        else None
    )
    row["errors"], row["first_errors"] = len(errors), errors[:3]
    row["server_warnings"] = warned[:20]
    counted = ("_total", "_bucket", "_sum", "_count")  # counters: the timed runs' share is the difference
    row["server_metrics"] = {k: v - before.get(k, 0.0) if any(c in k for c in counted) else v for k, v in after.items()}
    row["ttft_parts"] = ttft_parts(row["server_metrics"])
    return row


def ttft_parts(sm: dict[str, float]) -> dict[str, dict[str, float]]:
    """The server's own split of the time to first token over the timed runs (its histograms): for the
    engine's queue and prefill (per sequence) and the rest, the transport (per request), the mean and the
    bucket bound that holds the 99th percentile (the histogram's resolution, not the exact value)."""
    parts = {}
    for name in ("transport", "queue", "prefill"):
        count = sm.get(f"ttft_{name}_count", 0.0)
        if count <= 0:
            continue
        head = f"ttft_{name}_bucket."
        buckets = sorted((float(k[len(head) :]), v) for k, v in sm.items() if k.startswith(head))  # ("+Inf" too)
        p99 = next((le for le, n in buckets if n >= 0.99 * count), float("inf"))
        parts[name] = {"mean_s": sm.get(f"ttft_{name}_sum", 0.0) / count, "p99_at_most_s": p99, "count": count}
    return parts


def run_serve_bench(args: argparse.Namespace) -> int:
    from ..serve.startup import EngineSpec, load

    for name in ("prompt_len", "output_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.spread < 1:
        raise UserError("--spread must be in [0, 1)")
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.clients):
        raise UserError(
            "--max-num-seqs must be at least the largest --clients (each client keeps one request in flight)"
        )
    spec = EngineSpec.from_args(args).resolved()
    # the servers run on the device and dtype resolved here
    args = argparse.Namespace(**{**vars(args), "device": spec.source.device, "dtype": spec.source.dtype})
    model, tokenizer, name, desc = load(spec)
    device = model.embed.weight.device
    args.code_pool = code_pool(tokenizer) if args.prompts == "code" else None
    result: dict = {
        "bench": "serve",
        "model": desc,
        "dtype": spec.source.dtype,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "spread": args.spread,
        "repeats": args.repeats,
        "request_rate": args.request_rate,  # None: every client at once, then a closed loop
        "temperature": args.temperature,
        "prompts": args.prompts,
        "runs": {},
    }
    # the peers first, in this process; then each server in its own process (its own interpreter: the load
    # generator's Python must not share a lock with the server's)
    raw = {}
    if not args.no_raw:
        for clients in args.clients:
            rates = [
                _raw_decode_rate(model, clients, args.prompt_len, max(16, args.output_len), device)
                for _ in range(args.repeats)
            ]
            raw[clients] = _spread([x["tokens_per_s"] for x in rates])
    if args.hf:
        same = [p for p, _ in _work(model.cfg.vocab_size, max(args.hf), args, args.seed, args.code_pool)]
        hf = {
            str(b): _spread(
                [
                    _hf_rate(model, same, args.output_len, [b], device)[str(b)]["tokens_per_s"]
                    for _ in range(args.repeats)
                ]
            )
            for b in args.hf
        }
        result["hf_generate"] = hf
        result["hf_best_tokens_per_s"] = max(v["median"] for v in hf.values())
    vocab = model.cfg.vocab_size
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    errors = 0
    for clients in args.clients:
        row = _serve_runs(args, name, vocab, clients)
        if clients in raw:
            row["raw_decode_tokens_per_s"] = raw[clients]
            row["fraction_of_raw_decode"] = row["tokens_per_s"]["median"] / raw[clients]["median"]
        if "hf_best_tokens_per_s" in result:
            row["speedup_over_hf_best"] = row["tokens_per_s"]["median"] / result["hf_best_tokens_per_s"]
        errors += row["errors"]
        result["runs"][str(clients)] = row
        if not args.json:
            _print(result, row)
    if "hf_generate" in result and not args.json:
        print(
            "  transformers generate: "
            + ", ".join(f"batch {b} {_fmt(v)} tokens/s" for b, v in result["hf_generate"].items())
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    return 1 if errors else 0


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fmt(s: dict | None, scale: float = 1.0, unit: str = "") -> str:
    if s is None:
        return "-"
    return f"{s['median'] * scale:.1f}{unit} ({s['min'] * scale:.1f}-{s['max'] * scale:.1f})"


def _print(result: dict, r: dict) -> None:
    print(
        f"{result['device']}  torch {result['torch']}  {result['date']}  {result['model']}  {result['dtype']}  "
        f"commit {result['commit']}"
    )
    print(
        f"  load: {r['clients']} streaming clients, {r['requests']} requests per run, "
        f"prompt ~{result['prompt_len']}, "
        f"output ~{result['output_len']} (+-{result['spread']:.0%}); median (min-max) of {result['repeats']} runs"
        + (f"; Poisson arrivals at {result['request_rate']:g} requests/s" if result.get("request_rate") else "")
        + (f"; the server's HTTP processes: {r['api_servers']}" if r.get("api_servers") else "")
    )
    print(f"  throughput      {_fmt(r['tokens_per_s'])} output tokens/s  ({r['errors']} errors)")
    print(
        f"  TTFT            p50 {_fmt(r['ttft_p50_s'], 1e3, ' ms')}  p99 {_fmt(r['ttft_p99_s'], 1e3, ' ms')}  "
        f"(idle {r['ttft_idle_s'] * 1e3:.1f} ms"
        + (f", p99 {r['ttft_p99_over_idle']:.1f}x idle" if r.get("ttft_p99_over_idle") else "")
        + ")"
    )
    if r.get("ttft_p99_after_opening_s"):  # (a closed loop's clients all send their first request at once)
        print(
            f"                  after the opening wave (each client's first request): p99 "
            f"{_fmt(r['ttft_p99_after_opening_s'], 1e3, ' ms')} ({r['ttft_p99_after_opening_over_idle']:.1f}x idle)"
        )
    print(
        f"  inter-token     p50 {_fmt(r['itl_p50_s'], 1e3, ' ms')}  p99 {_fmt(r['itl_p99_s'], 1e3, ' ms')}"
        + (f"  (p99 {r['itl_p99_over_p50']:.1f}x p50)" if r.get("itl_p99_over_p50") else "")
    )
    if "raw_decode_tokens_per_s" in r:
        print(
            f"  raw decode      {_fmt(r['raw_decode_tokens_per_s'])} tokens/s at batch {r['clients']}: the server "
            f"reaches {r['fraction_of_raw_decode']:.0%} of it"
        )
        if "closed_loop_ceiling" in r:
            print(
                f"                  (this closed loop lets a server reach at most {r['closed_loop_ceiling']:.0%}: the "
                "seats left empty while the last requests finish)"
            )
    if "speedup_over_hf_best" in r:
        print(f"  dsv4 serve / best transformers generate: {r['speedup_over_hf_best']:.1f}x")
    sm = r.get("server_metrics", {})
    if sm.get("spec_draft_tokens_total"):
        print(
            f"  speculative     {sm.get('spec_acceptance_ratio', 0):.0%} of drafts accepted, "
            f"{sm.get('spec_tokens_per_verify', 0):.2f} tokens per verify step"
            + (
                f", {sm['spec_verify_length_sum'] / sm['spec_verify_length_count']:.2f} drafts verified per decode row"
                if sm.get("spec_verify_length_count")
                else ""
            )
        )
    if "engine_graph_steps_total" in sm or "engine_eager_steps_total" in sm:
        print(
            f"  engine steps    {sm.get('engine_graph_steps_total', 0):.0f} from CUDA graphs, "
            f"{sm.get('engine_eager_steps_total', 0):.0f} eager; "
            f"{sm.get('kernel_compilations_after_ready', 0):.0f} kernel compilations after ready; "
            f"{sm.get('engine_burst_steps_total', 0):.0f} burst steps"
        )
    parts = r.get("ttft_parts") or {}
    if parts:
        print(
            "  TTFT parts      "
            + ", ".join(
                f"{name} mean {p['mean_s'] * 1e3:.1f} ms, p99 <= {p['p99_at_most_s'] * 1e3:g} ms"
                for name, p in parts.items()
            )
            + " (the server's histograms)"
        )
    phases = {k.split(".", 1)[1]: v for k, v in sm.items() if k.startswith("engine_phase") and "." in k}
    if phases:
        total = sum(phases.values())
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in phases.items())
        print(f"  engine process time: {shares} of {total:.1f} s")
    for e in r["first_errors"]:
        print(f"  error: {e}")
    for w in r.get("server_warnings", []):
        print(f"  server: {w}")


def add_bench_serve_parser(subparsers) -> None:
    from ..loading import add_model_args
    from ..serve.api_servers import MAX_API_SERVERS
    from ..serve.cli import engine_args

    p = subparsers.add_parser(
        "serve",
        help="load-test a dsv4 serve HTTP server: throughput, TTFT, inter-token "
        "latency, against the raw batched decode rate (and transformers)",
    )
    add_model_args(p, "the shipped model")
    p.add_argument(
        "--clients",
        type=argtypes.positive_int,
        nargs="+",
        default=[16],
        help="concurrent streaming clients; several values: one server each (default 16)",
    )
    p.add_argument(
        "--requests", type=argtypes.positive_int, default=None, help="requests per timed run (default 4 x clients)"
    )
    p.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=3,
        help="timed runs per client count; figures are their median with min and max (default 3)",
    )
    p.add_argument(
        "--load-procs",
        type=argtypes.positive_int,
        default=None,
        help="load-generator processes (default: one per 8 clients, at most 8 and at most half the cores)",
    )
    p.add_argument("--prompt-len", type=argtypes.positive_int, default=128, help="mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=argtypes.positive_int, default=64, help="mean output tokens (default 64)")
    p.add_argument(
        "--spread",
        type=argtypes.float_in(0.0, 1.0, hi_open=True),
        default=0.25,
        help="lengths uniform in mean*(1 +- spread) (default 0.25)",
    )
    options.add(p, "seed", default=0, note="of the drawn prompts and lengths")
    options.add(p, "temperature", default=1.0, note="of every request (each with its own seed; 0: greedy)")
    p.add_argument(
        "--prompts",
        choices=("random", "code"),
        default="random",
        help="random token ids, or windows of the Python standard library files the shipped model's "
        "training kept out (needs the model's tokenizer; what a speculative draft meets in use)",
    )
    p.add_argument("--no-raw", action="store_true", help="skip the raw batched decode measurement")
    p.add_argument(
        "--hf",
        type=argtypes.positive_int,
        nargs="*",
        default=None,
        metavar="BATCH",
        help="also time transformers' generate at these batch sizes (e.g. --hf 16 64)",
    )
    p.add_argument(
        "--request-rate",
        type=argtypes.float_in(0.0, 1e6, lo_open=True),
        default=None,
        metavar="R",
        help="send the timed requests at Poisson arrival times, R per second, at most --clients at once "
        "(default: every client at once, then each again as soon as its answer ends)",
    )
    p.add_argument(
        "--api-servers",
        type=argtypes.int_in(1, MAX_API_SERVERS),
        default=None,
        metavar="N",
        help="the server's HTTP processes (dsv4 serve --api-servers; default: its own)",
    )
    p.add_argument("--out", metavar="FILE", default=None, help="write the result as JSON")
    options.add(p, "json")
    engine_args(p)
    p.set_defaults(func=run_serve_bench)
