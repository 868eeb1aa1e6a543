"""`dsv4 bench kernels`: time the attention kernels against the device's measured limits.

For each kernel and shape it prints the time, the rate (TFLOP/s or GB/s), the ratio to the bf16 matmul
rate and to the copy bandwidth measured in the same run, and the speed-up over the plain-torch reference.
`--check` first compares each kernel with the reference at the benchmark shape (relative L2).
`--sweep` times a few launch configurations per kernel and keeps the fastest for the rest of the run.

FLOP conventions: sparse attention forward `4*b*s*h*k*d` (QK^T and PV over k keys per query), backward
2.5x that; indexer scoring `2*b*s*n*h*d` over all (query, key) pairs; decode counts the KV bytes
gathered (`b*s*k*d*elem`) plus q and o.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from .. import argtypes, options
from .report import Stream, add_output_args, emit, header, rate_columns, rates, run_info, start_run
from .report import time_ms as _time_ms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- inputs
def attention_inputs(
    b: int, s: int, h: int, d: int, k: int, n: int, device, dtype=torch.bfloat16, window: int = 128, seed: int = 0
):
    """q, kv, sink, idx like a V4 compressed layer: a causal window of `window` keys + random picks."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
    kv = torch.randn(b, n, d, device=device, dtype=dtype, generator=g)
    sink = torch.randn(h, device=device, generator=g)
    t = torch.arange(s, device=device).view(1, s, 1)
    w = min(window, k)
    win = t - torch.arange(w, device=device).view(1, 1, w)  # [1, s, w]
    win = torch.where(win >= 0, win, -1).expand(b, s, w)
    rest = torch.randint(0, n, (b, s, k - w), device=device, generator=g)
    idx = torch.cat([win, rest], -1).contiguous()
    return q, kv, sink, idx


def indexer_inputs(b: int, s: int, h: int, d: int, n: int, device, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, n, d, device=device, dtype=dtype, generator=g)
    w = torch.randn(b, s, h, device=device, generator=g) * (h * d) ** -0.5
    return q, k, w


# ----------------------------------------------------------------------------- sweeps
def _sweep(name: str, target: dict, candidates: list[dict], fn: Callable[[], object], rows: list) -> None:
    """Time `fn` under each candidate config (updating `target` in place); keep the fastest."""
    best, best_ms = dict(target), math.inf
    for cand in candidates:
        target.clear()
        target.update(cand)
        try:
            ms = _time_ms(fn, reps=5, warmup=1)
        except Exception as e:  # a config that does not compile or run (e.g. out of shared memory)
            rows.append({"sweep": name, "config": cand, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"sweep": name, "config": cand, "ms": ms})
        if ms < best_ms:
            best, best_ms = dict(cand), ms
    target.clear()
    target.update(best)
    rows.append({"sweep": name, "chosen": best, "ms": best_ms})


def _sweeps(args, device, rows: list, parts: set[str]) -> None:
    from dsv4.ops.triton import indexer as ix
    from dsv4.ops.triton import sparse_attention as sa

    if "attention" in parts:
        _attention_sweeps(args, device, rows, sa)
    if "indexer" in parts:
        _indexer_sweeps(args, device, rows, ix)


def _indexer_sweeps(args, device, rows: list, ix) -> None:
    iq, ik, iw = indexer_inputs(1, args.seq, args.index_heads, args.index_dim, args.index_keys, device)
    pos = torch.arange(args.seq, device=device) + args.index_keys * args.ratio
    sc_c = [
        {"BLOCK_M": m, "BLOCK_N": nn, "num_warps": w, "num_stages": st}
        for m, nn, w, st in ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 256, 8, 3))
    ]
    _sweep("index_score", ix.SCORE_CONFIG, sc_c, lambda: ix.indexer_scores_fwd(iq, ik, iw, pos, args.ratio), rows)
    g = torch.randn(1, args.seq, args.index_keys, device=device)
    bw_c = [
        {"BLOCK_M": m, "BLOCK_N": nn, "num_warps": w, "num_stages": st}
        for m, nn, w, st in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2))
    ]
    _sweep("index_bwd", ix.BWD_CONFIG, bw_c, lambda: ix.indexer_scores_bwd(iq, ik, iw, pos, args.ratio, g), rows)


def _attention_sweeps(args, device, rows: list, sa) -> None:
    q, kv, sink, idx = attention_inputs(1, args.seq, args.heads, args.dim, args.topk, args.seq, device)
    scale = args.dim**-0.5
    fwd_c = [
        {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "D_SPLIT": ds}
        for bh, bn, w, st, ds in (
            (64, 64, 8, 2, 1),
            (64, 64, 8, 2, 2),
            (64, 64, 4, 2, 2),
            (64, 32, 4, 3, 2),
            (64, 128, 8, 2, 2),
        )
    ]
    _sweep("attn_fwd", sa.FWD_CONFIG, fwd_c, lambda: sa.sparse_attention_fwd(q, kv, sink, idx, scale, 1), rows)
    o_lo = torch.empty_like(q)
    o, lse = sa.sparse_attention_fwd(q, kv, sink, idx, scale, 1, o_lo=o_lo)
    do = torch.randn_like(o)
    bwd = lambda: sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, False, o_lo)  # noqa: E731
    dkv_c = [{"BLOCK_N": bn, "num_warps": w, "num_stages": st} for bn, w, st in ((32, 8, 2), (32, 8, 1), (32, 16, 2))]
    _sweep("attn_bwd_dkv_pass", sa.DKV_CONFIG, dkv_c, bwd, rows)
    bwd_c = [
        {"mode": mode, "BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
        for mode, bh, bn, w, st in (
            ("two_pass", 64, 64, 8, 1),
            ("two_pass", 64, 128, 8, 1),
            ("two_pass", 64, 64, 16, 1),
            ("two_pass", 64, 32, 8, 2),
        )
    ]
    _sweep(
        "attn_bwd",
        sa.BWD_CONFIG,
        bwd_c,
        lambda: sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, False, o_lo),
        rows,
    )
    qd, kvd, sinkd, idxd = attention_inputs(args.decode_batch, 1, args.heads, args.dim, args.topk, args.seq, device)
    dec_c = [
        {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "max_splits": ms, "D_SPLIT": ds}
        for bh, bn, w, st, ms, ds in (
            (64, 32, 8, 3, 1, 1),
            (64, 32, 4, 3, 1, 2),
            (64, 32, 4, 3, 1, 4),
            (64, 64, 4, 2, 1, 4),
            (64, 32, 4, 3, 4, 2),
        )
    ]
    _sweep("attn_decode", sa.DECODE_CONFIG, dec_c, lambda: sa.sparse_attention_fwd(qd, kvd, sinkd, idxd, scale), rows)


# ----------------------------------------------------------------------------- benchmarks
def _row(
    name: str,
    shape: str,
    ms: float,
    limits: dict,
    flops: float | None = None,
    nbytes: float | None = None,
    ref_ms: float | None = None,
    **extra,
) -> dict:
    r = {"kernel": name, "shape": shape, "ms": round(ms, 4), **rates(ms, limits, flops or None, nbytes or None)}
    if ref_ms is not None:
        r["ref_ms"] = round(ref_ms, 3)
        r["speedup"] = round(ref_ms / ms, 1)
    r.update(extra)
    return r


def _bench_attention(args, device, limits: dict, rows: list) -> None:
    from dsv4.ops import reference as ref
    from dsv4.ops.triton import sparse_attention as sa

    b, s, h, d, k = 1, args.seq, args.heads, args.dim, args.topk
    n = s
    scale = d**-0.5
    q, kv, sink, idx = attention_inputs(b, s, h, d, k, n, device)
    shape = f"b={b} s={s} h={h} d={d} k={k}"
    flops = 4 * b * s * h * k * d
    fwd = lambda: sa.sparse_attention_fwd(q, kv, sink, idx, scale, 1)  # noqa: E731
    ms = _time_ms(fwd)
    o_lo = torch.empty_like(q)
    o, lse = sa.sparse_attention_fwd(q, kv, sink, idx, scale, 1, o_lo=o_lo)
    do = torch.randn_like(o)
    ref_ms = ref_bwd_ms = None
    extra: dict = {}
    if args.reference or args.check:
        qr, kvr, sr = (x.detach().clone().requires_grad_() for x in (q, kv, sink))
        ref_fwd = lambda: ref.sparse_attention(qr, kvr, sr, idx, scale)  # noqa: E731
        if args.reference:
            with torch.no_grad():
                ref_ms = _time_ms(ref_fwd, reps=3, warmup=1)
        if args.check:
            ro, rl = ref_fwd()
            (ro.float() * do.float()).sum().backward()
            dq, dkv, dsink = sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, False, o_lo)
            extra = {
                "rel_o": _rel(o, ro),
                "max_lse": float((lse - rl).abs().max()),
                "rel_dq": _rel(dq, qr.grad),
                "rel_dkv": _rel(dkv, kvr.grad),
                "rel_dsink": _rel(dsink, sr.grad),
            }
            dq2, dkv2, dsink2 = sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, True, o_lo)
            dq3, dkv3, dsink3 = sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, True, o_lo)
            extra["det_repeat_identical"] = bool(
                torch.equal(dkv2, dkv3) and torch.equal(dq2, dq3) and torch.equal(dsink2, dsink3)
            )
            extra["rel_dkv_det"] = _rel(dkv2, kvr.grad)
            del ro, rl
            # the bf16 reference accumulates dkv through a bf16 gather backward: also compare both with
            # the reference run in fp32 (same values upcast)
            qf, kvf, sf = (x.detach().float().requires_grad_() for x in (q, kv, sink))
            of, _ = ref.sparse_attention(qf, kvf, sf, idx, scale)
            (of * do.float()).sum().backward()
            extra.update(
                rel_dq_vs_fp32ref=_rel(dq, qf.grad),
                rel_dkv_vs_fp32ref=_rel(dkv, kvf.grad),
                bf16ref_dkv_vs_fp32ref=_rel(kvr.grad, kvf.grad),
            )
            del of, qf, kvf, sf
        if args.reference:

            def ref_bwd():
                qr.grad = kvr.grad = sr.grad = None
                ro, _ = ref_fwd()
                ro.backward(do)

            ref_bwd_ms = _time_ms(ref_bwd, reps=3, warmup=1) - (ref_ms or 0.0)
    rows.append(_row("sparse_attn_fwd", shape, ms, limits, flops=flops, ref_ms=ref_ms, **extra))
    bwd = lambda: sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, False, o_lo)  # noqa: E731
    rows.append(_row("sparse_attn_bwd", shape, _time_ms(bwd), limits, flops=2.5 * flops, ref_ms=ref_bwd_ms))
    det = lambda: sa.sparse_attention_bwd(q, kv, sink, idx, o, lse, do, scale, True, o_lo)  # noqa: E731
    rows.append(_row("sparse_attn_bwd_deterministic", shape, _time_ms(det, reps=5), limits, flops=2.5 * flops))

    # decode: one query per sequence, large batch, its own kv per sequence
    bd = args.decode_batch
    q, kv, sink, idx = attention_inputs(bd, 1, h, d, k, args.seq, device)
    elem = q.element_size()
    nbytes = bd * k * d * elem + 2 * bd * h * d * elem
    dec = lambda: sa.sparse_attention_fwd(q, kv, sink, idx, scale)  # noqa: E731
    bh_plan, splits, _ = sa.plan_forward(bd, 1, h, k, q.device)
    ref_ms = None
    extra = {"splits": splits, "block_h": bh_plan}
    if args.reference:
        with torch.no_grad():
            ref_ms = _time_ms(lambda: ref.sparse_attention(q, kv, sink, idx, scale), reps=5)
    if args.check:
        o, lse = dec()
        ro, rl = ref.sparse_attention(q, kv, sink, idx, scale)
        extra.update(rel_o=_rel(o, ro), max_lse=float((lse - rl).abs().max()))
    rows.append(
        _row(
            "sparse_attn_decode",
            f"b={bd} s=1 h={h} d={d} k={k}",
            _time_ms(dec, reps=50),
            limits,
            flops=4 * bd * h * k * d,
            nbytes=nbytes,
            ref_ms=ref_ms,
            **extra,
        )
    )
    nosplit = lambda: sa.sparse_attention_fwd(q, kv, sink, idx, scale, 1)  # noqa: E731
    rows.append(
        _row(
            "sparse_attn_decode_nosplit",
            f"b={bd} s=1 h={h} d={d} k={k}",
            _time_ms(nosplit, reps=50),
            limits,
            flops=4 * bd * h * k * d,
            nbytes=nbytes,
        )
    )


def _bench_indexer(args, device, limits: dict, rows: list) -> None:
    from dsv4.ops import reference as ref
    from dsv4.ops.triton import indexer as ix

    s, h, d, n, r = args.seq, args.index_heads, args.index_dim, args.index_keys, args.ratio
    q, k, w = indexer_inputs(1, s, h, d, n, device)
    flops = 2 * s * n * h * d
    for label, pos in (
        ("all visible", torch.arange(s, device=device) + n * r),
        ("causal", torch.arange(s, device=device) * (n * r) // s),
    ):
        shape = f"s={s} n={n} h={h} d={d} ({label})"
        visible = float(((pos + 1) // r).clamp(max=n).sum()) / (s * n)
        fn = lambda pos=pos: ix.indexer_scores_fwd(q, k, w, pos, r)  # noqa: E731
        extra: dict = {"visible_frac": round(visible, 3)}
        ref_ms = None
        if args.reference:
            with torch.no_grad():
                ref_ms = _time_ms(lambda pos=pos: ref.indexer_scores(q, k, w, pos, r), reps=3)
        if args.check:
            got, want = fn(), ref.indexer_scores(q, k, w, pos, r)
            fin = torch.isfinite(want)
            extra.update(rel=_rel(got[fin], want[fin]), same_mask=bool(torch.equal(fin, torch.isfinite(got))))
        rows.append(_row("indexer_scores", shape, _time_ms(fn), limits, flops=flops, ref_ms=ref_ms, **extra))
        topk = lambda pos=pos: ix.indexer_topk(q, k, w, pos, r, args.index_topk)  # noqa: E731
        ref_ms = None
        if args.reference:
            with torch.no_grad():
                ref_ms = _time_ms(lambda pos=pos: ref.indexer_topk(q, k, w, pos, r, args.index_topk), reps=3)
        rows.append(
            _row("indexer_topk", shape + f" topk={args.index_topk}", _time_ms(topk), limits, flops=flops, ref_ms=ref_ms)
        )
        g = torch.randn(1, s, n, device=device)
        bwd = lambda pos=pos, g=g: ix.indexer_scores_bwd(q, k, w, pos, r, g)  # noqa: E731
        extra = {}
        if args.check:
            qr, kr, wr = (x.detach().clone().requires_grad_() for x in (q, k, w))
            sc = ref.indexer_scores(qr, kr, wr, pos, r)
            sc.masked_fill(~torch.isfinite(sc), 0).mul(g).sum().backward()
            dq, dk, dw = bwd()
            extra = {"rel_dq": _rel(dq, qr.grad), "rel_dk": _rel(dk, kr.grad), "rel_dw": _rel(dw, wr.grad)}
        rows.append(_row("indexer_scores_bwd", shape, _time_ms(bwd, reps=10), limits, flops=4 * flops, **extra))


def _diag_rows() -> list[dict]:
    """Registers, spills, shared memory and tensor-core instruction kind of every compiled kernel."""
    from dsv4.ops.triton import indexer as ix
    from dsv4.ops.triton import sparse_attention as sa

    out = []
    for mod in (sa, ix):
        for name, obj in vars(mod).items():
            jit = getattr(obj, "_jit", None)
            caches = getattr(jit, "device_caches", None) if jit is not None else None
            if not caches:
                continue
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for ck in getattr(cache, "values", lambda: [])():
                    try:
                        ptx = ck.asm.get("ptx", "")
                        out.append(
                            {
                                "diag": name,
                                "n_regs": ck.n_regs,
                                "n_spills": ck.n_spills,
                                "shared": ck.metadata.shared,
                                "num_warps": ck.metadata.num_warps,
                                "wgmma": "wgmma" in ptx,
                                "mma_sync": "mma.sync" in ptx,
                                "red_v": ".v4.f32" in ptx or ".v2.f32" in ptx,
                            }
                        )
                    except Exception as e:  # metadata layout differs between triton versions
                        out.append({"diag": name, "error": f"{type(e).__name__}: {e}"[:120]})
    return out


def run_kernel_bench(args: argparse.Namespace) -> int:
    """Entry point of `dsv4 bench kernels`."""
    device, limits, rows = start_run(
        "dsv4 bench kernels",
        "the kernels' CPU path is the Triton interpreter, which is for tests, not timing",
        args.jsonl,
    )
    sweep_rows: list[dict] = Stream() if args.jsonl else []
    t0 = time.time()
    parts = set(args.only.split(",")) if args.only else {"attention", "indexer"}
    if args.sweep:
        _sweeps(args, device, sweep_rows, parts)
    if "attention" in parts:
        _bench_attention(args, device, limits, rows)
    if "indexer" in parts:
        _bench_indexer(args, device, limits, rows)
    result = {**run_info(device, limits), "rows": rows, "sweeps": sweep_rows, "seconds": round(time.time() - t0, 1)}
    if args.diag:
        for r in _diag_rows():
            rows.append(r)
    return emit(result, render, args.json, args.jsonl)


def render(result: dict) -> str:
    """The printed table of a run: header, sweeps, then per kernel and shape its time, rates and speed-up,
    with the correctness numbers on the line below; rows that are not timings print as they are."""
    lines = header(result)
    lines += [f"sweep {r}" for r in result["sweeps"]]
    for r in result["rows"]:
        if "kernel" not in r:
            lines.append(str(r))
            continue
        sp = f"  x{r['speedup']} vs reference" if "speedup" in r else ""
        lines.append(f"{r['kernel']:30s} {r['shape']:44s} {r['ms']:9.3f} ms  {rate_columns(r)}{sp}")
        keys = ("rel", "max_", "det_", "same_", "splits", "visible")
        chk = {k: v for k, v in r.items() if k.startswith(keys)}
        if chk:
            lines.append(f"{'':30s} {chk}")
    return "\n".join(lines)


def add_bench_kernels_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `kernels` to the `dsv4 bench` subcommands (sets `func=run_kernel_bench`)."""
    p = subparsers.add_parser("kernels", help="time the attention / indexer kernels against measured limits")
    options.add(p, "threads")
    options.add(
        p, "seq_len", dest="seq", type=argtypes.positive_int, default=4096, note="queries per sequence (prefill)"
    )
    p.add_argument("--heads", type=argtypes.positive_int, default=64, help="attention heads")
    p.add_argument("--dim", type=argtypes.positive_int, default=512, help="head dimension")
    p.add_argument("--topk", type=argtypes.positive_int, default=640, help="keys per query (window + compressed)")
    p.add_argument("--decode-batch", type=argtypes.positive_int, default=64, help="sequences in the decode shape")
    p.add_argument("--index-heads", type=argtypes.positive_int, default=64, help="indexer heads")
    p.add_argument("--index-dim", type=argtypes.positive_int, default=128, help="indexer head dimension")
    p.add_argument("--index-keys", type=argtypes.positive_int, default=1024, help="compressed keys")
    p.add_argument("--index-topk", type=argtypes.positive_int, default=512, help="compressed keys each query keeps")
    p.add_argument("--ratio", type=argtypes.positive_int, default=4, help="compression ratio")
    p.add_argument("--only", default="", help="comma list: attention,indexer")
    p.add_argument("--reference", action="store_true", help="also time the torch reference (speed-up)")
    p.add_argument("--check", action="store_true", help="compare with the reference at the bench shapes")
    p.add_argument("--sweep", action="store_true", help="try launch configs first, keep the fastest")
    p.add_argument("--diag", action="store_true", help="report registers / spills / smem of compiled kernels")
    add_output_args(p)
    p.set_defaults(func=run_kernel_bench)
    return p
