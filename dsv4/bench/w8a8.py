"""`dsv4 bench w8a8`: the W8A8 GEMMs on FP8 tensor cores against bf16 and the copy bandwidth, one run.

Three parts, each measured against limits taken in the same run (bf16 matmul at 8192^3, device copy):
- `gemm`: `fp8_gemm` on the V4-Flash linear shapes at M >= 1024 tokens (the GEMM on pre-quantized
  activations, and the whole W8A8 linear: `act_quant` + GEMM) vs a bf16 `torch.mm` of the same shape.
  Goal: >= 1.4x the bf16 rate.
- `experts`: the routed experts of one V4-Flash layer (256 experts, top-6, dim 4096, inter 2048) as MXFP4
  W8A8 (`quantized_moe_experts`) vs the same experts in bf16 (`moe_experts`, best of its backends).
  Goal: >= 1.0x the bf16 rate.
- `decode`: the same linears and experts at M <= 64 tokens: the weight bytes read per second (FP8: 1 byte
  per element + scales; MXFP4: half a byte + one scale per 32) vs the measured copy bandwidth (read +
  write). Goal: >= 60% of copy.

Every timed backend is first compared with the reference at the bench shape (relative L2, recorded). The
routed experts are timed by replaying a CUDA graph (the routing plan and the GEMMs are ~15 launches whose
host cost would otherwise be measured); the dense GEMMs by CUDA events around each call.
`--out FILE` writes the JSON result atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from .. import argtypes, formats, ops, options
from ..config import ModelConfig
from ..ops import reference as R
from .kernels import _rel
from .report import capture_graph, measure_limits, require_cuda, run_info
from .report import time_ms as _time_ms

GOALS = {"gemm": 1.4, "experts": 1.0, "decode": 0.6}


def flash_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of the linears a V4-Flash release stores as FP8 (wo_a runs in bf16 officially)."""
    return {
        "wq_a": (cfg.q_lora_rank, cfg.dim),
        "wq_b": (cfg.n_heads * cfg.head_dim, cfg.q_lora_rank),
        "wkv": (cfg.head_dim, cfg.dim),
        "wo_b": (cfg.dim, cfg.o_groups * cfg.o_lora_rank),
        "indexer.wq_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "shared.w1": (cfg.moe_inter_dim, cfg.dim),
        "shared.w2": (cfg.dim, cfg.moe_inter_dim),
    }


def _graphed_ms(fn, reps: int = 20, calls: int = 10) -> float:
    """Device time of one fn() call: `calls` calls captured in one CUDA graph (as the engine replays a step),
    the median replay over `calls`; no host launch overhead, which would hide a microsecond kernel."""

    def many():
        for _ in range(calls):
            fn()

    return _time_ms(capture_graph(many).replay, reps=reps) / calls


def _backends(op: str, *args) -> list[str]:
    """Registered fast backends of op that can run these inputs (reasons for the others in `skipped`)."""
    out = []
    for be in ops.backends(op):
        if be == "reference":
            continue
        try:
            ops.resolve(op, be, *args)
            out.append(be)
        except ops.BackendUnavailable:
            pass
    return out


def _skips(op: str, *args) -> dict[str, str]:
    out = {}
    for be in ops.backends(op):
        if be == "reference":
            continue
        try:
            ops.resolve(op, be, *args)
        except ops.BackendUnavailable as e:
            out[be] = str(e)
    return out


# ----------------------------------------------------------------------------- dense GEMMs
def bench_gemm(m: int, n: int, k: int, name: str, device, limits: dict, rows: list, part: str) -> None:
    g = torch.Generator(device=device).manual_seed(n + k)
    x = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = torch.randn(n, k, device=device, generator=g) * k**-0.5
    wb = w.bfloat16()
    wq, ws = formats.quantize_fp8(w, scale_fmt="ue8m0")
    q, s = ops.act_quant(x, R.ACT_BLOCK, True)
    shape = f"{name} M={m} N={n} K={k}"
    flops = 2 * m * n * k
    weight_bytes = n * k + ws.numel()
    peer = _graphed_ms(lambda: x @ wb.t())
    base = {"part": part, "shape": shape, "M": m, "N": n, "K": k}
    rows.append(
        {
            **base,
            "op": "bf16 torch.mm",
            "ms": round(peer, 4),
            "tflops": round(flops / peer / 1e9, 1),
            "of_matmul": round(flops / peer / 1e9 / limits["matmul_tflops"], 3),
        }
    )
    want = R.fp8_gemm(q, s, wq, ws, torch.float32)
    for be in _backends("fp8_gemm", q, s, wq, ws, torch.bfloat16):
        y = ops.fp8_gemm(q, s, wq, ws, torch.bfloat16, backend=be)
        err = _rel(y, want)
        ms = _graphed_ms(lambda be=be: ops.fp8_gemm(q, s, wq, ws, torch.bfloat16, backend=be))
        full = _graphed_ms(
            lambda be=be: ops.fp8_gemm(*ops.act_quant(x, R.ACT_BLOCK, True), wq, ws, torch.bfloat16, backend=be)
        )
        r = {
            **base,
            "op": "fp8_gemm",
            "backend": be,
            "ms": round(ms, 4),
            "rel_l2": round(err, 6),
            "tflops": round(flops / ms / 1e9, 1),
            "x_bf16": round(peer / ms, 3),
            "with_act_quant_ms": round(full, 4),
            "with_act_quant_x_bf16": round(peer / full, 3),
            "weight_gbs": round(weight_bytes / ms / 1e6, 0),
            "of_copy": round(weight_bytes / ms / 1e6 / limits["copy_gbs"], 3),
        }
        rows.append(r)
    for be, why in _skips("fp8_gemm", q, s, wq, ws, torch.bfloat16).items():
        rows.append({**base, "op": "fp8_gemm", "backend": be, "skipped": why})


# ----------------------------------------------------------------------------- routed experts
def _expert_weights(cfg: ModelConfig, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    e, d, i = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    out = {}
    for name, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
        bf, pk, sc = [], [], []
        for _ in range(0, e, 16):  # 16 experts at a time: bounded scratch
            w = torch.randn(min(16, e - len(bf) * 16), *shape, device=device, generator=g) * shape[-1] ** -0.5
            packed, scale = formats.quantize_mxfp4(w)
            bf.append(w.bfloat16())
            pk.append(formats.as_packed_bytes(packed))
            sc.append(formats.as_e8m0_bytes(scale))
            del w
        out[name] = (torch.cat(bf), torch.cat(pk), torch.cat(sc))
    return out


def bench_experts(t: int, cfg: ModelConfig, experts: dict, device, limits: dict, rows: list, part: str) -> None:
    g = torch.Generator(device=device).manual_seed(t)
    e, d, i, k = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    x = torch.randn(t, d, device=device, generator=g).bfloat16()
    idx = torch.rand(t, e, device=device, generator=g).topk(k, -1).indices
    wts = torch.rand(t, k, device=device, generator=g).softmax(-1)
    (b1, p1, s1), (b2, p2, s2), (b3, p3, s3) = experts["w1"], experts["w2"], experts["w3"]
    flops = 6 * t * k * d * i
    used = int(torch.unique(idx).numel())
    fp4_bytes = used * 3 * (d * i // 2 + d * i // 32)
    shape = f"experts T={t} k={k} E={e} D={d} I={i}"
    base = {"part": part, "shape": shape, "T": t, "experts_used": used}
    best_bf16 = None
    for be in _backends("moe_experts", x, wts, idx, b1, b2, b3, cfg.swiglu_limit):
        ms = _graphed_ms(lambda be=be: ops.moe_experts(x, wts, idx, b1, b2, b3, cfg.swiglu_limit, backend=be))
        rows.append(
            {**base, "op": "moe_experts bf16", "backend": be, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        )
        best_bf16 = ms if best_bf16 is None else min(best_bf16, ms)
    args = (x, wts, idx, p1, s1, p2, s2, p3, s3, cfg.swiglu_limit, 0, "fp4", "ue8m0")
    want = None
    if t <= 64 or e * i * d <= 1 << 28:
        want = R.quantized_moe_experts(*args)
    for be in _backends("quantized_moe_experts", *args):
        y = ops.quantized_moe_experts(*args, backend=be)
        ms = _graphed_ms(lambda be=be: ops.quantized_moe_experts(*args, backend=be))
        r = {
            **base,
            "op": "quantized_moe_experts fp4",
            "backend": be,
            "ms": round(ms, 4),
            "tflops": round(flops / ms / 1e9, 1),
            "weight_gbs": round(fp4_bytes / ms / 1e6, 0),
            "of_copy": round(fp4_bytes / ms / 1e6 / limits["copy_gbs"], 3),
        }
        if best_bf16 is not None:
            r["x_bf16"] = round(best_bf16 / ms, 3)
        if want is not None:
            r["rel_l2"] = round(_rel(y, want), 6)
        rows.append(r)
    for be, why in _skips("quantized_moe_experts", *args).items():
        rows.append({**base, "op": "quantized_moe_experts fp4", "backend": be, "skipped": why})


# ----------------------------------------------------------------------------- summary and entry point
def summarize(rows: list) -> dict:
    """Per part: the best ratio reached and whether it meets the goal."""
    out = {}
    for part, key in (("gemm", "x_bf16"), ("experts", "x_bf16"), ("decode", "of_copy")):
        vals = [r[key] for r in rows if r.get("part") == part and key in r]
        if vals:
            out[part] = {
                "goal": GOALS[part],
                "metric": key,
                "worst_best_backend": None,
                "min": min(vals),
                "max": max(vals),
            }
            # per shape, the best backend; then the worst shape
            by_shape: dict[str, float] = {}
            for r in rows:
                if r.get("part") == part and key in r:
                    by_shape[r["shape"]] = max(by_shape.get(r["shape"], 0.0), r[key])
            worst = min(by_shape.values())
            out[part]["worst_best_backend"] = worst
            out[part]["met"] = worst >= GOALS[part]
    return out


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_w8a8_bench(args: argparse.Namespace) -> int:
    device = require_cuda("dsv4 bench w8a8", "it times FP8 tensor-core GEMMs")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig.preset(args.preset)
    parts = set(args.only.split(",")) if args.only else {"gemm", "experts", "decode"}
    limits = measure_limits(device)
    rows: list[dict] = []
    t0 = time.time()
    linears = flash_linears(cfg)
    if "gemm" in parts:
        for m in args.tokens:
            for name, (n, k) in linears.items():
                bench_gemm(m, n, k, name, device, limits, rows, "gemm")
    if "decode" in parts:
        for m in args.decode_tokens:
            for name, (n, k) in linears.items():
                bench_gemm(m, n, k, name, device, limits, rows, "decode")
    if "experts" in parts or "decode" in parts:
        experts = _expert_weights(cfg, device)
        if "experts" in parts:
            for t in args.expert_tokens:
                bench_experts(t, cfg, experts, device, limits, rows, "experts")
        if "decode" in parts:
            for t in args.decode_tokens:
                bench_experts(t, cfg, experts, device, limits, rows, "decode")
        del experts
    result = {
        **run_info(device, limits),
        "cuda": torch.version.cuda,
        "preset": cfg.name,
        "goals": GOALS,
        "summary": summarize(rows),
        "rows": rows,
        "seconds": round(time.time() - t0, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        _write_atomic(Path(args.out), text)
    if args.json:
        print(text)
        return 0
    print(
        f"{result['device']}  torch {result['torch']} (CUDA {result['cuda']})  triton {result['triton']}  "
        f"{result['date']}"
    )
    print(f"measured: bf16 matmul {limits['matmul_tflops']:.0f} TFLOP/s, copy {limits['copy_gbs']:.0f} GB/s")
    for r in rows:
        if "skipped" in r:
            print(f"{r['part']:8s} {r['op']:26s} {r.get('backend', ''):10s} {r['shape']:44s} skipped: {r['skipped']}")
            continue
        extra = "  ".join(
            f"{k_}={r[k_]}" for k_ in ("tflops", "x_bf16", "with_act_quant_x_bf16", "of_copy", "rel_l2") if k_ in r
        )
        print(f"{r['part']:8s} {r['op']:26s} {r.get('backend', ''):10s} {r['shape']:44s} {r['ms']:9.3f} ms  {extra}")
    for part, sm in result["summary"].items():
        verdict = "met" if sm["met"] else "NOT met"
        print(
            f"goal {part}: {sm['metric']} >= {sm['goal']}: worst shape (best backend) {sm['worst_best_backend']} "
            f"-> {verdict}"
        )
    return 0


def add_bench_parsers(subparsers) -> argparse.ArgumentParser:
    """Adds `w8a8` to the `dsv4 bench` subcommands."""
    p = subparsers.add_parser("w8a8", help="FP8 GEMMs vs bf16, MXFP4 experts vs bf16, decode bandwidth (one run)")
    options.add(p, "preset", default="flash", note="whose shapes are timed")
    p.add_argument(
        "--tokens",
        type=argtypes.positive_int,
        nargs="+",
        default=[1024, 4096, 8192],
        help="token rows M of the dense GEMMs (default 1024 4096 8192)",
    )
    p.add_argument(
        "--expert-tokens",
        type=argtypes.positive_int,
        nargs="+",
        default=[1024, 4096],
        help="tokens per routed-experts call (default 1024 4096; x top-k slots)",
    )
    p.add_argument(
        "--decode-tokens",
        type=argtypes.positive_int,
        nargs="+",
        default=[1, 16, 64],
        help="token rows at decode sizes (default 1 16 64)",
    )
    p.add_argument("--only", default="", help="comma list: gemm,experts,decode (default all)")
    p.add_argument("--out", type=argtypes.path, help="write the JSON result to this file (atomically)")
    options.add(p, "json")
    options.add(p, "threads")
    p.set_defaults(func=run_w8a8_bench)
    return p
