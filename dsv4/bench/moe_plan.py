"""MoE routing plan on the GPU: the Triton counting sort (`triton_moe_plan`) against the stable-sort plan
(`moe_plan`). Checks every field bit for bit on several routings, then times both per call (host launches
included) and replayed from a CUDA graph (kernel time only), and counts the kernels one call launches.

    python3 -m dsv4.bench.moe_plan [--tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from ..errors import UserError
from ..ops.moe_shared import moe_plan
from ..ops.triton.moe import triton_moe_plan
from .ops import _graphed_ms
from .report import refused, require_cuda, time_ms

FIELDS = ("order", "token", "valid", "weight", "ends")

# name, k, local experts, expert offset, global experts
SHAPES = [
    ("small", 4, 32, 0, 32),
    ("k6_e256", 6, 256, 0, 256),
    ("ep_shard_e384", 6, 384, 384, 1536),
]


def _routing(kind: str, t: int, k: int, n_local: int, offset: int, n_global: int, device):
    g = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(t, n_global, device=device, generator=g)
    if kind == "skewed":  # a few hot experts, most nearly empty
        scores = scores ** torch.linspace(8.0, 0.5, n_global, device=device)
    idx = scores.topk(k, dim=-1).indices
    if kind == "one_expert":
        idx = torch.full_like(idx, offset)
    elif kind == "foreign":  # every slot on another rank's expert
        idx = idx + offset + n_local
    wts = torch.rand(t, k, device=device, generator=g)
    return wts, idx


def _kernels_per_call(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def check(t: int, device) -> list[dict]:
    """Both plans on every shape and routing, int64 and int32 ids, fp32 and bf16 weights."""
    rows = []
    for name, k, n_local, offset, n_global in SHAPES:
        for kind in ("random", "skewed", "one_expert", "foreign"):
            wts, idx = _routing(kind, t, k, n_local, offset, n_global, device)
            for w, i in ((wts, idx), (wts.bfloat16(), idx.int())):
                a, b = moe_plan(w, i, n_local, offset), triton_moe_plan(w, i, n_local, offset)
                bad = [
                    f
                    for f in FIELDS
                    if not (getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f)))
                ]
                rows.append({"shape": name, "routing": kind, "idx": str(i.dtype), "equal": not bad, "differ": bad})
    return rows


def timings(t: int, device) -> list[dict]:
    rows = []
    for name, k, n_local, offset, n_global in SHAPES:
        wts, idx = _routing("random", t, k, n_local, offset, n_global, device)
        for label, fn in (("sort (moe_plan)", moe_plan), ("triton counting sort", triton_moe_plan)):
            call = functools.partial(fn, wts, idx, n_local, offset)
            rows.append(
                {
                    "shape": name,
                    "T": t,
                    "k": k,
                    "E": n_local,
                    "plan": label,
                    "ms_per_call": round(time_ms(call, reps=50), 4),
                    "ms_graphed": round(_graphed_ms(call, reps=50), 4),
                    "kernels_per_call": _kernels_per_call(call),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        dev = require_cuda("python3 -m dsv4.bench.moe_plan", "it times the Triton counting sort on the GPU")
    except UserError as e:
        return refused(e)
    rows = check(args.tokens, dev)
    ok = all(r["equal"] for r in rows)
    rows += timings(args.tokens, dev)
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("all plans equal" if ok else "PLANS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
