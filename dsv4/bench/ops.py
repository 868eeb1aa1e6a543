"""`dsv4 bench ops`: the MoE, mHC and quantized-weight GEMM backends against the device's measured limits.

For each op, backend and shape it prints the time, the rate (TFLOP/s for GEMMs, GB/s for the memory-bound
mHC ops), the ratio to the bf16 matmul rate and copy bandwidth measured in the same run, and (where it
applies) the ratio to a plain bf16 `torch.mm` of the same shape, also measured in the same run.

Conventions: MoE FLOPs `6 * T*k * dim * inter` (three projections per routed slot); its "dense" peer is
`[T*k, dim] @ [dim, 2*inter]` plus `[T*k, inter] @ [inter, dim]` as two torch matmuls. mHC bytes: `hc_pre`
reads hc copies and writes one (bf16), `hc_post` reads hc copies plus f and writes hc copies; the
backward of `hc_post` reads g, f and the copies and writes their gradients. Quantized GEMMs count
`2*M*N*K`; their peer is the bf16 matmul of the same shape.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .. import argtypes, ops, options
from ..config import ModelConfig
from .e2e import _count_syncs
from .kernels import _rel
from .report import add_output_args, capture_graph, emit, header, rate_columns, rates, run_info, start_run
from .report import time_ms as _time_ms


def _row(
    rows: list,
    op: str,
    backend: str,
    shape: str,
    ms: float,
    limits: dict,
    *,
    flops: float | None = None,
    nbytes: float | None = None,
    peer_ms: float | None = None,
    **extra,
) -> dict:
    r = {"op": op, "backend": backend, "shape": shape, "ms": round(ms, 4), **rates(ms, limits, flops, nbytes)}
    if peer_ms is not None:
        r["of_same_shape_mm"] = round(peer_ms / ms, 3)
    r.update(extra)
    rows.append(r)
    return r


# ----------------------------------------------------------------------------- MoE
def _graphed_ms(fn, reps: int = 20) -> float:
    """Median ms of replaying fn() captured in a CUDA graph: the kernels' own time, without the host's
    per-launch cost (the routing plan and GEMMs are ~40 launches, at ~25 us of Python each)."""
    return _time_ms(capture_graph(fn).replay, reps=reps)


def moe_inputs(t: int, cfg: ModelConfig, device, seed: int = 0, balanced: bool = False):
    g = torch.Generator(device=device).manual_seed(seed)
    e, d, i, k = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    dt = torch.bfloat16
    x = torch.randn(t, d, device=device, generator=g).to(dt)
    w1 = (torch.randn(e, i, d, device=device, generator=g) * d**-0.5).to(dt)
    w3 = (torch.randn(e, i, d, device=device, generator=g) * d**-0.5).to(dt)
    w2 = (torch.randn(e, d, i, device=device, generator=g) * i**-0.5).to(dt)
    if balanced:
        idx = (torch.arange(t * k, device=device) % e).view(t, k)
    else:
        idx = torch.rand(t, e, device=device, generator=g).topk(k, -1).indices
    wts = torch.rand(t, k, device=device, generator=g).softmax(-1)
    return x, wts, idx, w1, w2, w3


def bench_moe(args, device, limits: dict, rows: list) -> None:
    cfg = ModelConfig.preset(args.preset)
    for routed in args.moe_routed:
        _bench_moe_shape(args, cfg, routed // cfg.n_activated_experts, device, limits, rows)


def _bench_moe_shape(args, cfg: ModelConfig, t: int, device, limits: dict, rows: list) -> None:
    d, inter, k = cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    x, wts, idx, w1, w2, w3 = moe_inputs(t, cfg, device)
    m = t * k
    flops = 6 * m * d * inter
    shape = f"T={t} k={k} E={cfg.n_routed_experts} D={d} I={inter}"
    a = torch.randn(m, d, device=device, dtype=torch.bfloat16)
    b13 = torch.randn(d, 2 * inter, device=device, dtype=torch.bfloat16)
    hh = torch.randn(m, inter, device=device, dtype=torch.bfloat16)
    b2 = torch.randn(inter, d, device=device, dtype=torch.bfloat16)
    dense_ms = _time_ms(lambda: (a @ b13, hh @ b2))
    _row(rows, "moe_dense_peer", "torch.mm", shape, dense_ms, limits, flops=flops)
    ref = None
    if args.check or args.reference:
        with torch.no_grad():
            ref = ops.moe_experts(x, wts, idx, w1, w2, w3, cfg.swiglu_limit, backend="reference")
    if args.reference:
        with torch.no_grad():
            ms = _time_ms(
                lambda: ops.moe_experts(x, wts, idx, w1, w2, w3, cfg.swiglu_limit, backend="reference"),
                reps=5,
                warmup=1,
            )
        _row(rows, "moe_experts", "reference", shape, ms, limits, flops=flops, peer_ms=dense_ms)
    for be in ("grouped", "triton"):
        try:
            with torch.no_grad():
                out = ops.moe_experts(x, wts, idx, w1, w2, w3, cfg.swiglu_limit, backend=be)
        except ops.BackendUnavailable as err:
            rows.append({"op": "moe_experts", "backend": be, "shape": shape, "skipped": str(err)})
            continue
        extra = {"rel": round(_rel(out, ref), 6)} if ref is not None else {}
        with torch.no_grad():
            ms = _time_ms(lambda be=be: ops.moe_experts(x, wts, idx, w1, w2, w3, cfg.swiglu_limit, backend=be))
        _row(rows, "moe_experts", be, shape, ms, limits, flops=flops, peer_ms=dense_ms, **extra)
        try:
            with torch.no_grad():
                gms = _graphed_ms(lambda be=be: ops.moe_experts(x, wts, idx, w1, w2, w3, cfg.swiglu_limit, backend=be))
            _row(rows, "moe_experts (CUDA graph)", be, shape, gms, limits, flops=flops, peer_ms=dense_ms)
        except RuntimeError as err:  # a host sync inside the op cannot be captured
            rows.append(
                {
                    "op": "moe_experts (CUDA graph)",
                    "backend": be,
                    "shape": shape,
                    "skipped": f"capture failed: {str(err)[:120]}",
                }
            )
        # forward + backward (training): 3x the forward FLOPs
        leaves = [t_.detach().clone().requires_grad_() for t_ in (x, wts, w1, w2, w3)]
        gout = torch.randn(t, d, device=device)

        def fwd_bwd(be=be, leaves=leaves, gout=gout):
            xx, ww, a1, a2, a3 = leaves
            y = ops.moe_experts(xx, ww, idx, a1, a2, a3, cfg.swiglu_limit, backend=be)
            torch.autograd.backward(y, gout)

        ms = _time_ms(fwd_bwd, reps=10)
        _row(rows, "moe_experts fwd+bwd", be, shape, ms, limits, flops=3 * flops, peer_ms=3 * dense_ms)


# ----------------------------------------------------------------------------- mHC
def hc_inputs(t: int, hc: int, d: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    mix = (2 + hc) * hc
    x = torch.randn(1, t, hc, d, device=device, generator=g).bfloat16()
    fn = torch.randn(mix, hc * d, device=device, generator=g) * (hc * d) ** -0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(mix, device=device, generator=g) * 0.3
    return x, fn, scale, base


def bench_mhc(args, device, limits: dict, rows: list) -> None:
    for d in args.hc_dims:
        _bench_mhc_shape(args, args.hc_tokens, 4, d, device, limits, rows)


def _bench_mhc_shape(args, t: int, hc: int, d: int, device, limits: dict, rows: list) -> None:
    x, fn, scale, base = hc_inputs(t, hc, d, device)
    shape = f"T={t} hc={hc} D={d}"
    pre_bytes = t * hc * d * 2 + t * d * 2
    post_bytes = t * hc * d * 2 * 2 + t * d * 2
    f = torch.randn(1, t, d, device=device).bfloat16()
    post = torch.rand(1, t, hc, device=device)
    comb = torch.rand(1, t, hc, hc, device=device)
    bes = (["reference"] if args.reference else []) + ["triton"]
    ref_pre = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="reference") if args.check else None
    ref_post = ops.hc_post(f, x, post, comb, backend="reference") if args.check else None
    for be in bes:
        with torch.no_grad():
            out = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend=be)
            extra = {}
            if ref_pre is not None:
                extra = {"rel_y": round(_rel(out[0], ref_pre[0]), 6), "rel_comb": round(_rel(out[2], ref_pre[2]), 8)}
            ms = _time_ms(lambda be=be: ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend=be))
            _row(rows, "hc_pre", be, shape, ms, limits, nbytes=pre_bytes, **extra)
            out = ops.hc_post(f, x, post, comb, backend=be)
            extra = {"rel": round(_rel(out, ref_post), 6)} if ref_post is not None else {}
            ms = _time_ms(lambda be=be: ops.hc_post(f, x, post, comb, backend=be))
            _row(rows, "hc_post", be, shape, ms, limits, nbytes=post_bytes, **extra)
        # backward passes
        lp = [t_.clone().requires_grad_() for t_ in (f, x, post, comb)]
        yp = ops.hc_post(*lp, backend=be)
        gp = torch.randn_like(yp)
        ms = _time_ms(lambda yp=yp, gp=gp, lp=lp: torch.autograd.grad(yp, lp, gp, retain_graph=True))
        _row(rows, "hc_post bwd", be, shape, ms, limits, nbytes=t * d * 2 * (hc * 4 + 2))
        lx = [t_.clone().requires_grad_() for t_ in (x, fn, scale, base)]

        def pre_fwd_bwd(be=be, lx=lx):
            y, p_, c_ = ops.hc_pre(*lx, 1e-6, 1e-6, 20, backend=be)
            torch.autograd.backward([y, p_, c_], [torch.ones_like(y), torch.ones_like(p_), torch.ones_like(c_)])

        ms = _time_ms(pre_fwd_bwd, reps=10)
        _row(rows, "hc_pre fwd+bwd", be, shape, ms, limits, nbytes=pre_bytes + t * d * 2 * (2 * hc + 1))


# ----------------------------------------------------------------------------- quantized GEMMs
def bench_quant(args, device, limits: dict, rows: list) -> None:
    for n, k in args.quant_shapes:
        _bench_quant_shape(args.quant_tokens, n, k, args.reference, device, limits, rows)


def _bench_quant_shape(m: int, n: int, k: int, with_reference: bool, device, limits: dict, rows: list) -> None:
    from .. import formats

    x = torch.randn(m, k, device=device).bfloat16()
    w = torch.randn(n, k, device=device) * k**-0.5
    wb = w.bfloat16()
    shape = f"M={m} N={n} K={k}"
    flops = 2 * m * n * k
    peer = _time_ms(lambda wb=wb: x @ wb.t())
    _row(rows, "bf16 matmul peer", "torch.mm", shape, peer, limits, flops=flops)
    q8, s8 = formats.quantize_fp8(w, scale_fmt="ue8m0")
    p4, s4 = formats.quantize_mxfp4(w)
    for op, wq, sq in (("fp8_linear", q8, s8), ("fp4_linear", p4, s4)):
        ref = ops.call(op, x, wq, sq, backend="reference")
        for be in (["reference"] if with_reference else []) + ["triton", "dequant_mm"]:
            try:
                y = ops.call(op, x, wq, sq, backend=be)
            except ops.BackendUnavailable as err:
                rows.append({"op": op, "backend": be, "shape": shape, "skipped": str(err)})
                continue
            ms = _time_ms(lambda op=op, wq=wq, sq=sq, be=be: ops.call(op, x, wq, sq, backend=be))
            _row(rows, op, be, shape, ms, limits, flops=flops, peer_ms=peer, rel=round(_rel(y, ref), 6))


# ----------------------------------------------------------------------------- parity at real shapes
def _rel64(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return round(float((a - b).norm() / b.norm().clamp_min(1e-30)), 6)


def parity_moe(device, rows: list) -> None:
    """Fwd + bwd of each MoE backend vs the reference: 16 local experts of 32 (half the slots belong to
    other ranks), NaN-poisoned allocator, bitwise repeats, host syncs per call."""
    from ..ops import reference as R

    g = torch.Generator(device=device).manual_seed(0)
    small = device.type != "cuda"  # CPU: a smoke run on the Triton interpreter
    t, d, inter, e, k, off = (64, 64, 32, 16, 4, 8) if small else (2048, 1024, 512, 16, 4, 8)
    x = torch.randn(t, d, device=device, generator=g).bfloat16()
    w1 = (torch.randn(e, inter, d, device=device, generator=g) * d**-0.5 * 3).bfloat16()
    w3 = (torch.randn(e, inter, d, device=device, generator=g) * d**-0.5 * 3).bfloat16()
    w2 = (torch.randn(e, d, inter, device=device, generator=g) * inter**-0.5).bfloat16()
    idx = torch.rand(t, 32, device=device, generator=g).topk(k, -1).indices
    wts = torch.rand(t, k, device=device, generator=g)
    gout = torch.randn(t, d, device=device, generator=g)

    def grads(fn):
        leaves = [t_.clone().requires_grad_() for t_ in (x, wts, w1, w2, w3)]
        y = fn(leaves[0], leaves[1], idx, *leaves[2:], 10.0, off)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, gout))

    ref = grads(R.moe_experts)
    for be in ("triton", "grouped"):
        try:
            res = grads(lambda *a, be=be: ops.moe_experts(*a, backend=be))
            ran = ops.last_backend("moe_experts")
            res2 = grads(lambda *a, be=be: ops.moe_experts(*a, backend=be))
            with torch.no_grad():
                yn = ops.moe_experts(x, wts, idx, w1, w2, w3, 10.0, off, backend=be)
                junk = torch.full((1 << (12 if small else 28),), float("nan"), device=device)
                del junk  # the next buffers reuse NaNs
                yp = ops.moe_experts(x, wts, idx, w1, w2, w3, 10.0, off, backend=be)
                n_sync = (
                    -1
                    if small
                    else _count_syncs(lambda be=be: ops.moe_experts(x, wts, idx, w1, w2, w3, 10.0, off, backend=be))
                )
            rows.append(
                {
                    "parity": "moe_experts",
                    "backend": be,
                    "ran": ran,
                    "rel": dict(zip(["y", "x", "weights", "w1", "w2", "w3"], [_rel64(a, b) for a, b in zip(res, ref)])),
                    "finite": all(bool(torch.isfinite(a).all()) for a in res),
                    "bitwise_repeat": all(torch.equal(a, b) for a, b in zip(res, res2)),
                    "nograd_rel": _rel64(yn, ref[0]),
                    "poisoned_equal": bool(torch.equal(yp, yn)),
                    "host_syncs_per_call": n_sync,
                }
            )
        except ops.BackendUnavailable as err:
            rows.append({"parity": "moe_experts", "backend": be, "skipped": str(err)})


def parity_mhc(device, rows: list) -> None:
    """hc_pre / hc_post fwd + bwd and hc_head vs the references at b=2, s=2048, hc=4, d=1024."""
    from ..ops import reference as R

    g = torch.Generator(device=device).manual_seed(1)
    b, s, hc, d = (1, 16, 4, 64) if device.type != "cuda" else (2, 2048, 4, 1024)
    xh = torch.randn(b, s, hc, d, device=device, generator=g).bfloat16()
    fn = torch.randn(24, hc * d, device=device, generator=g) * 0.02
    sc = torch.rand(3, device=device, generator=g) + 0.5
    bs = torch.randn(24, device=device, generator=g) * 0.3
    gy = [
        torch.randn(b, s, d, device=device, generator=g).bfloat16(),
        torch.randn(b, s, hc, device=device, generator=g),
        torch.randn(b, s, hc, hc, device=device, generator=g),
    ]

    def pre(fn_):
        leaves = [t_.clone().requires_grad_() for t_ in (xh, fn, sc, bs)]
        o = fn_(*leaves, 1e-6, 1e-6, 20)
        return list(o) + list(torch.autograd.grad(o, leaves, gy))

    r0 = pre(R.hc_pre)
    r1 = pre(lambda *a: ops.hc_pre(*a, backend="triton"))
    r2 = pre(lambda *a: ops.hc_pre(*a, backend="triton"))
    rows.append(
        {
            "parity": "hc_pre",
            "backend": "triton",
            "rel": dict(
                zip(["y", "post", "comb", "gx", "gfn", "gscale", "gbase"], [_rel64(a, b_) for a, b_ in zip(r1, r0)])
            ),
            "bitwise_repeat": all(torch.equal(a, b_) for a, b_ in zip(r1, r2)),
        }
    )
    f = torch.randn(b, s, d, device=device, generator=g).bfloat16()
    post = torch.rand(b, s, hc, device=device, generator=g) * 2
    comb = torch.rand(b, s, hc, hc, device=device, generator=g)
    go = torch.randn(b, s, hc, d, device=device, generator=g).bfloat16()

    def post_(fn_):
        leaves = [t_.clone().requires_grad_() for t_ in (f, xh, post, comb)]
        o = fn_(*leaves)
        return [o] + list(torch.autograd.grad(o, leaves, go))

    p0 = post_(R.hc_post)
    p1 = post_(lambda *a: ops.hc_post(*a, backend="triton"))
    rows.append(
        {
            "parity": "hc_post",
            "backend": "triton",
            "rel": dict(zip(["out", "gf", "gres", "gpost", "gcomb"], [_rel64(a, b_) for a, b_ in zip(p1, p0)])),
        }
    )
    fnh = torch.randn(hc, hc * d, device=device, generator=g) * 0.02
    with torch.no_grad():
        h1 = ops.hc_head(xh, fnh, sc[:1], bs[:hc], 1e-6, 1e-6, backend="triton")
        h0 = R.hc_head(xh, fnh, sc[:1], bs[:hc], 1e-6, 1e-6)
    rows.append({"parity": "hc_head", "backend": "triton", "rel": _rel64(h1, h0)})


def parity_quant(device, rows: list) -> None:
    """fp8 (E8M0 and fp32 block scales) and MXFP4 GEMMs vs dequantize-then-bf16-matmul, M=512, 2048x7168."""
    from .. import formats

    g = torch.Generator(device=device).manual_seed(2)
    m, n, k = (16, 64, 256) if device.type != "cuda" else (512, 2048, 7168)
    xq = torch.randn(m, k, device=device, generator=g).bfloat16()
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    for fmt in ("ue8m0", "fp32"):
        q, sq = formats.quantize_fp8(w, scale_fmt=fmt)
        y1 = ops.call("fp8_linear", xq, q, sq, backend="triton")
        y0 = torch.nn.functional.linear(xq, formats.dequantize_fp8(q, sq).bfloat16())
        rows.append(
            {"parity": "fp8_linear", "scales": fmt, "rel": _rel64(y1, y0), "ran": ops.last_backend("fp8_linear")}
        )
    p4, s4 = formats.quantize_mxfp4(w)
    y1 = ops.call("fp4_linear", xq, p4, s4, backend="triton")
    y0 = torch.nn.functional.linear(xq, formats.dequantize_mxfp4(p4, s4).bfloat16())
    rows.append(
        {"parity": "fp4_linear", "scales": "ue8m0", "rel": _rel64(y1, y0), "ran": ops.last_backend("fp4_linear")}
    )


def parity_elementwise(device, rows: list) -> None:
    """Round trips (bit-identical expected), Hadamard and compressor pooling (fp32 rounding) vs the
    reference at the model's shapes, on random inputs spread over many binades plus all-zero blocks."""
    from ..ops import reference as ref

    g = torch.Generator(device=device).manual_seed(3)
    t = 2048 if device.type == "cuda" else 16

    def spread(*shape, dtype=torch.bfloat16):
        x = torch.randn(*shape, device=device, generator=g)
        x = x * torch.exp2(torch.randint(-40, 40, shape[:-1] + (1,), device=device, generator=g).float())
        x[..., :64] = 0.0  # an all-zero block per row
        return x.to(dtype)

    cases = [
        ("fp8_round_trip", (spread(t, 512)[:, :448], 64)),
        ("fp4_round_trip", (spread(t, 64, 128), 32)),
        ("fp8_round_trip", (spread(t, 448, dtype=torch.float32), 64)),
        ("hadamard", (spread(t, 64, 128),)),
        (
            "compress_pool",
            (
                torch.randn(t // 4, 8, 512, device=device, generator=g),
                torch.randn(t // 4, 8, 512, device=device, generator=g) * 4,
            ),
        ),
    ]
    for op, args in cases:
        want = getattr(ref, op)(*args)
        got = ops.call(op, *args, backend="triton")
        rows.append(
            {
                "parity": op,
                "backend": "triton",
                "dtype": str(args[0].dtype).replace("torch.", ""),
                "shape": list(args[0].shape),
                "bit_identical": bool(torch.equal(got, want)),
                "rel": _rel64(got, want),
                "ran": ops.last_backend(op),
            }
        )
    parity_norm_rope(device, rows)


def parity_norm_rope(device, rows: list) -> None:
    """rms_norm and rope_tail fwd + bwd vs the reference at the small preset's shapes (bf16 activations,
    spread magnitudes): bit-identical share of the outputs and relative error; weight gradients repeatable."""
    from ..ops import reference as ref
    from .cases import norm_rope_cases

    s = 4096 if device.type == "cuda" else 8
    g = torch.Generator(device=device).manual_seed(4)
    for name, op, make in norm_rope_cases(device):
        args = list(make(s))
        x = args[0] * torch.exp2(torch.randint(-30, 30, args[0].shape[:-1] + (1,), device=device, generator=g)).to(
            args[0].dtype
        )
        args[0] = x
        grad = torch.randn(x.shape, device=device, generator=g).to(x.dtype)
        res = {}

        def fast(*a, op=op):
            return ops.call(op, *a, backend="triton")

        for be, fn in (("triton", fast), ("reference", getattr(ref, op))):
            leaves = [
                a.detach().clone().requires_grad_()
                if isinstance(a, torch.Tensor)
                and a.is_floating_point()
                and a.dim() > 0
                and (i == 0 or op == "rms_norm")
                else a
                for i, a in enumerate(args)
            ]
            y = fn(*leaves)
            y.backward(grad)
            res[be] = [y.detach()] + [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        for part, got, want in zip(("out", "dx", "dw"), res["triton"], res["reference"]):
            rows.append(
                {
                    "parity": op,
                    "case": name,
                    "part": part,
                    "backend": "triton",
                    "dtype": str(got.dtype).replace("torch.", ""),
                    "shape": list(got.shape),
                    "same_frac": round(float((got == want).float().mean()), 6),
                    "max_abs": float((got.double() - want.double()).abs().max()),
                    "rel": _rel64(got, want),
                }
            )


def bench_elementwise(args, device, limits: dict, rows: list) -> None:
    """The quantization round trips, Hadamard and compressor pooling at prefill (4x4096 tokens) and decode
    (1 token) shapes: triton vs the reference (bytes = input read + output written)."""
    from .cases import elementwise_cases

    for name, op, make in elementwise_cases(device):
        for phase, s in (("prefill", 4096), ("decode", 1)):
            a = make(s)
            out = ops.call(op, *a, backend="reference")
            nbytes = out.numel() * out.element_size() + sum(
                x.numel() * x.element_size() for x in a if isinstance(x, torch.Tensor)
            )
            for be in ("reference", "triton"):
                ms = _time_ms(lambda be=be, a=a, op=op: ops.call(op, *a, backend=be))
                _row(rows, op, be, f"{name} {phase} b=4 s={s}", ms, limits, nbytes=nbytes)
    bench_norm_rope(device, limits, rows)


def bench_norm_rope(device, limits: dict, rows: list) -> None:
    """rms_norm and rope_tail at the small preset's shapes, prefill (4096 tokens) and decode (1 token):
    forward, and forward + backward at prefill (bytes = inputs read + outputs written)."""
    from .cases import norm_rope_cases

    for name, op, make in norm_rope_cases(device):
        for phase, s in (("prefill", 4096), ("decode", 1)):
            a = make(s)
            out = ops.call(op, *a, backend="reference")
            tensors = [x for x in a if isinstance(x, torch.Tensor)]
            nbytes = out.numel() * out.element_size() + sum(x.numel() * x.element_size() for x in tensors)
            for be in ("reference", "triton"):
                ms = _time_ms(lambda be=be, a=a, op=op: ops.call(op, *a, backend=be))
                _row(rows, op, be, f"{name} {phase} s={s}", ms, limits, nbytes=nbytes)
            if phase != "prefill":
                continue
            x = a[0].detach().requires_grad_()
            grad = torch.randn_like(out)
            rest = [
                t.detach().requires_grad_() if op == "rms_norm" and isinstance(t, torch.Tensor) else t for t in a[1:]
            ]

            def fwd_bwd(be: str, x=x, rest=rest, grad=grad, op=op) -> None:
                ops.call(op, x, *rest, backend=be).backward(grad)

            # backward reads x (rms_norm) and the gradient, writes dx: about twice the forward's bytes
            for be in ("reference", "triton"):
                ms = _time_ms(lambda be=be: fwd_bwd(be))
                _row(rows, op, be, f"{name} fwd+bwd {phase} s={s}", ms, limits, nbytes=2 * nbytes)


def run_ops_bench(args: argparse.Namespace) -> int:
    """Entry point of `dsv4 bench ops`."""
    device, limits, rows = start_run(
        "dsv4 bench ops", "the Triton backends' CPU path is the interpreter, which is for tests, not timing", args.jsonl
    )
    t0 = time.time()
    parts = set(args.only.split(",")) if args.only else {"moe", "mhc", "quant"}
    if args.parity or "parity" in parts:
        parity_moe(device, rows)
        parity_mhc(device, rows)
        parity_quant(device, rows)
        parity_elementwise(device, rows)
    if "elementwise" in parts:
        bench_elementwise(args, device, limits, rows)
    if "moe" in parts:
        bench_moe(args, device, limits, rows)
    if "mhc" in parts:
        bench_mhc(args, device, limits, rows)
    if "quant" in parts:
        bench_quant(args, device, limits, rows)
    result = {**run_info(device, limits), "rows": list(rows), "seconds": round(time.time() - t0, 1)}
    return emit(result, render, args.json, args.jsonl)


def render(result: dict) -> str:
    """The printed table of a run: header, then per op, backend and shape its time, rates, share of the
    same-shape matmul and relative errors; parity rows as JSON, skipped rows with their reason."""
    lines = header(result)
    for r in result["rows"]:
        if "parity" in r:
            lines.append("parity " + json.dumps(r))
            continue
        if "skipped" in r:
            lines.append(f"{r['op']:22s} {r['backend']:10s} {r['shape']:40s} skipped: {r['skipped']}")
            continue
        peer = f"  {r['of_same_shape_mm']:.0%} of same-shape mm" if "of_same_shape_mm" in r else ""
        chk = {k_: v for k_, v in r.items() if k_.startswith("rel")}
        lines.append(
            f"{r['op']:22s} {r['backend']:10s} {r['shape']:40s} {r['ms']:9.3f} ms  {rate_columns(r)}{peer}"
            f"{'  ' + str(chk) if chk else ''}"
        )
    return "\n".join(lines)


def _shape(s: str) -> tuple[int, int]:
    try:
        n, k = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes NxK with positive integers, e.g. 4096x4096, got {s!r}") from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"takes NxK with positive integers, e.g. 4096x4096, got {s!r}")
    return n, k


def add_bench_parsers(subparsers) -> argparse.ArgumentParser:
    """Adds `ops` to the `dsv4 bench` subcommands (sets `func=run_ops_bench`)."""
    p = subparsers.add_parser("ops", help="time the MoE / mHC / quantized-GEMM backends vs measured limits")
    options.add(p, "preset", default="small", note="whose MoE shapes are timed")
    options.add(p, "threads")
    p.add_argument(
        "--moe-routed",
        type=argtypes.positive_int,
        nargs="+",
        default=[8192, 32768],
        help="routed (token, expert) slots T*k per MoE call",
    )
    p.add_argument("--hc-tokens", type=argtypes.positive_int, default=8192, help="tokens of the mHC shapes")
    p.add_argument(
        "--hc-dims",
        type=argtypes.positive_int,
        nargs="+",
        default=[1024, 4096],
        help="model dimensions of the mHC shapes",
    )
    p.add_argument("--quant-tokens", type=argtypes.positive_int, default=4096, help="tokens of the quantization shapes")
    p.add_argument(
        "--quant-shapes", type=_shape, nargs="+", default=[(4096, 4096), (2048, 7168)], help="weight shapes NxK"
    )
    p.add_argument("--only", default="", help="comma list: moe,mhc,quant,elementwise,parity")
    p.add_argument(
        "--parity",
        action="store_true",
        help="first check fwd+bwd parity vs the references at real shapes (poisoned memory, "
        "bitwise repeats, host syncs)",
    )
    p.add_argument("--reference", action="store_true", help="also time the torch reference")
    p.add_argument("--check", action="store_true", help="compare with the reference at the bench shapes")
    add_output_args(p)
    p.set_defaults(func=run_ops_bench)
    return p
