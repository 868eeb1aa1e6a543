"""Decode with and without speculative decoding (the MTP draft, a DSpark draft), in one process.

    python3 scripts/bench_speculative.py [--device cuda] [--model DIR] [--tokens 256] [--k 1 2 3]
                                         [--dspark DIR [--dspark-k 3 5] [--threshold 0 0.5]]
                                         [--batch 4] [--temperature 1] [--profile] [--regions]
                                         [--backend OP=NAME ...]

Loads the model once (default: the shipped model; its MTP block drafts for --k), and with --dspark a
checkpoint of the same main model whose draft is DSpark (`dsv4 train --model DIR --draft dspark
--freeze-main --export DST`), which drafts for every --dspark-k and --threshold (the confidence head's
survival threshold, 0 = always k). Per setting (speculation off, k drafts) builds one engine, captures its
graphs and runs every prompt once untimed (so no timed run captures a graph or compiles a kernel), then
times --repeats runs over the prompts and prints the median tokens/s with min and max, the speed-up over
plain decoding, acceptance, tokens per verify step, drafts verified per decode row, how full the fixed-shape
steps ran (`batch_fill`: rows per fixed-shape step over --batch), and whether the tokens
equal plain decoding's (of the DSpark checkpoint's own main model for its settings). --batch B decodes B
prompts at once (the prompts in turn), each run B requests in one engine. --profile (CUDA) adds, per
setting, the kernels of 10 steps of a full batch under the torch profiler: GPU-busy ms and kernels per
step, and the largest kernels (a diagnostic: one profiled window, no spread). --regions (CUDA) adds, per
setting, 10 steps of a full batch run eagerly at the graphs' fixed shapes with the device synchronized
around the main model's blocks and each pass of the MTP block: kernels and device ms per step in each, and
in the rest of the step, with each region's largest kernels (`dsv4.bench.regions`; a diagnostic, not a
timing). --temperature T > 0 samples
(each request its own seed, the same in every run and setting; the sampled speculative step's rejection
sampling): the tokens then follow the model's distribution but are not plain decoding's draws, so
`same_tokens` is null; greedy decoding (the default, T = 0) must give plain decoding's tokens exactly.
--backend OP=NAME runs every setting with that backend of an op (`dsv4.ops.use_backend`; e.g.
speculative_accept=reference, to time a fused kernel against the reference it replaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4 import defaults, ops  # noqa: E402
from dsv4.checkpoint.load import load_pretrained  # noqa: E402
from dsv4.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from dsv4.tokenizer import Tokenizer  # noqa: E402

PROMPTS = (
    "def read_lines(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n",
)


def params(tokens: int, temperature: float, i: int) -> SamplingParams:
    """Request i's settings: greedy at temperature 0, else sampled with seed i (the same in every run)."""
    return SamplingParams(max_tokens=tokens, temperature=temperature, seed=i if temperature else None, ignore_eos=True)


def run(
    engine: Engine, prompts: list[list[int]], tokens: int, temperature: float = 0.0
) -> tuple[list[list[int]], float, dict]:
    """Prompts decoded together through a warm engine: (each one's tokens, seconds, the engine's speculative
    counters of this run)."""
    before = engine.metrics()["speculative"]  # (a copy of the counters)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(f"r{time.perf_counter_ns()}")
        engine.add_request(ids[-1], p, params(tokens, temperature, i))
    out: dict[str, list[int]] = {i: [] for i in ids}
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_tokens
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    after = engine.spec_stats
    diff = {k: after[k] - before[k] for k in after if k != "verify_lengths"}
    diff["verify_lengths"] = [a - b for a, b in zip(after["verify_lengths"], before["verify_lengths"])]
    return [out[i] for i in ids], time.perf_counter() - t0, diff


def batches(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    """A run's requests, b at a time: as many batches as prompts, batch i from prompt i on, in turn."""
    return [[prompts[(i + j) % len(prompts)] for j in range(b)] for i in range(len(prompts))]


def config(a: argparse.Namespace, prompts: list[list[int]], k: int, threshold: float, **kw) -> EngineConfig:
    """A setting's engine: a batch of --batch requests, k drafts, room for the longest prompt's output."""
    return EngineConfig(
        max_seqs=a.batch,
        speculative=k,
        speculative_threshold=threshold,
        prefix_caching=False,
        max_model_len=max(map(len, prompts)) + a.tokens + 8,
        **kw,
    )


def on_full_batch(engine: Engine, batch: list[list[int]], a: argparse.Namespace, fn: Callable):
    """fn(engine.step) once a full batch of requests has run 4 steps; then the requests run to their end."""
    for i, p in enumerate(batch):
        engine.add_request(f"prof{i}", p, params(a.tokens, a.temperature, i))
    for _ in range(4):
        engine.step()
    out = fn(engine.step)
    while engine.has_work():
        engine.step()
    return out


def profile(engine: Engine, batch: list[list[int]], a: argparse.Namespace) -> dict:
    """10 steps of a full batch under the torch profiler (after 4 steps): kernels and GPU time per step, and
    the device's idle time between its kernels (`dsv4.bench.device_profile.device_gaps`: short gaps are the spacing
    of a graph's kernels, long ones the device waiting on the host)."""
    from dsv4.bench.device_profile import kernel_gaps

    busy, n, rows, gaps = on_full_batch(engine, batch, a, lambda step: kernel_gaps(step, 10))
    top = [[name[:80], round(ms, 4), round(k, 1)] for name, ms, k in rows[:12]]
    return {
        "gpu_busy_ms_per_step": round(busy, 3),
        "kernels_per_step": round(n, 1),
        "idle_ms_per_step": gaps,
        "top_kernels": top,
    }


def regions(model, prompts: list[list[int]], k: int, threshold: float, a: argparse.Namespace) -> dict:
    """A full batch's steps by region (`dsv4.bench.regions.region_table`): 10 steps after 4, each run eagerly
    at its fixed shape (`pad_steps`: the graphs' kernels, launched one by one)."""
    from dsv4.bench.regions import region_table

    engine = Engine(model, config(a, prompts, k, threshold, cuda_graphs=False, pad_steps=True))
    return on_full_batch(engine, batches(prompts, a.batch)[0], a, lambda step: region_table(step, 10, model))


def measure(
    model, prompts: list[list[int]], k: int, threshold: float, a: argparse.Namespace
) -> tuple[dict, list[list[int]]]:
    """One setting: (its row, the tokens of its last timed run)."""
    engine = Engine(model, config(a, prompts, k, threshold, cuda_graphs=a.device.startswith("cuda")))
    engine.warmup()
    work = batches(prompts, a.batch)
    for b in work:  # untimed: every graph and kernel shape of the run
        run(engine, b, a.tokens, a.temperature)
    rates, outs = [], []
    stats = {
        "drafted": 0,
        "accepted": 0,
        "verify_steps": 0,
        "fixed_steps": 0,
        "fixed_rows": 0,
        "fed_steps": 0,
        "verify_lengths": [0] * 16,
    }
    timing, steps = dict(engine.timing), engine.stats["steps"]
    for _ in range(a.repeats):
        n, secs, outs = 0, 0.0, []
        for b in work:
            o, s, st = run(engine, b, a.tokens, a.temperature)
            outs += o
            n, secs = n + sum(map(len, o)), secs + s
            for key in ("drafted", "accepted", "verify_steps", "fixed_steps", "fixed_rows", "fed_steps"):
                stats[key] += st[key]
            stats["verify_lengths"] = [x + y for x, y in zip(stats["verify_lengths"], st["verify_lengths"])]
        rates.append(n / secs)
    row = {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}
    row["graph_refusals"] = engine.graph_backends["refused"]  # faster backends the graphs passed over
    # the engine's host phases per step over the timed runs (ms): where a step's time goes (`wait`: the
    # host waiting for the device's tokens; `launch`: building inputs and launching, and the device time a
    # step waits for without a separate read)
    n_steps = max(1, engine.stats["steps"] - steps)
    row["steps"] = n_steps
    row["host_ms_per_step"] = {k: round(1e3 * (v - timing[k]) / n_steps, 4) for k, v in engine.timing.items()}
    if k:
        rows = max(1, sum(stats["verify_lengths"]))
        row["acceptance"] = stats["accepted"] / max(1, stats["drafted"])
        row["tokens_per_verify"] = 1 + stats["accepted"] / max(1, stats["verify_steps"])
        row["drafts_verified_per_row"] = sum(i * c for i, c in enumerate(stats["verify_lengths"])) / rows
        row["verify_lengths"] = {i: c for i, c in enumerate(stats["verify_lengths"]) if c}
        # fixed-shape steps, and those launched before the last one was read (overlap)
        row["fixed_steps"], row["fed_steps"] = stats["fixed_steps"], stats["fed_steps"]
        # how full they ran: rows per fixed-shape step over the batch (a batch's rows end at different steps
        # under speculation, so its last steps run part empty; plain decoding's end together)
        fixed = stats["fixed_steps"]
        row["batch_fill"] = stats["fixed_rows"] / (fixed * a.batch) if fixed else None
    if a.profile and engine.device.type == "cuda":
        row["profile"] = profile(engine, work[0], a)
    del engine
    if a.regions:  # a diagnostic: where it fails, its row says why and the timings above still stand
        try:
            row["regions"] = regions(model, prompts, k, threshold, a)
        except Exception as e:  # noqa: BLE001
            row["regions"] = {"error": f"{type(e).__name__}: {e}"}
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="*", default=[1, 2, 3], help="MTP drafts per step (none: skip MTP)")
    ap.add_argument("--dspark", default=None, metavar="DIR", help="the same main model with a DSpark draft")
    ap.add_argument("--dspark-k", type=int, nargs="+", default=[3], help="DSpark drafts per step at most")
    ap.add_argument(
        "--threshold",
        type=float,
        nargs="+",
        default=[0.0],
        help="DSpark survival thresholds of the verify length (0 = always k)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per setting (default 5): median, min, max")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded at once (default 1)")
    ap.add_argument("--profile", action="store_true", help="CUDA: the kernels of 10 steps per setting (diagnostic)")
    ap.add_argument(
        "--regions",
        action="store_true",
        help="CUDA: 10 eager fixed-shape steps per setting by region: blocks, MTP passes, the rest (diagnostic)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy; T > 0: sampled, each request its own fixed seed (tokens not compared)",
    )
    ap.add_argument(
        "--backend",
        nargs="+",
        default=[],
        metavar="OP=NAME",
        help="run with this backend of an op (e.g. speculative_accept=reference)",
    )
    a = ap.parse_args()
    backends = dict(b.split("=", 1) for b in a.backend if "=" in b)
    if len(backends) != len(a.backend) or any(op not in ops.ops() for op in backends):
        ap.error(f"--backend takes OP=NAME with OP one of dsv4.ops.ops(), got {a.backend}")
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    if a.regions and not a.device.startswith("cuda"):
        ap.error("--regions times kernels by region: it needs --device cuda")
    if not 0 <= a.temperature <= 100:
        ap.error(f"--temperature must be in [0, 100], got {a.temperature}")
    path = a.model or defaults.shipped_model_dir()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32  # the fused GPU kernels' dtype
    model = load_pretrained(path, device=a.device, dtype=dtype, progress=False).eval()
    tok = Tokenizer.from_file(path)
    prompts = [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    result = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "tokens": a.tokens,
        "batch": a.batch,
        "repeats": a.repeats,
        "temperature": a.temperature,
        "backends": backends,
        "settings": {},
    }
    settings = [("plain", model, 0, 0.0)] + [(f"mtp k={k}", model, k, 0.0) for k in a.k if k]
    dspark = None
    if a.dspark:
        dspark = load_pretrained(a.dspark, device=a.device, dtype=dtype, progress=False).eval()
        if not dspark.cfg.dspark:
            raise SystemExit(f"error: {a.dspark}: the model's draft is not DSpark")
        settings += [("dspark plain", dspark, 0, 0.0)] + [
            (f"dspark k={k} threshold={t}", dspark, k, t) for k in a.dspark_k for t in a.threshold
        ]
    plain: dict[int, list[list[int]]] = {}
    for name, m, k, t in settings:
        with ops.use_backend(backends or None, inherit=True):
            row, outs = measure(m, prompts, k, t, a)
        if not k:
            plain[id(m)] = outs
        row["same_tokens"] = outs == plain[id(m)] if not a.temperature else None
        base = result["settings"]["plain"]["tokens_per_s"] if name != "plain" else row["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / base
        if name != "plain":
            row["speedup_min_max"] = [
                row["min"] / result["settings"]["plain"]["max"],
                row["max"] / result["settings"]["plain"]["min"],
            ]
        result["settings"][name] = row
        print(f"{name}: " + json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
