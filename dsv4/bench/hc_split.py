"""`hc_pre` / `hc_head` at decode sizes: the split-K path vs the single kernel.

For each (tokens, dim): which path the automatic rule takes, split vs single parity (fp32 summation order
only), split vs reference, bit-identical repeats of the split path, and the time of one call replayed
from a CUDA graph (kernel time without per-launch host cost).

    python3 -m dsv4.bench.hc_split [--dims 1024 4096] [--tokens 1 4 16 64 256]

On a CPU with TRITON_INTERPRET=1 it checks parity only (no timing; use small --dims).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import torch

import dsv4.ops as ops
from dsv4.ops import reference as R

from .report import capture_graph


def graph_us(fn: Callable[[], object], reps: int = 200) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph (warmed up outside the capture)."""
    graph = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(t: int, d: int, device: torch.device, timing: bool) -> dict:
    mhc = importlib.import_module("dsv4.ops.triton.mhc")
    g = torch.Generator(device=device).manual_seed(t * 7 + d)
    hc, mix = 4, 24
    x = torch.randn(t, 1, hc, d, device=device, generator=g).bfloat16()  # [b, s, hc, d]
    fn = torch.randn(mix, hc * d, device=device, generator=g) * (hc * d) ** -0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(mix, device=device, generator=g) * 0.3
    fh, sh, bh = fn[:hc].clone(), scale[:1].clone(), base[:hc].clone()
    row: dict = {"T": t, "D": d, "split": mhc._split_plan(t, hc * d, device)[0]}

    def pre():
        return ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton")

    def head():
        return ops.hc_head(x, fh, sh, bh, 1e-6, 1e-6, backend="triton")

    saved = mhc.SPLIT_K
    try:
        with torch.no_grad():
            ref = R.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
            ref_h = R.hc_head(x, fh, sh, bh, 1e-6, 1e-6)
            out = {}
            for name, mode in (("split", 32), ("single", 0)):
                mhc.SPLIT_K = mode
                out[name] = (pre(), head())
                if timing:
                    row[f"pre_{name}_us"] = round(graph_us(pre), 2)
                    row[f"head_{name}_us"] = round(graph_us(head), 2)
            mhc.SPLIT_K = 32
            again = (pre(), head())
    finally:
        mhc.SPLIT_K = saved
    (sp, sh_), (si, si_h) = out["split"], out["single"]
    row["split_vs_single"] = {
        "y": _max_rel(sp[0], si[0]),
        "post": _max_rel(sp[1], si[1]),
        "comb": _max_rel(sp[2], si[2]),
        "head": _max_rel(sh_, si_h),
    }
    row["split_vs_ref"] = {
        "y": _max_rel(sp[0], ref[0]),
        "post": _max_rel(sp[1], ref[1]),
        "comb": _max_rel(sp[2], ref[2]),
        "head": _max_rel(sh_, ref_h),
    }
    row["bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip([*again[0], again[1]], [*sp, sh_]))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for d in args.dims:
        for t in args.tokens:
            print(check(t, d, device, timing=device.type == "cuda"), flush=True)


if __name__ == "__main__":
    main()
