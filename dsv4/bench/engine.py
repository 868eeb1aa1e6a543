"""`dsv4 bench engine`: the serving engine's own throughput, in this process, without HTTP.

N clients each keep one request in flight (a closed loop, as `dsv4 bench serve` drives a server): prompts
of random token ids, lengths drawn from a fixed distribution with a fixed seed, `ignore_eos`. Reported per
client count, as the median (min, max) of --repeats runs after an untimed warm-up run:
- output tokens/s, and as a fraction of the raw batched decode rate at the same batch measured here
  (`model.decode_step` in lockstep, from a CUDA graph on CUDA); beside it the most this closed loop lets
  any engine reach (`load.closed_loop_ceiling`: the seats left empty while the last requests finish);
- engine steps/s, and the host's time per step by phase (schedule, launch, wait for the device,
  post-processing): the host is off the critical path when "wait" dominates; on CUDA the device's time
  per step from events around each step (`Runner.clock`, no profiler): busy, idle between steps, and the
  busy time of each bucket shape's steps (median, p10-p90: the price of a decode step and of prompt slots);
  the objects alive after the warm-up are frozen out of the cycle collector, as in a server's engine
  process (`freeze_heap`);
- graph-replayed and eager steps, and Triton compilations after the warm-up (0 when every step shape was
  warmed); the timed steps' mix: real decode rows and chunk tokens (prompts; with --speculative also
  verifies) per step, and the share of steps by bucket shape;
- with --profile DIR, a torch profiler trace of 20 steps (Chrome format) and the fraction of that window
  in which the GPU ran a kernel; on CUDA also the GPU time per kernel of a raw decode step, an engine
  decode-only step, a step of one new prompt beside the other rows' decodes (the steady state of a
  closed loop) and a mixed step that fills the token budget (DIR/kernels-N-clients.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import itertools
import json
import random
import shutil
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from .. import argtypes, options
from ..errors import UserError
from .load import closed_loop_ceiling


def _work(
    vocab: int, n: int, prompt_len: int, output_len: int, spread: float, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        return max(1, round(mean * (1 + spread * (2 * rng.random() - 1))))

    return [([rng.randrange(2, vocab) for _ in range(draw(prompt_len))], draw(output_len)) for _ in range(n)]


def drive(engine, work: list[tuple[list[int], int]], clients: int, tag: str = "r") -> dict:
    """Run `work` through the engine with `clients` requests in flight. -> timings."""
    from ..engine import SamplingParams

    queue = list(enumerate(work))
    active, tokens, steps = 0, 0, 0
    added: dict[str, float] = {}
    ttft: list[float] = []
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    while queue or engine.has_work():
        while queue and active < clients:
            i, (prompt, n) = queue.pop(0)
            rid = f"{tag}{i}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True))
            added[rid] = time.perf_counter()
            active += 1
        for out in engine.step():
            if out.new_tokens and out.completion_tokens == len(out.new_tokens):
                ttft.append(time.perf_counter() - added[out.request_id])
            tokens += len(out.new_tokens)
            active -= out.finished
        steps += 1
    wall = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "steps": steps,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "steps_per_s": steps / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
    }


def device_time(clock: list | None) -> dict | None:
    """A run's steps on the device from the CUDA events around each one (`Runner.clock`), per step: `busy`
    (from the copy of its inputs to the copy of its tokens) and `idle` (from one step's end to the next
    one's start: the device waiting for the host), both in ms; `by_shape`: each step shape's busy times
    (ms, one per step). None without events."""
    if not clock:
        return None
    torch.cuda.synchronize()
    spans = [a.elapsed_time(b) for a, b, _ in clock]
    idle = sum(max(0.0, end.elapsed_time(nxt)) for (_, end, _), (nxt, _, _) in zip(clock, clock[1:], strict=False))
    by_shape: dict[str, list[float]] = {}
    for (_, _, shape), ms in zip(clock, spans, strict=True):
        by_shape.setdefault(shape, []).append(ms)
    return {"busy": sum(spans) / len(clock), "idle": idle / len(clock), "by_shape": by_shape}


def shape_times(clocks: list[dict]) -> dict:
    """Busy ms per step of each step shape over all runs' steps: {shape: {steps, median, p10, p90}}, the
    most frequent shape first (what a step of that bucket costs the device, and how much it varies)."""
    pooled: dict[str, list[float]] = {}
    for c in clocks:
        for shape, ms in c["by_shape"].items():
            pooled.setdefault(shape, []).extend(ms)
    out = {}
    for shape, ms in sorted(pooled.items(), key=lambda kv: -len(kv[1])):
        out[shape] = {"steps": len(ms), "median": statistics.median(ms), "p10": _pct(ms, 10), "p90": _pct(ms, 90)}
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def spread(values: list[float]) -> dict:
    """median, min, max of a list of runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def gpu_busy(prof) -> float | None:
    """Fraction of the profiled window during which some CUDA kernel ran (union of kernel intervals)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return None
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / (spans[-1][1] - spans[0][0])


def _profile(engine, work, clients: int, out_dir: Path) -> dict:
    """20 steps under the torch profiler, in the middle of a run (the batch full)."""
    from torch.profiler import ProfilerActivity, profile

    from ..engine import SamplingParams

    for i, (prompt, n) in enumerate(work[:clients]):
        engine.add_request(
            f"p{i}", prompt, SamplingParams(max_tokens=max(n, 64), temperature=1.0, seed=i, ignore_eos=True)
        )
    for _ in range(8):  # prompts computed, decoding under way
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(20):
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"engine-{clients}-clients.json"
    prof.export_chrome_trace(str(raw))
    trace = raw.with_suffix(".json.gz")  # (Perfetto and chrome://tracing read it as it is)
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    _clear(engine)
    out = {"trace": str(trace), "gpu_busy": gpu_busy(prof)}
    if engine.device.type == "cuda":
        out["kernels"] = _kernel_tables(engine, clients, len(work[0][0]), out_dir)
    return out


def _step_mix(runner, since: dict | None = None) -> dict:
    """The timed runs' steps: how many, the real decode rows and chunk tokens per step, and the share of
    steps by bucket ("decode rows+chunk slots"; "ragged" for unpadded steps; "fixed BxS" for a speculating
    engine's fixed-shape steps, their verify rows counted as decode rows), largest first. With `since` (an
    earlier call's result), the difference."""
    now = {
        "steps": runner.graph_steps + runner.eager_steps,
        "decode_rows": runner.decode_rows,
        "chunk_tokens": runner.chunk_tokens,
        "buckets": {
            **{f"{d}+{c}": n for (d, c), n in runner.bucket_steps.items()},
            **{f"fixed {b}x{t}": n for (b, t), n in runner.fixed_steps.items()},  # (a speculating engine's)
        },
    }
    if since is None:
        return now
    steps = max(1, now["steps"] - since["steps"])
    counts = {k: n - since["buckets"].get(k, 0) for k, n in now["buckets"].items()}
    ragged = steps - sum(counts.values())
    if ragged > 0:
        counts["ragged"] = ragged
    shares = {k: n / steps for k, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n > 0}
    return {
        "steps": steps,
        "decode_rows_per_step": (now["decode_rows"] - since["decode_rows"]) / steps,
        "chunk_tokens_per_step": (now["chunk_tokens"] - since["chunk_tokens"]) / steps,
        "bucket_share": shares,
    }


def _clear(engine) -> None:
    while engine.has_work():
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()


def _kernel_tables(engine, clients: int, prompt_len: int, out_dir: Path, top: int = 30) -> dict:
    """GPU time per kernel name (summed over its launches) of four steps at this batch, written to
    DIR/kernels-N-clients.txt: the raw decode step (`model.decode_step` on a lockstep cache, as the raw rate
    measures it), the engine's decode-only step, a step where one request's prompt joins the other rows'
    decodes (what most steps of a closed loop are), and a mixed step (half the rows decoding, prompt chunks
    of new requests filling the rest of the token budget). What separates the engine from the raw rate is
    the difference of the first two, and what a prompt costs is in the last two."""
    from ..engine import SamplingParams
    from .device_profile import kernel_table
    from .graphs import GraphedDecoder

    model, vocab = engine.model, engine.model.cfg.vocab_size
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(prompt_len)]

    room = engine.max_model_len - prompt_len - 1
    tables: dict[str, dict] = {}

    def record(name: str, fn, calls: int, note: str) -> None:
        runner = engine.runner
        before = (runner.decode_rows, runner.chunk_tokens, runner.graph_steps + runner.eager_steps)
        busy, n, rows = kernel_table(fn, calls)
        if name != "raw decode":  # what the steps really carried (kernel_table runs one untimed call first)
            ran = runner.graph_steps + runner.eager_steps - before[2]
            d, p = runner.decode_rows - before[0], runner.chunk_tokens - before[1]
            note += f"; ran {d / max(1, ran):.0f} decode rows and {p / max(1, ran):.0f} chunk tokens per step"
        tables[name] = {"gpu_busy_ms": busy, "kernels": n, "note": note, "top": rows[:top], "all": rows}

    prompts = torch.tensor([prompt() for _ in range(clients)], device=engine.device)
    cache = model.new_cache(clients, prompt_len + 16)
    nxt = model.prefill(prompts, cache)[:, -1].argmax(-1, keepdim=True)
    decoder = GraphedDecoder(model, cache)
    record("raw decode", partial(decoder.step, nxt), 3, f"batch {clients}, {prompt_len}-token context")
    del decoder, cache
    # every request past its prompt: decode-only steps
    for i in range(clients):
        engine.add_request(f"k{i}", prompt(), SamplingParams(max_tokens=room, ignore_eos=True))
    started: set[str] = set()
    while len(started) < clients:
        started.update(o.request_id for o in engine.step() if o.new_tokens)
    record("engine decode", engine.step, 3, f"{clients} decode rows")
    # one request replaced by a new one before every step: its prompt's chunks beside the other rows' decodes
    fresh = itertools.count()
    engine.abort("k0")

    def one_prompt():
        for rid in [r for r in engine.requests if r.startswith("p")]:  # the last call's prompt, now decoding
            engine.abort(rid)
        engine.add_request(f"p{next(fresh)}", prompt(), SamplingParams(max_tokens=room, ignore_eos=True))
        return engine.step()

    record("engine decode + 1 prompt", one_prompt, 3, f"{clients - 1} decode rows + one {prompt_len}-token prompt")
    for rid in [r for r in engine.requests if r.startswith("p")]:
        engine.abort(rid)
    engine.add_request("k0", prompt(), SamplingParams(max_tokens=room, ignore_eos=True))
    # half of them replaced by new prompts: steps with prompt chunks beside the other half's decodes
    for i in range(clients // 2):
        engine.abort(f"k{i}")
    for i in range(clients // 2):
        engine.add_request(f"m{i}", prompt(), SamplingParams(max_tokens=room, ignore_eos=True))
    budget = engine.config.max_batch_tokens
    calls = max(1, min(3, (clients // 2) * prompt_len // budget - 1))
    record(
        "engine mixed",
        engine.step,
        calls,
        f"{clients - clients // 2} decode rows + prompt chunks up to {budget} tokens",
    )
    _clear(engine)
    lines = []
    for name, t in tables.items():
        lines.append(f"{name} ({t['note']}): GPU busy {t['gpu_busy_ms']:.3f} ms per step, {t['kernels']:.0f} kernels")
        lines += [f"  {ms:8.3f} ms  {k:6.1f}x  {kname[:110]}" for kname, ms, k in t["top"]]
    for a, b in (("raw decode", "engine decode"), ("engine decode", "engine decode + 1 prompt")):
        lines += kernel_difference(tables[a]["all"], tables[b]["all"], f"{b} minus {a}")
    (out_dir / f"kernels-{clients}-clients.txt").write_text("\n".join(lines) + "\n")
    return {name: {k: t[k] for k in ("gpu_busy_ms", "kernels", "note")} for name, t in tables.items()}


def kernel_difference(before: list, after: list, title: str, top: int = 40) -> list[str]:
    """Lines of a per-kernel-name difference of two kernel tables ([(name, ms, launches)] per step):
    every name whose time or launch count changed, the largest time changes first (what one step adds
    over the other, kernel by kernel, including the names below either table's top rows)."""
    old = {name: (ms, k) for name, ms, k in before}
    new = {name: (ms, k) for name, ms, k in after}
    rows = []
    for name in old.keys() | new.keys():
        (ms0, k0), (ms1, k1) = old.get(name, (0.0, 0.0)), new.get(name, (0.0, 0.0))
        if abs(ms1 - ms0) >= 5e-4 or k1 != k0:
            rows.append((ms1 - ms0, k1 - k0, name))
    rows.sort(key=lambda r: -abs(r[0]))
    total = sum(r[0] for r in rows)
    lines = [f"{title}: {total:+.3f} ms over {len(rows)} kernel names that changed"]
    lines += [f"  {d:+8.3f} ms  {k:+6.1f}x  {name[:110]}" for d, k, name in rows[:top]]
    return lines


def run_engine_bench(args: argparse.Namespace) -> int:
    from ..bench.serve import _raw_decode_rate
    from ..engine import Engine
    from ..engine.engine_process import freeze_heap
    from ..ops import compiles
    from ..serve.startup import EngineSpec, check_engine_options, load

    if not 0 <= args.spread < 1:
        raise UserError("--spread must be in [0, 1)")
    from ..loading import resolve_config

    spec = EngineSpec.from_args(args).resolved()
    check_engine_options(spec, resolve_config(spec.source))  # before any weights are read
    from ..defaults import set_threads

    set_threads(spec.threads)
    model, _tok, _name, desc = load(spec)
    device = model.embed.weight.device
    result: dict = {
        "bench": "engine",
        "model": desc,
        "dtype": spec.source.dtype,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "spread": args.spread,
        "repeats": args.repeats,
        "runs": {},
    }
    for clients in args.clients:
        requests = args.requests or 4 * clients
        work = _work(model.cfg.vocab_size, requests, args.prompt_len, args.output_len, args.spread, args.seed)
        longest = max(len(p) + n for p, n in work)
        config = dataclasses.replace(
            spec, max_num_seqs=clients, max_model_len=min(model.cfg.max_seq_len, max(longest + 1, 256))
        ).engine_config()
        if args.chunk_len is not None:
            config.chunk_len = args.chunk_len
        engine = Engine(model, config)
        t0 = time.perf_counter()
        graphs = engine.warmup()
        warm = time.perf_counter() - t0
        drive(engine, work[: 2 * clients], clients, "w")  # untimed: caches, allocator, buckets
        freeze_heap()  # as the server's engine process does after start-up (undone below)
        at_ready = compiles.count()
        runs, phases, clocks = [], [], []
        mix0, bursts0 = _step_mix(engine.runner), engine.stats["burst_steps"]
        for r in range(args.repeats):
            before = dict(engine.timing)
            engine.runner.clock = [] if device.type == "cuda" else None
            runs.append(drive(engine, work, clients, f"t{r}-"))
            phases.append({k: (engine.timing[k] - before[k]) / runs[-1]["steps"] * 1e3 for k in before})
            clocks.append(device_time(engine.runner.clock))
            engine.runner.clock = None
        mix = _step_mix(engine.runner, mix0)
        row = {
            "clients": clients,
            "requests": requests,
            "chunk_len": engine.config.chunk_len,
            "graphs": graphs,
            "warmup_s": warm,
            "graph_steps": engine.runner.graph_steps,
            "eager_steps": engine.runner.eager_steps,
            "late_captures": engine.runner.late_captures,
            "burst_steps": engine.stats["burst_steps"] - bursts0,  # (the timed runs')
            "compiles_after_warmup": None if at_ready is None else compiles.count() - at_ready,
            "tokens_per_s": spread([x["tokens_per_s"] for x in runs]),
            "steps_per_s": spread([x["steps_per_s"] for x in runs]),
            "ttft_p50_s": spread([x["ttft_p50_s"] for x in runs]),
            "ttft_p99_s": spread([x["ttft_p99_s"] for x in runs]),
            "host_ms_per_step": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
            "device_ms_per_step": None
            if None in clocks
            else {k: spread([c[k] for c in clocks]) for k in ("busy", "idle")},
            "device_ms_by_bucket": None if None in clocks else shape_times(clocks),
            "step_mix": mix,
            "closed_loop_ceiling": closed_loop_ceiling([n for _, n in work], clients),
        }
        if args.speculative:
            row["speculative"] = engine.metrics()["speculative"]  # since the engine started (warm-up too)
        if not args.no_raw:
            raw = [
                _raw_decode_rate(model, clients, args.prompt_len, max(16, args.output_len), device)
                for _ in range(args.repeats)
            ]
            row["raw_decode_tokens_per_s"] = spread([x["tokens_per_s"] for x in raw])
            row["fraction_of_raw_decode"] = row["tokens_per_s"]["median"] / row["raw_decode_tokens_per_s"]["median"]
        if args.profile:
            row["profile"] = _profile(engine, work, clients, Path(args.profile))
        result["runs"][str(clients)] = row
        del engine
        gc.unfreeze()  # this engine's objects can be collected again (the next count builds its own)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.json:
            _print_row(row)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    return 0


def _fmt(s: dict, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    m, lo, hi = (f"{s[k] * scale:.{digits}f}" for k in ("median", "min", "max"))
    return f"{m}{unit} ({lo}-{hi})"


def _print_row(r: dict) -> None:
    print(
        f"{r['clients']} clients, {r['requests']} requests: {_fmt(r['tokens_per_s'])} output tokens/s, "
        f"{_fmt(r['steps_per_s'])} steps/s (median of {r['tokens_per_s']['runs']}, min-max)"
    )
    if "raw_decode_tokens_per_s" in r:
        print(
            f"  raw decode at batch {r['clients']}: {_fmt(r['raw_decode_tokens_per_s'])} tokens/s: the engine "
            f"reaches {r['fraction_of_raw_decode']:.0%} of it"
        )
    print(
        f"  this closed loop lets an engine reach at most {r['closed_loop_ceiling']:.0%} of raw decode (every step "
        "at the raw step's cost, seats refilled at once: the loss is the seats left empty at the end)"
    )
    print(f"  TTFT p50 {_fmt(r['ttft_p50_s'], 1e3, ' ms')}, p99 {_fmt(r['ttft_p99_s'], 1e3, ' ms')}")
    print("  host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items()))
    if r.get("device_ms_per_step"):
        d = r["device_ms_per_step"]
        print(
            f"  device ms per step (CUDA events around each step, no profiler): busy {_fmt(d['busy'], digits=2)}, idle "
            f"between steps {_fmt(d['idle'], digits=2)}: the device waits for the host "
            f"{d['idle']['median'] / (d['busy']['median'] + d['idle']['median']):.1%} of the time"
        )
        shapes = list(r["device_ms_by_bucket"].items())[:8]
        print(
            "  device ms per step by bucket (median over its steps, p10-p90): "
            + ", ".join(f"{k} {v['median']:.2f} ({v['p10']:.2f}-{v['p90']:.2f}) x{v['steps']}" for k, v in shapes)
        )
    m = r["step_mix"]
    shares = ", ".join(f"{k} {v:.0%}" for k, v in list(m["bucket_share"].items())[:6])
    print(
        f"  per step: {m['decode_rows_per_step']:.1f} decode rows, {m['chunk_tokens_per_step']:.1f} chunk "
        f"tokens; steps by bucket (decode rows+chunk slots): {shares}"
    )
    print(
        f"  {r['graphs']} graphs captured in {r['warmup_s']:.1f} s; {r['graph_steps']} graph steps, "
        f"{r['eager_steps']} eager, {r['late_captures']} late captures, "
        f"{r['compiles_after_warmup']} kernel compilations after the warm-up; {r['burst_steps']} burst steps "
        "(prompts alone beside waiting streams) in the timed runs"
    )
    if "speculative" in r:
        st = r["speculative"]
        lengths = st["verify_lengths"]
        rows = max(1, sum(lengths))
        print(
            f"  speculative: {st['accepted']} of {st['drafted']} drafts accepted "
            f"({st['accepted'] / max(1, st['drafted']):.0%}), {1 + st['accepted'] / max(1, st['verify_steps']):.2f} "
            f"tokens per verify, {sum(n * c for n, c in enumerate(lengths)) / rows:.2f} drafts verified per "
            f"decode row, {st['fixed_steps']} fixed-shape steps ({st.get('fed_steps', 0)} launched before the "
            f"last one was read, {st.get('joined', 0)} rows joining them with their own integers, "
            f"{st.get('carried', 0)} from the carry of {st.get('admitted', 0)} prompt steps launched beside them)"
        )
    if "profile" in r:
        busy = r["profile"]["gpu_busy"]
        print(
            f"  profile of 20 steps: {r['profile']['trace']}"
            + (f", GPU busy {busy:.1%} of the window" if busy is not None else "")
        )
        for name, t in r["profile"].get("kernels", {}).items():
            print(f"  {name} step ({t['note']}): GPU busy {t['gpu_busy_ms']:.2f} ms, {t['kernels']:.0f} kernels")


def add_bench_engine_parser(subparsers) -> None:
    from ..loading import add_model_args

    p = subparsers.add_parser(
        "engine",
        help="the serving engine's throughput in this process (no HTTP): tokens/s "
        "against the raw batched decode rate, host time per step",
    )
    add_model_args(p, "the shipped model")
    options.device_options(p)
    p.add_argument(
        "--clients",
        type=argtypes.positive_int,
        nargs="+",
        default=[16],
        help="requests in flight, one engine per value (default 16)",
    )
    p.add_argument(
        "--requests", type=argtypes.positive_int, default=None, help="requests per run (default 4 x clients)"
    )
    p.add_argument("--prompt-len", type=argtypes.positive_int, default=128, help="mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=argtypes.positive_int, default=64, help="mean output tokens (default 64)")
    p.add_argument(
        "--spread",
        type=argtypes.float_in(0.0, 1.0, hi_open=True),
        default=0.25,
        help="lengths uniform in mean*(1 +- spread) (default 0.25)",
    )
    p.add_argument("--repeats", type=argtypes.positive_int, default=3, help="timed runs per client count (default 3)")
    p.add_argument(
        "--max-batch-tokens",
        type=argtypes.positive_int,
        default=None,
        help="tokens per engine step (default: the engine's)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=argtypes.positive_int,
        default=None,
        help="tokens per step of prompts alone, no decode rows (default: the engine's, as `dsv4 serve`'s)",
    )
    p.add_argument(
        "--chunk-len",
        type=argtypes.positive_int,
        default=None,
        help="tokens per prompt-chunk slot of a bucketed step: a prompt of n tokens fills ceil(n / L) slots "
        "(default: the engine's, 64)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant numbers, as `dsv4 serve --deterministic` (its price is what this measures)",
    )
    options.add(p, "speculative")
    options.add(p, "speculative_threshold")
    options.add(p, "cuda_graph")
    p.add_argument("--no-raw", action="store_true", help="skip the raw batched decode measurement")
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="also write a profiler trace of 20 steps per client count and report GPU busy time",
    )
    options.add(p, "seed", default=0, note="of the prompts and lengths")
    p.add_argument("--out", metavar="FILE", default=None, help="write the result as JSON")
    options.add(p, "json")
    p.set_defaults(func=run_engine_bench, keep_quantized=False, quant_mode=None, no_mtp=False)
