"""`hc_pre`'s forward by K split, per token count: which split `dsv4.ops.triton.mhc._split_plan` should pick.

    python3 scripts/bench_hc_split.py [--tokens 64 256 1024 2176 4096 8192] [--dim 1024] [--hc 4] [--anatomy]

For each token count T: the time of one `hc_pre` call (the Triton backend, bf16 x [1, T, hc, dim]) with the
automatic plan ("auto") and with K forced into 1 (the single kernel), 2, 3, 4, 6, 8 and 16 slices
(`mhc.SPLIT_K`), and the bytes it must move (x read once, y written) per second [GB/s]. Each time is the
median (min-max) of 5 replays of a CUDA graph of 50 calls, captured after 3 warm-up calls. Needs a CUDA GPU.

--anatomy times the single kernel instead, to see where its time goes: with 20 Sinkhorn iterations, with
1, without the comb columns and Sinkhorn (`hc_head`), and each of its autotuning configurations at 1 to 4
pipeline stages.

--finish times the split path's two kernels apart at the automatic plan (decode sizes: --tokens 4 64 256):
the partial kernel, then the finishing kernel (the sum of the partials, the epilogue, the weighted reduce)
with 20 and 1 Sinkhorn iterations at 4, 2 and 1 warps (it is launched at 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from dsv4 import ops  # noqa: E402
from dsv4.ops.triton import mhc, mhc_fn  # noqa: E402

SPLITS = (None, 1, 2, 3, 4, 6, 8, 16)


def time_ms(fn, calls: int = 50, repeats: int = 5) -> tuple[float, float, float]:
    """(median, min, max) ms per call of fn over `repeats` replays of a CUDA graph of `calls` calls."""
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
    return statistics.median(times), min(times), max(times)


def us(t: tuple[float, float, float]) -> str:
    """A time_ms result in us: median (min-max)."""
    return f"{t[0] * 1e3:.1f} ({t[1] * 1e3:.1f}-{t[2] * 1e3:.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 2176, 4096, 8192])
    p.add_argument("--dim", type=int, default=1024, help="model dimension (small: 1024)")
    p.add_argument("--hc", type=int, default=4, help="hyper-connection copies")
    p.add_argument("--anatomy", action="store_true", help="the single kernel's parts and configurations")
    p.add_argument("--finish", action="store_true", help="the split path's partial and finishing kernels apart")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hc_split: needs a CUDA GPU (it times Triton kernels)", file=sys.stderr)
        return 2
    dev, hc, d = torch.device("cuda"), args.hc, args.dim
    g = torch.Generator(device=dev).manual_seed(0)
    fn = torch.randn((2 + hc) * hc, hc * d, device=dev, generator=g) * 0.02
    scale, base = torch.ones(3, device=dev), torch.zeros((2 + hc) * hc, device=dev)
    if args.anatomy:
        return anatomy(args.tokens, hc, d, fn, scale, base, g)
    if args.finish:
        print(f"hc_pre split path, hc={hc}, dim={d}, bf16, {torch.cuda.get_device_name()}: us per call")
        for line in finish_kernels(args.tokens, hc, d, fn, scale, base, g, time_ms):
            print(line, flush=True)
        return 0
    print(f"hc_pre forward, hc={hc}, dim={d}, bf16, {torch.cuda.get_device_name()}: us per call [GB/s] by K split")
    for t in args.tokens:
        x = torch.randn(1, t, hc, d, device=dev, dtype=torch.bfloat16, generator=g)
        nbytes = x.numel() * 2 + t * d * 2
        cells = []
        try:
            for split in SPLITS:
                mhc.SPLIT_K = split
                t_ms = time_ms(lambda x=x: ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton"))
                cells.append(f"{'auto' if split is None else split}: {us(t_ms)} [{nbytes / t_ms[0] / 1e6:.0f}]")
        finally:
            mhc.SPLIT_K = None
        print(f"  T={t:>5}  " + "  ".join(cells), flush=True)
    return 0


def _launch_one(kernel, grid, args, kw) -> None:
    kernel[grid](*args, **kw)


def finish_kernels(tokens, hc, d, fn, scale, base, g, timer):
    """Per T, a line: the automatic split's partial kernel and its finishing kernel at several settings,
    launched with the arguments `mhc._launch_pre` gives them; timer(call) -> (median, min, max) ms."""
    dev = fn.device
    fpp, fcb = mhc_fn.make_split(fn, hc, False)
    p1 = mhc_fn.pp_width(hc)
    sc, bs = scale.float().contiguous(), base.float().contiguous()
    for t in tokens:
        split, ks = mhc._split_plan(t, hc * d, dev)
        if split == 1:
            yield f"  T={t:>5}  the automatic plan runs the single kernel"
            continue
        x = torch.randn(1, t, hc, d, device=dev, dtype=torch.bfloat16, generator=g)
        f32 = dict(dtype=torch.float32, device=dev)
        wpp, wcb, wss = (
            torch.empty(split, t, p1, **f32),
            torch.empty(split, t, hc * hc, **f32),
            torch.empty(split, t, **f32),
        )
        rows = triton.cdiv(t, mhc._SPLIT_BT)
        part_kw = dict(HC=hc, P1=p1, HEAD=False, BT=mhc._SPLIT_BT, BK=mhc._SPLIT_BK, UPCAST=mhc._INTERPRET)
        part_args = (x, fpp, fcb, wpp, wcb, wss, t, d, ks)
        part = partial(
            _launch_one, mhc._hc_pre_part_kernel, (rows, split), part_args, {**part_kw, "num_warps": mhc._SPLIT_WARPS}
        )
        f_grid, bt, ds = mhc.finish_grid(t, d, False, dev)
        y = torch.empty(1, t, d, dtype=x.dtype, device=dev)
        post, comb = torch.empty(1, t, hc, **f32), torch.empty(1, t, hc, hc, **f32)
        mix, rs = torch.empty(t, (2 + hc) * hc, **f32), torch.empty(t, **f32)
        fin_args = (wpp, wcb, wss, x, sc, bs, y, post, comb, mix, rs, t, d, ds, 1e-6, 1e-6)
        cells = [f"{split} slices; partial: {us(timer(part))}"]
        for iters in (20, 1):
            for warps in (4, 2, 1):
                kw = dict(SPLIT=split, ITERS=iters, HC=hc, P1=p1, HEAD=False, UPCAST=mhc._INTERPRET, BT=bt)
                kw.update(BD=mhc._FINISH_BD, num_warps=warps)
                call = partial(_launch_one, mhc._hc_pre_finish_kernel, f_grid, fin_args, kw)
                cells.append(f"finish {iters} iters {warps} warps: {us(timer(call))}")
        yield f"  T={t:>5}  " + "  ".join(cells)


def anatomy(tokens, hc, d, fn, scale, base, g) -> int:
    dev = fn.device
    print(f"hc_pre single kernel, hc={hc}, dim={d}, bf16, {torch.cuda.get_device_name()}: us per call")
    head_fn = fn[:hc].contiguous()
    for t in tokens:
        x = torch.randn(1, t, hc, d, device=dev, dtype=torch.bfloat16, generator=g)
        cells = []
        mhc.SPLIT_K = 1
        try:
            for label, call in (
                ("iters 20", lambda x=x: ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton")),
                ("iters 1", lambda x=x: ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 1, backend="triton")),
                ("head", lambda x=x: ops.hc_head(x, head_fn, scale[:1], base[:hc], 1e-6, 1e-6, backend="triton")),
            ):
                cells.append(f"{label}: {us(time_ms(call))}")
        finally:
            mhc.SPLIT_K = None
        print(f"  T={t:>5}  " + "  ".join(cells), flush=True)
        fpp, fcb = mhc_fn.make_split(fn, hc, False)
        xs = x.contiguous()
        y = torch.empty(1, t, d, dtype=x.dtype, device=dev)
        post = torch.empty(t, hc, device=dev)
        comb = torch.empty(t, hc, hc, device=dev)
        mix = torch.empty(t, (2 + hc) * hc, device=dev)
        rs = torch.empty(t, device=dev)
        sc, bs = scale.float().contiguous(), base.float().contiguous()
        args = (xs, fpp, fcb, sc, bs, y, post, comb, mix, rs, t, d, 1e-6, 1e-6)
        meta = dict(ITERS=20, HC=hc, P1=mhc_fn.pp_width(hc), HEAD=False, UPCAST=False)
        for cfg in mhc._PRE_CONFIGS:
            bt, bk, bd = cfg.kwargs["BT"], cfg.kwargs["BK"], cfg.kwargs["BD"]
            row = []
            for stages in (1, 2, 3, 4):
                kw = dict(meta, BT=bt, BK=bk, BD=bd, num_warps=cfg.num_warps, num_stages=stages)
                call = partial(_launch_one, mhc._hc_pre_fwd_kernel, (triton.cdiv(t, bt),), args, kw)
                row.append(f"{stages} stages: {us(time_ms(call))}")
            print(f"    BT={bt} BK={bk} BD={bd} warps={cfg.num_warps}: " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
