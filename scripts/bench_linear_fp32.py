"""`ops.linear_fp32` (the fp32 projections: compressors, router, head) by backend, rows and shape, on CUDA.

    python3 scripts/bench_linear_fp32.py [--rows 1 4 16 64] [--shapes 256x256 1024x4096] [--reps 5] [--bf16-values]

For each weight shape N x K (fp32) and each row count M (bf16 activations, as a bf16 model's), every
backend that runs the call: the fp32 matmul ("reference"), the bf16x3 split (three bf16 parts in one
tensor-core GEMM, the split kept as a serving engine keeps it), the fixed-plan Triton kernel (deterministic
mode's): microseconds per call, the median (min-max) of --reps replays of a CUDA graph of
20 calls. Prints one JSON line per (shape, rows) and which backend the default selection runs there.
--bf16-values: weights that hold bf16 values (a checkpoint's BF16 head loaded into fp32), whose kept split
is its first part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4 import ops  # noqa: E402
from dsv4.bench.report import capture_graph  # noqa: E402

SHAPES = ("256x256", "128x256", "1024x4096", "512x4096", "256x4096", "4096x256", "129280x4096")


def per_call_us(fn, reps: int, calls: int = 20) -> tuple[float, float, float]:
    """(median, min, max) microseconds per call over `reps` replays of a graph of `calls` calls."""
    g = capture_graph(lambda: [fn() for _ in range(calls)])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="weight shapes NxK (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bf16-values", action="store_true", help="weights on the bf16 grid (one-part kept split)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a CUDA device")
    dev = torch.device("cuda")
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(k, n, bias=False, device=dev).requires_grad_(False)
        if a.bf16_values:
            lin.weight.copy_(lin.weight.bfloat16().float())
        ops.keep_splits(lin)  # (as a serving engine: the bf16 parts made once)
        w = lin.weight
        for m in a.rows:
            x = torch.randn(m, k, device=dev).bfloat16()
            row = {"shape": shape, "rows": m, "bf16_values": a.bf16_values}
            with torch.no_grad():
                for be in ops.backends("linear_fp32"):
                    if ops.refusal("linear_fp32", be, x, w) is not None:
                        continue
                    with ops.use_backend({"linear_fp32": be}):
                        med, lo, hi = per_call_us(lambda: ops.linear_fp32(x, w), a.reps)  # noqa: B023
                    row[be] = [round(med, 2), round(lo, 2), round(hi, 2)]
                with ops.which_ran() as ran:
                    ops.linear_fp32(x, w)
            row["default"] = ran["linear_fp32"][0]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
