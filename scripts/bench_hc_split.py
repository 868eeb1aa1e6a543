"""`hc_pre`'s forward by K split, per token count: which split `dsv4.ops.triton.mhc._split_plan` should pick.

    python3 scripts/bench_hc_split.py [--tokens 64 256 1024 2176 4096 8192] [--dim 1024] [--hc 4]

For each token count T: the time of one `hc_pre` call (the Triton backend, bf16 x [1, T, hc, dim]) with the
automatic plan ("auto") and with K forced into 1 (the single kernel), 2, 3, 4, 6, 8 and 16 slices
(`mhc.SPLIT_K`), and the bytes it must move (x read once, y written) per second. Each time is the median of
5 replays of a CUDA graph of 50 calls, captured after 3 warm-up calls. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from dsv4 import ops  # noqa: E402
from dsv4.ops.triton import mhc  # noqa: E402

SPLITS = (None, 1, 2, 3, 4, 6, 8, 16)


def time_ms(fn, calls: int = 50, repeats: int = 5) -> float:
    """Median ms per call of fn replayed from a CUDA graph of `calls` calls."""
    for _ in range(3):
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 2176, 4096, 8192])
    p.add_argument("--dim", type=int, default=1024, help="model dimension (small: 1024)")
    p.add_argument("--hc", type=int, default=4, help="hyper-connection copies")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hc_split: needs a CUDA GPU (it times Triton kernels)", file=sys.stderr)
        return 2
    dev, hc, d = torch.device("cuda"), args.hc, args.dim
    g = torch.Generator(device=dev).manual_seed(0)
    fn = torch.randn((2 + hc) * hc, hc * d, device=dev, generator=g) * 0.02
    scale, base = torch.ones(3, device=dev), torch.zeros((2 + hc) * hc, device=dev)
    print(f"hc_pre forward, hc={hc}, dim={d}, bf16, {torch.cuda.get_device_name()}: us per call (GB/s) by K split")
    for t in args.tokens:
        x = torch.randn(1, t, hc, d, device=dev, dtype=torch.bfloat16, generator=g)
        nbytes = x.numel() * 2 + t * d * 2
        cells = []
        try:
            for split in SPLITS:
                mhc.SPLIT_K = split
                ms = time_ms(lambda x=x: ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton"))
                cells.append(f"{'auto' if split is None else split}: {ms * 1e3:.1f} ({nbytes / ms / 1e6:.0f})")
        finally:
            mhc.SPLIT_K = None
        print(f"  T={t:>5}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
