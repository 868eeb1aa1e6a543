"""Serving-step kernels by launch plan, on one GPU: what `dsv4.ops.triton` should pick (diagnostic figures).

    python3 scripts/bench_step_kernels.py [--only draw hc_pre pad accept plan route step indexer moe] [--out FILE]

- draw: the fused token draw (`gumbel_argmax`, backend "triton") of B rows (64, 256) of a 32,768-token
  vocabulary (fp32 logits, temperature 1) by columns per program (`split`) and warps; every plan must
  draw the same tokens (asserted).
- hc_pre: one `hc_pre` call (bf16 x [1, T, 4, 1024]) by the partial kernel's rows per program
  (`mhc._SPLIT_BT`) and warps, at serving step sizes T; the automatic K split at each.
- accept: the fixed-shape speculative step's acceptance (`speculative_accept`), the reference's ~60 kernels
  against the fused kernel, at the shipped model's vocabulary (4,096) and V4's (129,280), 1 to 64 rows of
  K = 2 or 3 drafts (bf16 logits, draft logits near them, every row sampled at temperature 1); both must
  give the same results (asserted: no decision of these inputs is within float64 rounding).
  `speculative_accept`'s preference rule comes from these figures.
- plan: a decode step's whole plan (`model.paged.plan_step`: `plan_window`, `plan_groups`, `plan_keep`,
  `plan_entries` and the indexer cells) for the `small` layout (ratios 4 and 128, 4,096 positions per
  sequence) at 4, 64 and 256 rows, the references' integer kernels against the Triton ones; the plans must
  be equal (asserted).
- route: the MoE router after its projection (`route`) at `small`'s 32 experts, top-4, and V4's 256, top-6,
  1 to 2,048 tokens, reference against the one-launch kernel; the same weights and indices (asserted).
- step: the raw graphed decode step (`small`) at 4 and 64 rows with the plan ops, the attention rows
  (`select_rows`, `attend_rows`), the router and the shared expert's activation (`clamped_swiglu`) on
  their references, then on the Triton kernels (3 runs each, alternating): what these fusions save per step.
- indexer: the serving engine's indexer call at decode (`indexer_topk`, `small`'s 16 heads of 128, top-256,
  8,192 positions per sequence: 2,048 candidates per row) for 64 and 256 rows, sequences at position 300
  and 8,000: the keys gathered by their candidates first (`keys[cand]`, as before 331e288) against the
  kernel reading the pool through the candidates; the same picks (asserted).
- moe: the routed experts (`moe_experts`, backend "triton", `small`'s 32 experts, top-4) at 256 to 8,192
  tokens: the autotuned tiles as they are, every row tile of 64, and a wider list of tile configs.
- pad: the raw graphed decode step (`model.decode_step`, `small` preset) at b and b + 1 rows: the price of
  one padding row in a step's matrix products.

Times are the median (min-max) of 5 replays of a CUDA graph of 20 calls (`bench_hc_split.time_ms`); the
raw decode step's, the median (min-max) of 3 timed runs of 64 steps. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hc_split import time_ms  # noqa: E402

from dsv4 import ops  # noqa: E402
from dsv4.ops.reference_plan import INDEX_OPS, PLAN_OPS  # noqa: E402
from dsv4.ops.triton import mhc  # noqa: E402
from dsv4.ops.triton import sampling as ts  # noqa: E402


def us(t: tuple[float, float, float]) -> list[float]:
    return [round(v * 1e3, 1) for v in t]


def draw(dev: torch.device, show) -> None:
    V = 32768
    for B in (64, 256):
        g = torch.Generator(device=dev).manual_seed(0)
        logits = torch.randn(B, V, device=dev, generator=g)
        temp = torch.ones(B, dtype=torch.float64, device=dev)
        greedy = torch.zeros(B, dtype=torch.bool, device=dev)
        seeds, counters = torch.arange(B, device=dev) * 7919, torch.arange(B, device=dev)
        want, _ = ts.triton_gumbel_argmax(logits, temp, greedy, seeds, counters)
        try:
            for warps in (4, 8):
                ts.NUM_WARPS = warps
                for split in (1024, 2048, 4096, 8192):
                    call = partial(ts.triton_gumbel_argmax, logits, temp, greedy, seeds, counters, split=split)
                    assert torch.equal(call()[0], want), "a launch plan changed the drawn tokens"
                    show(f"draw rows={B} warps={warps} split={split} us", us(time_ms(call, calls=20)))
        finally:
            ts.NUM_WARPS = 4


def hc_pre(dev: torch.device, show) -> None:
    d, hc = 1024, 4
    g = torch.Generator(device=dev).manual_seed(0)
    fn = torch.randn((2 + hc) * hc, hc * d, device=dev, generator=g) * 0.02
    scale, base = torch.ones(3, device=dev), torch.zeros((2 + hc) * hc, device=dev)
    keep = mhc._SPLIT_BT, mhc._SPLIT_WARPS
    try:
        for t in (65, 257, 449, 1341, 2049):
            x = torch.randn(1, t, hc, d, device=dev, dtype=torch.bfloat16, generator=g)
            for bt in (16, 32, 64):
                for warps in (4, 8):
                    mhc._SPLIT_BT, mhc._SPLIT_WARPS = bt, warps

                    def call(x=x):
                        return ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton")

                    plan = mhc._split_plan(t, hc * d, dev)
                    show(f"hc_pre tokens={t} rows={bt} warps={warps} split={plan[0]} us", us(time_ms(call, calls=20)))
    finally:
        mhc._SPLIT_BT, mhc._SPLIT_WARPS = keep


def accept(dev: torch.device, show) -> None:
    for B, K, V in ((1, 2, 4096), (4, 2, 4096), (64, 2, 4096), (4, 2, 129280), (64, 3, 129280)):
        g = torch.Generator(device=dev).manual_seed(0)
        logits = (torch.randn(B, K + 1, V, device=dev, generator=g) * 3).bfloat16()
        draft_logits = logits[:, :K].float() + torch.randn(B, K, V, device=dev, generator=g) * 0.5
        drafts = torch.randint(0, V, (B, K), device=dev, generator=g)
        n_drafts, temp = torch.full((B,), K, device=dev), torch.ones(B, dtype=torch.float64, device=dev)
        greedy, seeds = torch.zeros(B, dtype=torch.bool, device=dev), torch.arange(B, device=dev)
        args = (logits, draft_logits, drafts, n_drafts, temp, greedy, seeds, seeds * 7)
        outs = {}
        for be in ("reference", "triton"):
            call = partial(ops.speculative_accept, *args, backend=be)
            outs[be] = [t.tolist() for t in call()]
            show(f"accept rows={B} K={K} V={V} {be} us", us(time_ms(call, calls=20)))
        assert outs["reference"] == outs["triton"], "the fused acceptance differs from the reference"


STEP_OPS = (*INDEX_OPS, "route", "clamped_swiglu")


def plan(dev: torch.device, show) -> None:
    from dsv4.config import ModelConfig
    from dsv4.model.paged import BatchCache, plan_step, uniform_inputs

    cfg = ModelConfig.preset("small")
    for B in (4, 64, 256):
        cache = BatchCache(cfg, B, 4096, dev, torch.bfloat16)
        g = torch.Generator(device=dev).manual_seed(0)
        start = torch.randint(0, 4000, (B,), device=dev, generator=g)
        tokens = torch.zeros(B, 1, dtype=torch.long, device=dev)
        inp = uniform_inputs(tokens, start, cache.wtable, cache.ctable, cache.state, cache.layout)
        plans = {}
        for be in ("reference", "triton"):
            with ops.use_backend(dict.fromkeys(PLAN_OPS, be), inherit=True):
                call = partial(plan_step, inp, cache.layout)
                p = call()
                plans[be] = (
                    [p.window_write, p.window_idx]
                    + [
                        t
                        for rp in p.ratios.values()
                        for t in (rp.group_new, rp.group_ring, rp.entry_write, rp.ring_write)
                    ]
                    + [t for rp in p.ratios.values() for t in ([rp.visible] if rp.visible is not None else rp.cand)]
                )
                show(f"plan rows={B} {be} us", us(time_ms(call, calls=20)))
        assert all(torch.equal(a, b) for a, b in zip(plans["reference"], plans["triton"], strict=True)), "plans differ"


def route(dev: torch.device, show) -> None:
    for E, k in ((32, 4), (256, 6)):
        for T in (1, 64, 256, 2048):
            g = torch.Generator(device=dev).manual_seed(0)
            logits = torch.randn(T, E, device=dev, generator=g) * 3
            bias = torch.randn(E, device=dev, generator=g) * 0.05
            outs = {}
            for be in ("reference", "triton"):
                call = partial(ops.route, logits, bias, k, "sqrtsoftplus", 2.5, backend=be)
                outs[be] = call()[:2]
                show(f"route tokens={T} E={E} k={k} {be} us", us(time_ms(call, calls=20)))
            assert all(torch.equal(a, b) for a, b in zip(outs["reference"], outs["triton"])), "the router differs"


def indexer(dev: torch.device, show) -> None:
    h, d, n, topk, ratio = 16, 128, 2048, 256, 4
    for b in (64, 256):
        g = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(b * n + 1, d, device=dev, generator=g).bfloat16()  # the pool (row 0: trash)
        cand = 1 + torch.randperm(b * n, device=dev, generator=g).view(b, n)
        q = torch.randn(b, 1, h, d, device=dev, generator=g).bfloat16()
        w = torch.randn(b, 1, h, device=dev, generator=g) * (h * d) ** -0.5
        for at in (300, 8000):
            pos = torch.full((b, 1), at, device=dev)

            def gathered(q=q, keys=keys, cand=cand, w=w, pos=pos):
                return ops.indexer_topk(q, keys[cand], w, pos, ratio, topk, backend="triton")

            paged = partial(ops.indexer_topk, q, keys, w, pos, ratio, topk, cand, backend="triton")
            assert torch.equal(gathered(), paged()), "the paged indexer picks differently"
            show(f"indexer rows={b} position={at} gathered us", us(time_ms(gathered, calls=20)))
            show(f"indexer rows={b} position={at} paged us", us(time_ms(paged, calls=20)))


def step(dev: torch.device, show) -> None:
    from dsv4.bench.serve import _raw_decode_rate
    from dsv4.cli import build_parser
    from dsv4.serve.startup import EngineSpec, load

    argv = ["bench", "engine", "--preset", "small", "--device", "cuda"]
    model = load(EngineSpec.from_args(build_parser(argv).parse_args(argv)).resolved())[0]
    for b in (4, 64):
        ms: dict[str, list[float]] = {"reference": [], "triton": []}
        for _ in range(3):
            for be in ms:
                with ops.use_backend(dict.fromkeys(STEP_OPS, be), inherit=True):
                    ms[be].append(_raw_decode_rate(model, b, 128, 64, dev)["ms_per_step"])
        for be, v in ms.items():
            show(
                f"raw decode rows={b} step ops on {be} ms",
                [round(statistics.median(v), 3), round(min(v), 3), round(max(v), 3)],
            )


def pad(dev: torch.device, show) -> None:
    from dsv4.bench.serve import _raw_decode_rate
    from dsv4.cli import build_parser
    from dsv4.serve.startup import EngineSpec, load

    argv = ["bench", "engine", "--preset", "small", "--device", "cuda"]
    model = load(EngineSpec.from_args(build_parser(argv).parse_args(argv)).resolved())[0]
    for b in (64, 65, 256, 257):
        ms = [_raw_decode_rate(model, b, 128, 64, dev)["ms_per_step"] for _ in range(3)]
        show(f"raw decode rows={b} ms", [round(statistics.median(ms), 3), round(min(ms), 3), round(max(ms), 3)])


def moe(dev: torch.device, show) -> None:
    import triton

    from dsv4.ops.triton import moe as tm

    E, k, D, I = 32, 4, 1024, 512  # `small`'s experts
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3 = (torch.randn(E, I, D, device=dev, generator=g).bfloat16() * 0.03 for _ in range(2))
    w2 = torch.randn(E, D, I, device=dev, generator=g).bfloat16() * 0.03
    wide_gmm = tm._GMM_CONFIGS + [
        triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in ((128, 128, 8, 3), (128, 128, 4, 3), (256, 32, 8, 4), (128, 32, 4, 5), (64, 128, 4, 3))
    ]
    wide_swiglu = tm._SWIGLU_CONFIGS + [
        triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in ((64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (32, 64, 4, 4), (64, 32, 4, 5))
    ]
    kernels, block_m = (tm._gmm_tuned, tm._swiglu_tuned), tm._block_m
    plans = {"as is": None, "BM 64": 64, "wider configs": "wide"}
    try:
        for name, plan in plans.items():
            if plan == "wide":
                tm._gmm_tuned = triton.autotune(wide_gmm, key=["N", "K", "BM", "SCATTER_C", "GATHER_A"])(tm._gmm_kernel)
                tm._swiglu_tuned = triton.autotune(wide_swiglu, key=["N", "K", "BM"])(tm._gmm_kernel)
            elif plan is not None:
                tm._block_m = lambda n_rows, n_groups, bm=plan: bm
            for T in (256, 1340, 2048, 8192):  # decode rows, a mixed step, prompt steps
                x = torch.randn(T, D, device=dev, generator=g).bfloat16()
                wts, idx = torch.rand(T, E, device=dev, generator=g).topk(k, -1)
                call = partial(ops.moe_experts, x, wts.float(), idx, w1, w2, w3, 10.0, backend="triton")
                t = time_ms(call)
                show(f"moe T={T} {name} us", us(t))
                show(f"moe T={T} {name} TFLOP/s", [round(6 * T * k * D * I / v / 1e9) for v in (t[0], t[2], t[1])])
            tm._gmm_tuned, tm._swiglu_tuned = kernels
            tm._block_m = block_m
    finally:
        tm._gmm_tuned, tm._swiglu_tuned = kernels
        tm._block_m = block_m


SECTIONS = {"draw": draw, "hc_pre": hc_pre, "pad": pad, "accept": accept, "plan": plan, "route": route, "step": step}
SECTIONS |= {"indexer": indexer, "moe": moe}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=tuple(SECTIONS), default=list(SECTIONS), help="sections (default: all)")
    p.add_argument("--out", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step_kernels: needs a CUDA GPU (it times Triton kernels and CUDA graphs)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    out: dict[str, list] = {"gpu": torch.cuda.get_device_name(dev)}

    def show(key: str, value: list) -> None:
        out[key] = value
        print(f"{key}: {value[0]} ({value[1]}-{value[2]})", flush=True)

    for name in args.only:
        SECTIONS[name](dev, show)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
