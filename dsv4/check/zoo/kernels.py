"""Kernel and compiler checks: the attention backward and its LSE contract, compiled parity, determinism,
poisoned memory, evidence of the backend that ran, static shapes and live dtypes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import ops
from ...model import DeepSeekV4
from ...ops import reference as ref
from ..inputs import attention_inputs, moe_inputs, upcast
from ..result import CheckResult
from .context import (
    Context,
    fast_moe_backend,
    moe_backends,
    rel_err,
    tolerance,
)


# ------------------------------------------------------------------------------ attention op
def _attention_fwd_bwd(inp: dict, fn: Callable) -> tuple[torch.Tensor, ...]:
    q = inp["q"].clone().requires_grad_(True)
    kv = inp["kv"].clone().requires_grad_(True)
    sink = inp["sink"].clone().requires_grad_(True)
    o, _ = fn(q, kv, sink, inp["idx"], inp["scale"])
    gen = torch.Generator().manual_seed(1)
    (o * torch.randn(o.shape, generator=gen).to(o.device)).sum().backward()
    return o.detach(), q.grad, kv.grad, sink.grad


def _attention_backward(ctx: Context, kinds: list[str]) -> CheckResult:
    """Forward and backward vs the reference's autograd (fp32, same device) on each kind of inputs, in
    the op-level dtype and, when the model runs another one (bf16 on CUDA), in that one too."""
    worst, stages = 0.0, None
    dtypes = list(dict.fromkeys([ctx.dtype("sparse_attention"), ctx.model_dtype]))
    for dtype in dtypes:
        tol = tolerance(dtype, 1e-4)
        for kind in kinds:
            for n_comp in (0, 4):  # window-only and with compressed
                if kind == "roped":
                    if n_comp:
                        continue
                    stages = stages or ctx.clean
                    inp = attention_inputs(
                        "roped",
                        stages={k: v for k, v in stages.items() if k.startswith("layers.0.")},
                        window=ctx.cfg.window_size,
                        device=ctx.device,
                        dtype=dtype,
                    )
                else:
                    inp = attention_inputs(kind, n_comp=n_comp, seed=ctx.seed, device=ctx.device, dtype=dtype)
                got = _attention_fwd_bwd(inp, ops.sparse_attention)
                want = _attention_fwd_bwd(upcast(inp), ref.sparse_attention)
                for name, g, w in zip(("o", "dq", "dkv", "dsink"), got, want):
                    err = rel_err(g, w) if w is not None and g is not None else (0.0 if g is w else math.inf)
                    worst = max(worst, err)
                    if err > tol:
                        where = "window-only" if not n_comp else f"{n_comp} compressed keys"
                        return CheckResult(
                            False, err, f"{name} on {kind} {dtype} inputs ({where}) vs reference autograd"
                        )
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return CheckResult(True, worst, f"forward and backward match on {', '.join(kinds)} inputs ({names})")


def attention_backward_random(ctx: Context) -> CheckResult:
    return _attention_backward(ctx, ["random"])


def attention_backward_structured(ctx: Context) -> CheckResult:
    return _attention_backward(ctx, ["roped", "peaked", "padding"])


def lse_contract(ctx: Context) -> CheckResult:
    """lse = log(sum exp(scores) + exp(sink)) over valid keys, returned detached (not differentiable)."""
    dtype = ctx.dtype("sparse_attention")
    inp = attention_inputs("random", n_comp=4, seed=ctx.seed, device=ctx.device, dtype=dtype)
    q = inp["q"].clone().requires_grad_(True)
    o, lse = ops.sparse_attention(q, inp["kv"], inp["sink"], inp["idx"], inp["scale"])
    if lse.requires_grad:
        return CheckResult(False, None, "lse requires grad: it must be returned detached")
    f = upcast(inp)
    _, want = ref.sparse_attention(f["q"], f["kv"], f["sink"], f["idx"], f["scale"])
    err = rel_err(lse, want)
    return CheckResult(err <= tolerance(dtype, 1e-5), err, "lse vs reference")


def compile_attention(ctx: Context) -> CheckResult:
    """fullgraph torch.compile of attention forward + backward (lse unused) must run and match eager."""
    inp = attention_inputs(
        "random", s=8, n_comp=2, seed=ctx.seed, device=ctx.device, dtype=ctx.dtype("sparse_attention")
    )
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda *a: ops.sparse_attention(*a)[0], fullgraph=True, backend="aot_eager")
        got = _attention_fwd_bwd(inp, lambda *a: (fn(*a), None))
    except Exception as e:  # noqa: BLE001
        return CheckResult(False, None, f"compiled attention failed: {type(e).__name__}: {str(e)[:160]}")
    finally:
        torch._dynamo.reset()
    want = _attention_fwd_bwd(upcast(inp), ref.sparse_attention)
    err = max(rel_err(g, w) for g, w in zip(got, want))
    return CheckResult(
        err <= tolerance(ctx.dtype("sparse_attention"), 1e-5), err, "compiled attention fwd+bwd vs eager"
    )


# ------------------------------------------------------------------------------ compiler
def _accumulate(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    acc += x.sum(-1)
    return acc * 1.0


def _explicit_rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w).to(torch.bfloat16).float() * 3.0


def compile_parity(ctx: Context) -> CheckResult:
    """Eager vs compiled (ctx.compiler) on in-place accumulator updates and explicit bf16 roundings."""
    gen = torch.Generator().manual_seed(ctx.seed)
    x, w = torch.randn(8, 64, generator=gen).to(ctx.device), torch.randn(64, 64, generator=gen).to(ctx.device)
    worst = 0.0
    try:
        for name, fn, args in (
            ("acc += x.sum()", _accumulate, lambda: (torch.ones(8, device=ctx.device), x)),
            ("explicit bf16 rounding", _explicit_rounding, lambda: (x, w)),
        ):
            torch._dynamo.reset()
            ea, ca = args(), args()
            want = fn(*ea)
            got = torch.compile(fn, backend=ctx.compiler, fullgraph=True)(*ca)
            err = max(rel_err(got, want), rel_err(ca[0], ea[0]))
            worst = max(worst, err)
            if err > 0:
                return CheckResult(False, err, f"{name}: compiled differs from eager (outputs or aliased input)")
    finally:
        torch._dynamo.reset()
    return CheckResult(True, worst, "compiled == eager bit for bit")


# ------------------------------------------------------------------------------ determinism / memory
def determinism(ctx: Context) -> CheckResult:
    from ..determinism import determinism as run

    rep = run(ctx.model, ctx.tokens[:1, :16], runs=2, deterministic_mode=True)
    if rep.ok:
        return CheckResult(True, 0.0, f"{rep.tensors} tensors identical over {rep.runs} runs")
    d = rep.drifting[0]
    return CheckResult(False, d["max_abs"], f"{len(rep.drifting)} tensors drift, first {d['name']}")


@contextlib.contextmanager
def poisoned_memory():
    """torch.empty and other uninitialized allocations are filled with NaN inside the block."""
    import torch.utils.deterministic as det

    prev_alg, prev_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_alg, warn_only=prev_warn)
        det.fill_uninitialized_memory = prev_fill


def poisoned_memory_check(ctx: Context) -> CheckResult:
    """MoE experts split in two expert-parallel shards (each skips the other's experts) with poisoned
    uninitialized memory: the shard sum must equal the reference, all finite."""
    dtype = ctx.dtype("moe_experts")
    inp = moe_inputs(ctx.cfg, tokens=16, seed=ctx.seed, device=ctx.device, dtype=dtype)
    e = inp["w1"].size(0)
    half = e // 2
    want = ref.moe_experts(**upcast(inp))
    tol, worst = tolerance(dtype, 1e-4), 0.0
    for be in moe_backends(inp):
        with poisoned_memory():
            parts = []
            for lo, hi in ((0, half), (half, e)):
                shard = dict(inp, w1=inp["w1"][lo:hi], w2=inp["w2"][lo:hi], w3=inp["w3"][lo:hi], expert_offset=lo)
                parts.append(ops.moe_experts(**shard, backend=be))
        err = rel_err(parts[0] + parts[1], want)
        worst = max(worst, err)
        if not err <= tol:
            return CheckResult(
                False, err, f"expert-parallel shards ({ops.last_backend('moe_experts')}, {dtype}) vs reference"
            )
    return CheckResult(True, worst, f"expert-parallel shards ({', '.join(moe_backends(inp))}, {dtype}) vs reference")


# ------------------------------------------------------------------------------ evidence / shapes / dtype
def backend_evidence(ctx: Context) -> CheckResult:
    """Ask for a 'probe' backend (the reference under another name) for every op; every op the model
    must dispatch has to show up as having run on it (`dsv4.ops.calls()`)."""
    cfg = ctx.cfg
    must = {
        "sparse_attention",
        "hc_pre",
        "hc_post",
        "hc_head",
        "moe_experts",
        "rms_norm",
        "rope_tail",
        "linear",
        "linear_fp32",
        "route",
    }
    if cfg.n_shared_experts:
        must.add("clamped_swiglu")
    if any(cfg.compress_ratios[: cfg.n_layers]):
        must.add("compress_pool")
    if 4 in cfg.compress_ratios[: cfg.n_layers]:
        must |= {"indexer_topk", "hadamard"}
    for op in ops.ops():
        ops.register(op, "probe", getattr(ref, op), priority=-100)
    try:
        with ops.which_ran() as ran, ops.use_backend("probe"), torch.no_grad():
            ctx.model(ctx.tokens[:1, :16])
    finally:
        for op in ops.ops():
            ops.unregister(op, "probe")
    missing = sorted(op for op in must if "probe" not in ran.get(op, []))
    other = sorted(op for op, bes in ran.items() if set(bes) - {"probe"})
    if missing or other:
        return CheckResult(
            False,
            float(len(missing) + len(other)),
            f"requested 'probe' but no evidence it ran for {missing}; other backends ran for {other}",
        )
    return CheckResult(True, 0.0, f"{len(ran)} ops reported the requested backend")


DATA_DEPENDENT = (
    "nonzero",
    "masked_select",
    "_local_scalar_dense",
    "unique",
    "_unique2",
    "unique_consecutive",
    "masked_scatter",
    "repeat_interleave",
)


class DataDependentOps(TorchDispatchMode):
    """Records aten ops whose output shape or a host value depends on tensor data."""

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else [])
            if i is not None
        )
        if name in DATA_DEPENDENT or bool_index:
            self.hits.append(name + ("[bool mask]" if bool_index else ""))
        return func(*args, **(kwargs or {}))


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


@contextlib.contextmanager
def host_reads(hits: list[str]):
    """Record reads of tensor values into Python (`.tolist()`, `.item()`, `bool(t)`, ...) inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name, fn):
        def reader(self, *a, **k):
            hits.append(f"Tensor.{name}")
            return fn(self, *a, **k)

        return reader

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def static_shapes(ctx: Context) -> CheckResult:
    """Sampling, the MoE experts and a decode step's cache writes run with static shapes (no data-dependent
    sizes, no host reads of tensor values)."""
    from ...engine.sampling import Sampler, SamplingParams

    dev = ctx.device
    logits = torch.randn(2, ctx.cfg.vocab_size, generator=torch.Generator().manual_seed(ctx.seed)).to(dev)
    inp = moe_inputs(ctx.cfg, tokens=8, seed=ctx.seed, device=dev, dtype=ctx.dtype("moe_experts"))
    model = ctx.model
    cache = model.new_cache(1, max_len=16)
    with torch.no_grad():
        model.prefill(ctx.tokens[:1, :7], cache)
        step_inputs = cache.step_inputs(ctx.tokens[:1, 7:8])  # built before watching
    moes = moe_backends(inp)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01)] * 2
    spots = {"sampling": lambda: Sampler()(logits, params, [ctx.seed, ctx.seed + 1], [0, 0])}
    for be in moes:
        spots[f"moe_experts[{be}]"] = lambda be=be: ops.moe_experts(**inp, backend=be)
    spots["decode step (cache writes)"] = lambda: model.append(ctx.tokens[:1, 7:8], step_inputs, cache.kv)
    # the decode step's experts run on the first static-shape MoE backend (the reference loops with `where`)
    for where, fn in spots.items():
        reads: list[str] = []
        with (
            torch.no_grad(),
            ops.use_backend({"moe_experts": moes[0]}, inherit=True),
            DataDependentOps() as mode,
            host_reads(reads),
        ):
            fn()
        hits = mode.hits + reads
        if hits:
            return CheckResult(False, float(len(hits)), f"{where}: data-dependent ops / host reads {sorted(set(hits))}")
    return CheckResult(True, 0.0, f"no data-dependent shapes or host reads (moe_experts backends {', '.join(moes)})")


def compile_moe(ctx: Context) -> CheckResult:
    """fullgraph torch.compile (dynamic shapes) of the MoE experts, called with two different routings and
    token counts: no data-dependent size may force a guard or a graph break."""
    moe = fast_moe_backend() or "reference"
    gen_inp = [moe_inputs(ctx.cfg, tokens=8 + 4 * i, seed=ctx.seed + i, device=ctx.device) for i in range(2)]
    bf = [
        {
            k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "weights" else v
            for k, v in inp.items()
        }
        for inp in gen_inp
    ]
    fn = ops.resolve("moe_experts", moe, **bf[0]).fn
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=True)
        errs = [rel_err(compiled(**inp), ref.moe_experts(**upcast(inp))) for inp in bf]
    except Exception as e:  # noqa: BLE001
        return CheckResult(
            False, None, f"moe_experts[{moe}] does not compile: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        )
    finally:
        torch._dynamo.reset()
    return CheckResult(max(errs) <= 2e-2, max(errs), f"moe_experts[{moe}] compiled fullgraph, dynamic counts")


def live_dtype(ctx: Context) -> CheckResult:
    """A model built for bf16 holds bf16 weights (fp32 only where the design says so), read from the live
    model, with the memory estimate that follows."""
    model = DeepSeekV4(ctx.cfg, dtype=torch.bfloat16, device="meta")
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    total = sum(by_dtype.values())
    bf16 = by_dtype.get(torch.bfloat16, 0) / max(total, 1)
    gib = sum(n * d.itemsize for d, n in by_dtype.items()) / 2**30
    ok = model.embed.weight.dtype == torch.bfloat16 and bf16 > 0.5
    return CheckResult(
        ok,
        bf16,
        f"bf16 share of parameters {bf16:.1%}, weights {gib * 1024:.1f} MiB; embed {model.embed.weight.dtype}",
        device="meta",
    )
