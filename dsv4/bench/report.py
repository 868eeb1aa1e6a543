"""What the benchmarks share: the CUDA requirement (a refusal that names the reason, never a traceback),
timing with CUDA events and graphs, the measured limits and the rate columns of a timed row against them,
rows streamed as JSON lines, and the header of a printed run."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable

import torch

from ..errors import UserError
from ..ops.cuda_graphs import capturing


def require_cuda(bench: str, why: str = "") -> torch.device:
    """The CUDA device a GPU-only benchmark runs on; `UserError` naming the benchmark and the reason when
    this process has none (`why` adds what the CPU path would be, or how to run anyway)."""
    if not torch.cuda.is_available():
        raise UserError(f"{bench} needs a CUDA device and this process has none{'; ' + why if why else ''}")
    return torch.device("cuda")


def refused(e: UserError) -> int:
    """A `python -m dsv4.bench.<module>` entry point's refusal: one `error:` line on stderr, exit status 2."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def time_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median of per-call times in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn() captured in a CUDA graph, after three warm-up calls on a side stream (autotuning, allocator)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        fn()
    return graph


def measure_limits(device: torch.device) -> dict:
    """Measured bf16 matmul TFLOP/s (8192^3) and device copy bandwidth GB/s (1 GiB read + 1 GiB write)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ bm, reps=20)
    mm_tflops = 2 * 8192**3 / ms / 1e9
    src = torch.empty(1 << 29, device=device, dtype=torch.int16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=20)
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    return {"matmul_tflops": mm_tflops, "copy_gbs": copy_gbs}


def start_run(bench: str, why: str, stream: bool) -> tuple[torch.device, dict, list[dict]]:
    """A GPU-only run's device (`require_cuda`), measured limits and row list (a `Stream` that prints each
    row as a JSON line when `stream`, its first row the limits and the device)."""
    device = require_cuda(bench, why)
    torch.backends.cuda.matmul.allow_tf32 = False
    limits = measure_limits(device)
    rows: list[dict] = Stream() if stream else []
    if stream:
        rows.append({"limits": limits, "device": torch.cuda.get_device_name(device)})
    return device, limits, rows


def rates(ms: float, limits: dict, flops: float | None = None, nbytes: float | None = None) -> dict:
    """TFLOP/s and GB/s of a call that took `ms`, each with its share of the measured limit (bf16 matmul
    TFLOP/s `matmul_tflops`, copy GB/s `copy_gbs`); only the ones given."""
    r: dict = {}
    if flops is not None:
        r["tflops"] = round(flops / ms / 1e9, 1)
        r["of_matmul"] = round(r["tflops"] / limits["matmul_tflops"], 3)
    if nbytes is not None:
        r["gbs"] = round(nbytes / ms / 1e6, 1)
        r["of_copy"] = round(r["gbs"] / limits["copy_gbs"], 3)
    return r


def rate_columns(r: dict) -> str:
    """`  812.3 TFLOP/s (82% of matmul)   3120 GB/s (65% of copy)`: the rates a row has, else ''."""
    parts = []
    if "tflops" in r:
        parts.append(f"{r['tflops']:7.1f} TFLOP/s ({r['of_matmul']:.0%} of matmul)")
    if "gbs" in r:
        parts.append(f"{r['gbs']:7.0f} GB/s ({r['of_copy']:.0%} of copy)")
    return "  ".join(parts)


class Stream(list):
    """A list that also prints each appended row as one JSON line (partial results survive a timeout)."""

    def append(self, row: dict) -> None:
        super().append(row)
        print(json.dumps(row), flush=True)


def run_info(device: torch.device, limits: dict) -> dict:
    """Where and with what a run was measured: device name, torch and triton versions, date, limits."""
    triton = importlib.util.find_spec("triton")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__ if triton is not None else None,
        "date": time.strftime("%Y-%m-%d"),
        "limits": {k: round(v, 1) for k, v in limits.items()},
    }


def header(result: dict) -> list[str]:
    """The two lines a printed run starts with: the run info and the measured limits."""
    lim = result["limits"]
    return [
        f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['date']}",
        f"measured: bf16 matmul {lim['matmul_tflops']:.0f} TFLOP/s, copy {lim['copy_gbs']:.0f} GB/s",
    ]


def emit(result: dict, render, as_json: bool, as_jsonl: bool) -> int:
    """Print a finished run: nothing more with --jsonl (its rows were streamed), one JSON object with
    --json, else the table `render(result)`. Exit status 0."""
    if as_jsonl:
        return 0
    print(json.dumps(result) if as_json else render(result))
    return 0


def add_output_args(p) -> None:
    """--json (one JSON object at the end) and --jsonl (each row as a JSON line as it is measured)."""
    from .. import options

    options.add(p, "json")
    p.add_argument("--jsonl", action="store_true", help="print each result as a JSON line as it is measured")
