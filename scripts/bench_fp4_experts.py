"""The MXFP4 routed experts at decode sizes: which split-K layout `dsv4.ops.triton.w8a8_decode` should use.

    python3 scripts/bench_fp4_experts.py [--preset flash] [--tokens 1 16 64] [--row-tiles 0 1 2 4 8]
                                         [--programs 2 8 16] [--repeats 3]

For each token count T (top-k routed, random router): one `quantized_moe_experts` call on MXFP4 experts of
the preset's shapes, timed for the dense grouped kernel (`triton`), for the split-K backend (`triton_splitk`)
at every row tile (`FP4_ROW_TILE`: 0 = 64-row tensor-core tiles, else that many rows on the CUDA cores)
and programs per SM (`GROUPED_PROGRAMS_PER_SM`, the K split's target), and for the same experts in bf16
(`moe_experts`, its default backend). Each time is the median (min-max) of --repeats timings, each the
median replay of a CUDA graph of 10 calls (`dsv4 bench w8a8`'s timing); the weight bytes read per second;
the relative L2 error against the reference (up to 16 tokens). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from dsv4 import ops  # noqa: E402
from dsv4.bench.w8a8 import _expert_weights, _graphed_ms  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.ops import reference as R  # noqa: E402
from dsv4.ops.triton import w8a8_decode as wd  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) us per call."""
    us = [_graphed_ms(fn) * 1e3 for _ in range(repeats)]
    return statistics.median(us), min(us), max(us)


def bench_tokens(t: int, cfg: ModelConfig, experts: dict, args: argparse.Namespace) -> None:
    """Every layout at t tokens, one line each."""
    dev = torch.device("cuda")
    (b1, p1, s1), (b2, p2, s2), (b3, p3, s3) = experts["w1"], experts["w2"], experts["w3"]
    e, d, inter, k = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, d, device=dev, generator=g).bfloat16()
    idx = torch.rand(t, e, device=dev, generator=g).topk(k, -1).indices
    wts = torch.rand(t, k, device=dev, generator=g).softmax(-1)
    call = (x, wts, idx, p1, s1, p2, s2, p3, s3, cfg.swiglu_limit, 0, "fp4", "ue8m0")
    mb = int(torch.unique(idx).numel()) * 3 * (d * inter // 2 + d * inter // 32) / 1e6
    want = R.quantized_moe_experts(*call).float() if t <= 16 else None
    bf16 = timed(lambda: ops.moe_experts(x, wts, idx, b1, b2, b3, cfg.swiglu_limit), args.repeats)
    print(f"T={t}: {mb:.1f} MB of FP4 weights and scales; bf16 experts {bf16[0]:.1f} ({bf16[1]:.1f}-{bf16[2]:.1f}) us")
    layouts = [("triton", None, None)] + [("triton_splitk", r, n) for r in args.row_tiles for n in args.programs]
    for backend, row_tile, programs in layouts:
        if row_tile is not None:
            wd.FP4_ROW_TILE, wd.GROUPED_PROGRAMS_PER_SM = row_tile, programs
        name = backend if row_tile is None else f"splitk rows {row_tile} programs {programs}"
        y = ops.quantized_moe_experts(*call, backend=backend).float()
        err = f"{float((y - want).norm() / want.norm()):.1e}" if want is not None else "-"
        med, lo, hi = timed(lambda b=backend: ops.quantized_moe_experts(*call, backend=b), args.repeats)
        print(
            f"  {name:32s} {med:8.1f} ({lo:.1f}-{hi:.1f}) us  {mb / med:6.2f} TB/s"
            f"  {bf16[0] / med:5.2f}x bf16  rel {err}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="flash", help="the experts' shapes (default: flash)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64], help="tokens per call (default 1 16 64)")
    p.add_argument("--row-tiles", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="FP4_ROW_TILE values")
    p.add_argument("--programs", type=int, nargs="+", default=[2, 8, 16], help="GROUPED_PROGRAMS_PER_SM values")
    p.add_argument("--repeats", type=int, default=3, help="timings per figure (default 3)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp4_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = ModelConfig.preset(args.preset)
    experts = _expert_weights(cfg, torch.device("cuda"))
    shapes = f"{cfg.n_routed_experts} experts, D {cfg.dim}, I {cfg.moe_inter_dim}"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.preset}: {shapes}")
    for t in args.tokens:
        bench_tokens(t, cfg, experts, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
