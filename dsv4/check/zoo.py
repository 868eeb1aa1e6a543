"""The checks of the conformance suite. Each check passes on the correct code and fails on its mutants.

A check takes the shared `Context` (a small check model, tokens and the clean run's stages) and returns
a `CheckResult(ok, error, detail)`; `error` is the measured number that decided it.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ops
from ..config import ModelConfig
from ..model import DeepSeekV4
from ..ops import reference as ref
from ..ops.precision import exact_accumulation
from . import goldens
from .capture import Stages, capturing
from .inputs import attention_inputs, indexer_inputs, moe_inputs, random_tokens, upcast
from .metrics import DTYPE_NAMES, TOLERANCES, compare_stages
from .result import CheckResult, skipped
from .zoo_int8 import int8_per_token, int8_weight_rows

LOW_PRECISION = torch.bfloat16
# relative-L2 bound of a bf16 fast kernel against an fp32 reference of the same (bf16-rounded) inputs
BF16_TOL = 2e-2
# the model ops whose fast backends decide the model's dtype (Triton mHC and MoE take bf16/fp16 only)
MODEL_DTYPE_OPS = ("hc_pre", "hc_post", "moe_experts")
PROBED_OPS = ("sparse_attention", "indexer_topk", "moe_experts", "hc_pre", "hc_post")


def _probe_call(op: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Small arguments of `op` on `device` in `dtype`, enough for a backend's `can_run` to decide."""
    if op == "sparse_attention":
        inp = attention_inputs("random", s=4, window=4, device=device, dtype=dtype)
        return (inp["q"], inp["kv"], inp["sink"], inp["idx"], inp["scale"]), {}
    if op == "indexer_topk":
        return (), indexer_inputs(s=8, device=device, dtype=dtype)
    if op == "moe_experts":
        return (), moe_inputs(cfg, tokens=2, device=device, dtype=dtype)
    hc, dim = cfg.hc_mult, cfg.dim
    x = torch.zeros(1, 1, hc, dim, device=device, dtype=dtype)                  # [b, s, hc, d]
    mix = torch.zeros(1, 1, hc, device=device)
    if op == "hc_pre":
        return (x, torch.zeros(2 * hc + hc * hc, hc * dim, device=device), torch.ones(3, device=device),
                torch.zeros(2 * hc + hc * hc, device=device), cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters), {}
    if op == "hc_post":
        return (x[:, :, 0], x, mix, mix.unsqueeze(-1).expand(1, 1, hc, hc)), {}
    raise KeyError(op)


def op_dtypes(cfg: ModelConfig, device: torch.device) -> dict[str, torch.dtype]:
    """Per probed op, the input dtype at which the default backend here is a fast one: fp32 when one takes
    fp32 (or when only the reference runs), else bf16 when a fast backend needs it (Triton MoE / mHC)."""
    out = {}
    for op in PROBED_OPS:
        out[op] = torch.float32
        for dtype in (torch.float32, LOW_PRECISION):
            args, kw = _probe_call(op, cfg, device, dtype)
            if ops.resolve(op, None, *args, **kw).name != "reference":
                out[op] = dtype
                break
    return out


def backend_refusals(name: str, cfg: ModelConfig, device: torch.device) -> dict[str, str]:
    """{op: reason} for the probed ops that have backend `name` but where it cannot run on `device` at
    fp32 nor bf16 (empty: it can run everywhere it is registered)."""
    out = {}
    for op in PROBED_OPS:
        if name not in ops.backends(op):
            continue
        reasons = []
        for dtype in (torch.float32, LOW_PRECISION):
            args, kw = _probe_call(op, cfg, device, dtype)
            reasons.append(ops.refusal(op, name, *args, **kw))
        if all(r is not None for r in reasons):
            out[op] = reasons[0] if reasons[0] == reasons[1] else "; ".join(dict.fromkeys(reasons))
    return out


@dataclass
class Context:
    cfg: ModelConfig
    model: DeepSeekV4
    tokens: torch.Tensor
    compiler: Callable | str = "aot_eager"
    seed: int = 0
    current: Stages | None = None          # stages of the model as it is now (reset when a mutant is planted)
    device: torch.device | None = None     # where the model, the tokens and every check's inputs live
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)   # op-level input dtype per op (op_dtypes)
    planted: bool = False                  # a mutant is planted: `clean` must already exist
    clean_backends: dict[str, list[str]] = field(default_factory=dict)   # op -> backends of the clean run
    _clean: Stages | None = None

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = self.tokens.device
        self.device = torch.device(self.device)

    @property
    def clean(self) -> Stages:
        """Stages of the clean run (computed once, before any mutant is planted)."""
        if self._clean is None:
            if self.planted:
                raise RuntimeError("the clean stages must be computed before a mutant is planted")
            with ops.which_ran() as ran:
                self._clean = run_stages(self.model, self.tokens)
            self.clean_backends = ran
        return self._clean

    def stages(self) -> Stages:
        if self.current is None:
            self.current = self.clean if not self.planted else run_stages(self.model, self.tokens)
        return self.current

    @property
    def model_dtype(self) -> torch.dtype:
        return self.model.embed.weight.dtype

    def dtype(self, op: str) -> torch.dtype:
        """Input dtype of op-level checks of `op` (fp32 unless the fast backend here needs bf16)."""
        return self.dtypes.get(op, torch.float32)

    @classmethod
    def build(cls, cfg: ModelConfig, batch: int = 2, seq: int = 40, seed: int = 0,
              device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Context:
        """The check model on `device`: in `dtype`, by default fp32 unless the device's fast backends for
        the model's mHC / MoE ops need bf16 (CUDA with Triton), so that the checks exercise them."""
        device = torch.device(device)
        dtypes = op_dtypes(cfg, device)
        if dtype is None:
            dtype = LOW_PRECISION if any(dtypes[op] != torch.float32 for op in MODEL_DTYPE_OPS) else torch.float32
        model = DeepSeekV4.from_config(cfg, seed=seed, dtype=dtype, device=device).eval()
        return cls(cfg, model, random_tokens(cfg, batch, seq, seed, device=device), seed=seed, device=device,
                   dtypes=dtypes)


def tolerance(dtype: torch.dtype, fp32: float) -> float:
    """A check's bound for inputs of `dtype`: its fp32 bound, or BF16_TOL for half types."""
    return fp32 if dtype in (torch.float32, torch.float64) else max(fp32, BF16_TOL)


def run_stages(model: DeepSeekV4, tokens: torch.Tensor) -> Stages:
    with torch.no_grad(), capturing() as cap:
        model(tokens)
    return cap.stages


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------ model-level
def stage_compare(ctx: Context) -> CheckResult:
    """Every stage of a run vs the clean run of the same model (fp32 contract)."""
    got = ctx.stages()
    name = DTYPE_NAMES.get(ctx.model_dtype, "fp32")
    cmp = compare_stages(got, ctx.clean, TOLERANCES[name])
    if cmp.ok and not cmp.only_a and not cmp.only_b:
        worst = max((d.rel_l2 for d in cmp.diffs), default=0.0)
        return CheckResult(True, worst, f"all stages within {name} tolerance")
    if cmp.first is None:
        return CheckResult(False, None, f"stage sets differ: {cmp.only_a[:2]} / {cmp.only_b[:2]}")
    f = cmp.first
    err = f.index_frac if f.index_frac is not None else f.rel_l2
    return CheckResult(False, err, f"first divergence {f.name}: {f.reason}")


def router_contract(ctx: Context) -> CheckResult:
    """Hash layers pick tid2eid[token]; routing weights of every token sum to route_scale exactly once."""
    st = ctx.stages()
    flat = ctx.tokens.reshape(-1)
    worst = 0.0
    for i, layer in enumerate(ctx.model.layers):
        gate = layer.ffn.gate
        idx, w = st[f"layers.{i}.ffn.router_indices"], st[f"layers.{i}.ffn.router_weights"]
        if gate.hash and not torch.equal(idx, gate.tid2eid[flat].long()):
            frac = float((idx != gate.tid2eid[flat].long()).float().mean())
            return CheckResult(False, frac, f"layers.{i}: hash routing differs from tid2eid[token] ({frac:.1%})")
        err = float((w.float().sum(-1) - ctx.cfg.route_scale).abs().max()) / ctx.cfg.route_scale
        worst = max(worst, err)
        if err > (1e-5 if w.dtype == torch.float32 else 1e-2):
            return CheckResult(False, err, f"layers.{i}: routing weights sum to {float(w.sum(-1).mean()):.4f}, "
                                           f"route_scale is {ctx.cfg.route_scale}")
    return CheckResult(True, worst, "hash routing = tid2eid; weights sum to route_scale")


def fast_moe_backend() -> str | None:
    """The MoE backend a check exercises: the one requested in this block (`use_backend`), else the
    static-shape grouped path where it is registered (the reference loops over experts with `where`)."""
    requested = ops.requested("moe_experts")
    if requested is not None:
        return requested
    return "grouped" if "grouped" in ops.backends("moe_experts") else None


def moe_backends(inp: dict) -> list[str]:
    """The MoE backends a check exercises on these inputs: the one requested in this block (a mutant),
    else the default here (Triton on CUDA) and the static-shape grouped path where they can run; the
    reference only when neither does (it loops over experts with `where`)."""
    requested = ops.requested("moe_experts")
    if requested is not None:
        return [requested]
    out = []
    default = ops.resolve("moe_experts", None, **inp).name
    if default != "reference":
        out.append(default)
    if "grouped" in ops.backends("moe_experts") and "grouped" not in out and \
            ops.refusal("moe_experts", "grouped", **inp) is None:
        out.append("grouped")
    return out or ["reference"]


def swiglu_limit(ctx: Context) -> CheckResult:
    """Experts (routed through dispatch, and the shared expert) vs the clamped formula, on inputs whose
    pre-activations exceed swiglu_limit."""
    dtype = ctx.dtype("moe_experts")
    inp = moe_inputs(ctx.cfg, tokens=16, scale=40.0, seed=ctx.seed, device=ctx.device, dtype=dtype)
    want = ref.moe_experts(**upcast(inp))
    tol = tolerance(dtype, 1e-4)
    err = 0.0
    for be in moe_backends(inp):
        got = ops.moe_experts(**inp, backend=be)
        e = rel_err(got, want)
        err = max(err, e)
        if e > tol:
            return CheckResult(False, e, f"routed experts ({ops.last_backend('moe_experts')}, {dtype}) vs clamped "
                                         f"fp32 reference")
    shared = ctx.model.layers[0].ffn.shared_experts
    if shared is not None:
        x = inp["x"].to(ctx.model_dtype)
        with torch.no_grad():
            got_s = shared(x)
        want_s = ref.expert_ffn(x.float(), shared.w1.weight.float(), shared.w2.weight.float(),
                                shared.w3.weight.float(), ctx.cfg.swiglu_limit)
        err_s = rel_err(got_s, want_s)
        if err_s > tolerance(ctx.model_dtype, 1e-4):
            return CheckResult(False, err_s, "shared expert vs clamped reference")
        err = max(err, err_s)
    return CheckResult(True, err, f"experts clamp at swiglu_limit ({dtype}, tolerance {tol:g})")


# gate / up pre-activations straddling the clamp, in units of the limit: far below -limit, just around
# -limit, inside, just around +limit and far above it; with a limit of few significant bits (10: 4) every
# value is exact in bf16 (8 significant bits) as well as fp32 (the check verifies it)
SWIGLU_GRID = (-4.0, -2.0, -1.25, -1.0625, -1.0, -0.9375, -0.5, -0.125, 0.0, 0.125, 0.5, 0.9375, 1.0, 1.0625,
               1.25, 2.0, 4.0)


def swiglu_formula_expected(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The official expert activation, written out in float64: the gate clamped from above only (no lower
    clamp), the up projection to [-limit, limit], then gate * sigmoid(gate) * up."""
    g = gate.double().clamp(max=limit)
    u = up.double().clamp(min=-limit, max=limit)
    return g * torch.sigmoid(g) * u


def _swiglu_probe(cfg: ModelConfig, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights that make the gate and up pre-activations exactly the grid values: x is one-hot (token
    t = unit vector t), so w1[e, :, t] / w3[e, :, t] *are* token t's gate / up of expert e, and w2 is the
    identity on the first `inter` channels, so the expert output is the activation itself. Returns x,
    w1, w2, w3 (fp32); token t goes to expert t % E."""
    e, dim, inter, lim = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit
    grid = torch.tensor(SWIGLU_GRID) * lim
    n = len(SWIGLU_GRID)
    pair = torch.arange(tokens * inter).view(tokens, inter)
    gate, up = grid[pair % n], grid[(pair // n) % n]                      # every (gate, up) pair of the grid
    x = torch.eye(tokens, dim)
    w1, w3 = torch.zeros(e, inter, dim), torch.zeros(e, inter, dim)
    for t in range(tokens):
        w1[t % e, :, t], w3[t % e, :, t] = gate[t], up[t]
    w2 = torch.zeros(e, dim, inter)
    w2[:, :inter, :] = torch.eye(inter)
    return x, w1, w2, w3


def swiglu_formula(ctx: Context) -> CheckResult:
    """Every expert implementation that can run here (each registered `moe_experts` backend, and every
    layer's shared expert module) vs the official clamped SwiGLU written out in float64, per element, on
    gate and up values below -limit, around -limit, inside, around +limit and above +limit.

    The probe makes every product exact (one-hot x, identity w2, routing weights 1 and 0), so the only
    rounding is the activation's own: in fp32 a few ulp (sigmoid, two products), bounded by 2^-20
    relative; in bf16 the activation is rounded before w2 and w2's output may be rounded again, half a
    bf16 ulp (2^-9) each: (1 + 2^-9)^2 (1 + 2^-20) - 1 < 2^-8 + 2^-16. A clamp on the wrong side moves an
    element by far more: silu(-limit) * up against silu(-4 limit) * up differs by a factor ~e^(3 limit)."""
    cfg, dev = ctx.cfg, ctx.device
    lim, e, k, inter = cfg.swiglu_limit, cfg.n_routed_experts, cfg.n_activated_experts, cfg.moe_inter_dim
    if lim <= 0:
        return skipped("swiglu_limit is 0 in this config: no clamp to check")
    grid = torch.tensor(SWIGLU_GRID) * lim
    if not torch.equal(grid.bfloat16().float(), grid):
        return skipped(f"swiglu_limit {lim} does not make the probe values exact in bf16")
    tokens = min(cfg.dim, 2 * e)
    if inter > cfg.dim:
        return skipped(f"moe_inter_dim {inter} > dim {cfg.dim}: the identity w2 does not fit")
    x, w1, w2, w3 = _swiglu_probe(cfg, tokens)
    t_ids = torch.arange(tokens)
    indices = torch.stack([(t_ids + j) % e for j in range(k)], dim=1)   # slot 0: the token's expert
    weights = torch.zeros(tokens, k)
    weights[:, 0] = 1.0
    gate = torch.stack([w1[t % e, :, t] for t in range(tokens)])
    up = torch.stack([w3[t % e, :, t] for t in range(tokens)])
    want = torch.zeros(tokens, cfg.dim, dtype=torch.float64)
    want[:, :inter] = swiglu_formula_expected(gate, up, lim)
    tiny = torch.finfo(torch.float32).tiny

    def judge(got: torch.Tensor, dtype: torch.dtype) -> tuple[float, int]:
        # fp16: half an ulp (2^-11) per rounding as above, and below its normal range (2^-14) values round
        # to multiples of 2^-24: half of that per rounding, twice (silu(-4 L) * u underflows to 0)
        rtol = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10 + 2.0 ** -16}.get(dtype, 2.0 ** -8 + 2.0 ** -16)
        atol = 2.0 ** -24 if dtype == torch.float16 else tiny
        diff = (got.detach().double().cpu() - want).abs()
        bad = diff > rtol * want.abs() + atol
        ratio = float((diff / (want.abs() + atol)).max())
        return ratio, int(bad.sum())

    worst, ran, refused = 0.0, [], []
    requested = ops.requested("moe_experts")
    names = [requested] if requested is not None else ops.backends("moe_experts")
    for be in names:
        for dtype in (torch.float32, torch.bfloat16):
            inp = {"x": x.to(dev, dtype), "weights": weights.to(dev), "indices": indices.to(dev),
                   "w1": w1.to(dev, dtype), "w2": w2.to(dev, dtype), "w3": w3.to(dev, dtype),
                   "swiglu_limit": lim}
            why = ops.refusal("moe_experts", be, **inp)
            if why is None:
                break
        if why is not None:
            refused.append(f"{be}: {why}")
            continue
        ratio, bad = judge(ops.moe_experts(**inp, backend=be), dtype)
        worst = max(worst, ratio)
        ran.append(f"{be} ({str(dtype).removeprefix('torch.')})")
        if bad:
            return CheckResult(False, ratio, f"moe_experts backend {be} ({dtype}): {bad} of {want.numel()} "
                                             f"elements off the clamped-SwiGLU formula (worst relative {ratio:.3g})")
    for i, layer in enumerate(ctx.model.layers):
        shared = getattr(layer.ffn, "shared_experts", None)
        if shared is None:
            continue
        probe = copy.deepcopy(shared)
        dtype = probe.w1.weight.dtype
        with torch.no_grad():                # column t of each w is non-zero in one expert only: the sum
            probe.w1.weight.copy_(w1.sum(0).to(dev, dtype))              # holds every token's values
            probe.w3.weight.copy_(w3.sum(0).to(dev, dtype))
            probe.w2.weight.copy_(w2[0].to(dev, dtype))
            got = probe(x.to(dev, dtype))
        ratio, bad = judge(got, dtype)
        worst = max(worst, ratio)
        if bad:
            return CheckResult(False, ratio, f"layers.{i} shared expert ({dtype}): {bad} elements off the "
                                             f"clamped-SwiGLU formula (worst relative {ratio:.3g})")
        ran.append(f"layers.{i}.shared ({str(dtype).removeprefix('torch.')})")
    note = f"; not run here: {'; '.join(refused)}" if refused else ""
    return CheckResult(True, worst, f"{len(ran)} expert implementations match silu(min(g, L)) * clamp(u, -L, L) "
                                    f"per element: {', '.join(ran)}{note}")


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
            for n_comp in (0, 4):                                                # window-only and with compressed
                if kind == "roped":
                    if n_comp:
                        continue
                    stages = stages or ctx.clean
                    inp = attention_inputs("roped", stages={k: v for k, v in stages.items()
                                                            if k.startswith("layers.0.")},
                                           window=ctx.cfg.window_size, device=ctx.device, dtype=dtype)
                else:
                    inp = attention_inputs(kind, n_comp=n_comp, seed=ctx.seed, device=ctx.device, dtype=dtype)
                got = _attention_fwd_bwd(inp, ops.sparse_attention)
                want = _attention_fwd_bwd(upcast(inp), ref.sparse_attention)
                for name, g, w in zip(("o", "dq", "dkv", "dsink"), got, want):
                    err = rel_err(g, w) if w is not None and g is not None else (0.0 if g is w else math.inf)
                    worst = max(worst, err)
                    if err > tol:
                        where = "window-only" if not n_comp else f"{n_comp} compressed keys"
                        return CheckResult(False, err, f"{name} on {kind} {dtype} inputs ({where}) vs reference "
                                                        "autograd")
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
    inp = attention_inputs("random", s=8, n_comp=2, seed=ctx.seed, device=ctx.device,
                           dtype=ctx.dtype("sparse_attention"))
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda *a: ops.sparse_attention(*a)[0], fullgraph=True, backend="aot_eager")
        got = _attention_fwd_bwd(inp, lambda *a: (fn(*a), None))
    except Exception as e:                                                       # noqa: BLE001
        return CheckResult(False, None, f"compiled attention failed: {type(e).__name__}: {str(e)[:160]}")
    finally:
        torch._dynamo.reset()
    want = _attention_fwd_bwd(upcast(inp), ref.sparse_attention)
    err = max(rel_err(g, w) for g, w in zip(got, want))
    return CheckResult(err <= tolerance(ctx.dtype("sparse_attention"), 1e-5), err,
                       "compiled attention fwd+bwd vs eager")


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
        for name, fn, args in (("acc += x.sum()", _accumulate, lambda: (torch.ones(8, device=ctx.device), x)),
                               ("explicit bf16 rounding", _explicit_rounding, lambda: (x, w))):
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
    from .determinism import determinism as run

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
            return CheckResult(False, err, f"expert-parallel shards ({ops.last_backend('moe_experts')}, {dtype}) "
                                           "vs reference")
    return CheckResult(True, worst, f"expert-parallel shards ({', '.join(moe_backends(inp))}, {dtype}) vs reference")


# ------------------------------------------------------------------------------ decode / indexer
def teacher_forcing(ctx: Context) -> CheckResult:
    """Prefill + decode across compression boundaries vs one full prefill (uses dsv4.check.teacher_forcing)."""
    from .teacher_forcing import teacher_forcing as tf

    # the exact-accumulation contract (float64, rounded once) is the reference ops'; fast kernels accumulate
    # in their own order, which the FP8/FP4 round trips amplify: the cache machinery is checked on the
    # reference (a backend a mutant planted still runs)
    with ops.use_backend({op: ops.requested(op) or "reference" for op in ops.ops()}):
        rep = tf(ctx.model, ctx.tokens[:1, :18], prefill=9)                     # decode crosses 4- and 16-groups
    where = f" first at position {rep.first_position}" + (f", stage {rep.first_stage}" if rep.first_stage else "")
    return CheckResult(rep.ok, rep.max_rel_error, "prefill vs decode logits (reference ops, exact accumulation)"
                       + ("" if rep.ok else where))


def paged_batching(ctx: Context) -> CheckResult:
    """Three sequences of different lengths at once through the serving engine (prompts in chunks of 9
    tokens, 16-position pages, so they cross page, window and compression-group boundaries side by side):
    every greedy token is the full forward's choice, with the full forward's log-probability."""
    from ..engine import Engine, EngineConfig, SamplingParams

    flat = ctx.tokens.flatten().tolist()
    prompts = [flat[:7], flat[7:40], flat[40:61]]
    new = 6
    choice = {op: ops.requested(op) or "reference" for op in ops.ops()}   # as teacher-forcing
    with ops.use_backend(choice), exact_accumulation(True), torch.no_grad():
        engine = Engine(ctx.model, EngineConfig(max_seqs=4, max_batch_tokens=9, page_size=16, deterministic=True,
                                                prefix_caching=False, cuda_graphs=False))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=0))
        got: dict[int, list] = {i: [] for i in range(len(prompts))}
        while engine.has_work():
            for out in engine.step():
                got[int(out.request_id)].extend(out.new_logprobs)
        worst, bad = 0.0, []
        for i, p in enumerate(prompts):
            toks = [lp.token for lp in got[i]]
            seq = torch.tensor([p + toks], device=ctx.device)
            ref = torch.log_softmax(ctx.model(seq).logits[0, len(p) - 1:-1].double(), -1)   # [new, V]
            for t, lp in enumerate(got[i]):
                worst = max(worst, abs(lp.logprob - float(ref[t, lp.token])))
                if float(ref[t, lp.token]) < float(ref[t].max()) - tolerance(ctx.model_dtype, 1e-5):
                    bad.append((i, t))
    ok = not bad and worst <= tolerance(ctx.model_dtype, 1e-4)
    return CheckResult(ok, worst, "engine with 3 concurrent sequences vs the full forward (greedy tokens, "
                                  "log-probabilities)" + (f"; non-greedy tokens at {bad[:3]}" if bad else ""))


DRAFT_PROMPTS = ("def read_lines(path):\n    with open(path) as f:\n",
                 "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
                 "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n")
MIN_ACCEPTANCE = 0.25


def draft_acceptance(ctx: Context) -> CheckResult:
    """Speculative decoding with the shipped model (its MTP block is trained): greedy, 3 drafts per step,
    48 tokens after each of three Python prompts; at least 25% of the drafts must be accepted (the correct
    draft keeps 40-60% on such text; a draft fed the wrong token or a head of its own keeps about 1%)."""
    from .. import defaults
    from ..checkpoint.load import load_pretrained
    from ..engine import Engine, EngineConfig, SamplingParams
    from ..train.tokenizer import Tokenizer

    path = defaults.shipped_model_dir()
    if path is None:
        return skipped("the shipped model is not installed with this package")
    model = load_pretrained(path, device=ctx.device, progress=False).eval()
    tok = Tokenizer.from_file(path)
    engine = Engine(model, EngineConfig(max_seqs=4, speculative=3, cuda_graphs=False))
    for i, text in enumerate(DRAFT_PROMPTS):
        engine.add_request(str(i), [tok.bos_id] + tok.encode(text),
                           SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    st = engine.spec_stats
    rate = st["accepted"] / max(1, st["drafted"])
    return CheckResult(rate >= MIN_ACCEPTANCE, rate, f"{st['accepted']} of {st['drafted']} drafted tokens accepted "
                                                       f"(at least {MIN_ACCEPTANCE:.0%} needed)")


def indexer_padding(ctx: Context) -> CheckResult:
    """Top-k slots past the visible entries are -1; picked entries are visible (j < (t+1)//ratio)."""
    inp = indexer_inputs(s=13, seed=ctx.seed, device=ctx.device, dtype=ctx.dtype("indexer_topk"))
    got = ops.indexer_topk(**inp)
    visible = (inp["positions"] + 1) // inp["ratio"]                             # [s]
    n_vis = visible.view(1, -1, 1)
    slot = torch.arange(got.size(-1), device=got.device).view(1, 1, -1)
    bad_pad = (slot >= n_vis) & (got != -1)
    bad_pick = (slot < n_vis) & ((got < 0) | (got >= n_vis))
    frac = float((bad_pad | bad_pick).float().mean())
    if frac:
        return CheckResult(False, frac, f"{int(bad_pad.sum())} padding slots not -1, {int(bad_pick.sum())} "
                                        "picks invisible")
    want = ref.indexer_topk(**upcast(inp))
    same = torch.equal(got.sort(-1).values, want.sort(-1).values)                # the order inside a row is free
    return CheckResult(same, 0.0, "padding slots -1, picks visible, the reference's picks")


# ------------------------------------------------------------------------------ evidence / shapes / dtype
def backend_evidence(ctx: Context) -> CheckResult:
    """Ask for a 'probe' backend (the reference under another name) for every op; every op the model
    must dispatch has to show up as having run on it (`dsv4.ops.calls()`)."""
    cfg = ctx.cfg
    must = {"sparse_attention", "hc_pre", "hc_post", "hc_head", "moe_experts", "rms_norm", "rope_tail", "linear_fp32"}
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
        return CheckResult(False, float(len(missing) + len(other)),
                           f"requested 'probe' but no evidence it ran for {missing}; other backends ran for {other}")
    return CheckResult(True, 0.0, f"{len(ran)} ops reported the requested backend")


DATA_DEPENDENT = ("nonzero", "masked_select", "_local_scalar_dense", "unique", "_unique2", "unique_consecutive",
                  "masked_scatter", "repeat_interleave")


class DataDependentOps(TorchDispatchMode):
    """Records aten ops whose output shape or a host value depends on tensor data."""

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else []) if i is not None)
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
    from ..engine.sampling import Sampler, SamplingParams

    dev = ctx.device
    logits = torch.randn(2, ctx.cfg.vocab_size, generator=torch.Generator().manual_seed(ctx.seed)).to(dev)
    inp = moe_inputs(ctx.cfg, tokens=8, seed=ctx.seed, device=dev, dtype=ctx.dtype("moe_experts"))
    model = ctx.model
    cache = model.new_cache(1, max_len=16)
    with torch.no_grad():
        model.prefill(ctx.tokens[:1, :7], cache)
        step_inputs = cache.step_inputs(ctx.tokens[:1, 7:8])                   # built before watching
    moes = moe_backends(inp)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01)] * 2
    spots = {"sampling": lambda: Sampler()(logits, params, [ctx.seed, ctx.seed + 1], [0, 0])}
    for be in moes:
        spots[f"moe_experts[{be}]"] = lambda be=be: ops.moe_experts(**inp, backend=be)
    spots["decode step (cache writes)"] = lambda: model.append(ctx.tokens[:1, 7:8], step_inputs, cache.kv)
    # the decode step's experts run on the first static-shape MoE backend (the reference loops with `where`)
    for where, fn in spots.items():
        reads: list[str] = []
        with torch.no_grad(), ops.use_backend({"moe_experts": moes[0]}, inherit=True), DataDependentOps() as mode, \
                host_reads(reads):
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
    bf = [{k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "weights" else v
           for k, v in inp.items()} for inp in gen_inp]
    fn = ops.resolve("moe_experts", moe, **bf[0]).fn
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=True)
        errs = [rel_err(compiled(**inp), ref.moe_experts(**upcast(inp))) for inp in bf]
    except Exception as e:                                                       # noqa: BLE001
        return CheckResult(False, None, f"moe_experts[{moe}] does not compile: {type(e).__name__}: "
                                        f"{str(e).splitlines()[0][:160]}")
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
    return CheckResult(ok, bf16, f"bf16 share of parameters {bf16:.1%}, weights {gib * 1024:.1f} MiB; "
                                 f"embed {model.embed.weight.dtype}", device="meta")


# ------------------------------------------------------------------------------ formats
def fp4_known_bytes(ctx: Context) -> CheckResult:
    """Bytes 0x21, 0x43 are codes 1, 2, 3, 4 (low nibble first); dequantized values follow."""
    from ..formats import fp4

    dev = ctx.device
    packed = torch.tensor([[0x21, 0x43] + [0x00] * 14], dtype=torch.uint8, device=dev).view(torch.int8)
    codes = fp4.unpack_fp4(packed)
    want = torch.tensor([1, 2, 3, 4] + [0] * 28, dtype=codes.dtype, device=dev)
    if not torch.equal(codes[0], want):
        return CheckResult(False, float((codes[0] != want).float().mean()), f"decoded codes {codes[0, :6].tolist()}")
    scale = torch.tensor([[127]], dtype=torch.uint8, device=dev)                  # 2^0
    deq = fp4.dequantize_mxfp4(packed, scale)
    want_v = torch.tensor([0.5, 1.0, 1.5, 2.0] + [0.0] * 28, device=dev)
    err = float((deq[0] - want_v).abs().max())
    return CheckResult(err == 0, err, "known bytes decode bit-exactly")


def e8m0_bytes(ctx: Context) -> CheckResult:
    """Every scale byte b decodes to 2^(b-127), and an FP8 block dequantizes with exactly that scale."""
    from ..formats import e8m0, fp8

    dev = ctx.device
    b = torch.arange(0, 255, dtype=torch.uint8, device=dev)
    got = e8m0.e8m0_decode(b)
    want = torch.exp2(b.double() - 127)
    err = float(((got.double() - want).abs() / want).max())
    if err:
        return CheckResult(False, err, f"byte 130 decodes to {float(got[130])}, want 8.0")
    q = fp8.e4m3_encode(torch.ones(4, 4, device=dev))
    deq = fp8.dequantize_fp8(q, torch.tensor([[130]], dtype=torch.uint8, device=dev))
    err = float((deq - 8.0).abs().max())
    return CheckResult(err == 0, err, "scale bytes decode bit for bit")


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_roundtrip(ctx: Context) -> CheckResult:
    """Save a tiny model as an FP8 release checkpoint, load it back: the load validates every tensor's
    shape and format (a refusal counts as caught), and every loaded weight equals what the format defines
    (FP8 linears = dequant(quant(w)) with E8M0 block scales, BF16 dense weights, F32 exact)."""
    import tempfile

    from .. import formats as fm
    from ..checkpoint import CheckpointError, load_pretrained, model_values, save
    from ..checkpoint.names import EXPERT, F32, INT, LINEAR, official_tensors, to_model

    cfg = ModelConfig.preset("tiny").replace(n_mtp_layers=0, compress_ratios=(0, 4, 128, 4))
    src = DeepSeekV4.from_config(cfg, seed=ctx.seed)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            save(model_values(src), cfg, tmp, target="fp8", overwrite=True)
            loaded = load_pretrained(tmp, dtype=torch.float32)
        except CheckpointError as e:
            return CheckResult(False, None, f"load refused the checkpoint: {str(e)[:200]}")
    want_sd, got_sd = src.state_dict(), loaded.state_dict()
    worst, worst_name = 0.0, ""
    for name, spec in official_tensors(cfg, mtp=False).items():
        mname, j = to_model(name)
        w, g = want_sd[mname], got_sd[mname]
        if j is not None:
            w, g = w[j], g[j]
        if spec.role in (LINEAR, EXPERT):
            q, sc = fm.quantize_fp8(w.float())
            w = fm.dequantize_fp8(q, sc)
        elif spec.role not in (F32, INT):
            w = w.bfloat16()
        err = rel_err(g.float(), w.float()) if w.is_floating_point() else float(not torch.equal(g, w))
        if err > worst:
            worst, worst_name = err, name
    ok = worst <= 1e-6
    return CheckResult(ok, worst, "loaded weights equal their stored format" if ok else
                       f"loaded '{worst_name}' differs from its stored value (rel {worst:.3g})",
                       device="cpu (checkpoint files are written and read on the host)")


def ep_ranges(ctx: Context) -> CheckResult:
    """Expert parallelism in one process on a fake 2-rank group, as rank 1: the rank holds experts
    [E/2, E) and its partial MoE output equals the reference restricted to them."""
    import copy

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..train import distributed as ep

    if dist.is_initialized():
        return CheckResult(False, None, "a process group is already initialized in this process")
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        model = copy.deepcopy(ctx.model)
        ep.shard_experts(model, mode="all_reduce")
        rank, world = dist.get_rank(), dist.get_world_size()
        inp = moe_inputs(ctx.cfg, tokens=8, seed=ctx.seed, device=ctx.device, dtype=ctx.model_dtype)
        tol = tolerance(ctx.model_dtype, 1e-5)
        for i, layer in enumerate(model.layers):
            full = ctx.model.layers[i].ffn.experts
            e = full.w1.size(0)
            lo, hi = rank * e // world, (rank + 1) * e // world
            ex = layer.ffn.experts
            if ex.offset != lo or not torch.equal(ex.w1, full.w1[lo:hi]):
                return CheckResult(False, float(abs(ex.offset - lo)),
                                   f"layers.{i}: rank {rank} holds experts from {ex.offset}, expected [{lo}, {hi})")
            with torch.no_grad():
                got = layer.ffn.routed_override(inp["x"], inp["weights"], inp["indices"])
            want = ref.moe_experts(inp["x"].float(), inp["weights"], inp["indices"], full.w1[lo:hi].float(),
                                   full.w2[lo:hi].float(), full.w3[lo:hi].float(), ctx.cfg.swiglu_limit, lo)
            err = rel_err(got, want)
            if err > tol:
                return CheckResult(False, err, f"layers.{i}: rank {rank}'s expert output vs reference")
    except RuntimeError as e:
        return CheckResult(False, None, f"expert parallelism refused: {str(e)[:160]}")
    finally:
        dist.destroy_process_group()
    return CheckResult(True, 0.0, "rank 1 of 2 holds and serves experts [E/2, E) in every layer")


def _golden_verdict(rows, against: str) -> CheckResult:
    """One verdict over golden stage rows (`goldens.compare_case`): the first stage off, or the worst fit."""
    worst = max(rows, key=lambda r: r.error / r.tol)
    bad = [r for r in rows if not r.ok]
    if bad:
        first = bad[0]
        return CheckResult(False, first.error, f"{len(bad)} of {len(rows)} stages off {against}; first: "
                                               f"{first.case} {first.stage} {first.error:.3g} > {first.tol:.3g}")
    return CheckResult(True, worst.error, f"{len(rows)} stages within tolerance of {against} (worst {worst.case} "
                                          f"{worst.stage}: {worst.error:.2g} <= {worst.tol:.2g})")


def official_goldens(ctx: Context) -> CheckResult:
    """Every stage of every golden case (`dsv4.check.goldens`) within its tolerance of the numbers the
    official inference code produced."""
    rows = [r for case in goldens.CASES for r in goldens.compare_case(case, ctx.device)]
    return _golden_verdict(rows, f"the official numbers ({len(goldens.CASES)} cases)")


def transformers_goldens(ctx: Context) -> CheckResult:
    """Every stage of the transformers golden case within the fp32 tolerance of the numbers transformers'
    `DeepseekV4ForCausalLM` produced, its checkpoint loaded through dsv4's loader (transformers layout)."""
    case = goldens.TRANSFORMERS_CASE
    version = goldens.fixture_metadata(case).get("transformers_version", "?")
    return _golden_verdict(goldens.compare_case(case, ctx.device), f"transformers {version}'s numbers")


def dspark_goldens(ctx: Context) -> CheckResult:
    """The DSpark draft (`dsv4.model.dspark`) against the fixture the reference code produced: every
    stage, the drafts, their confidence and the verify length (`goldens.compare_dspark`)."""
    return _golden_verdict(goldens.compare_dspark(ctx.device), "the DSpark reference's numbers")


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "checkpoint-roundtrip": checkpoint_roundtrip,
    "ep-ranges": ep_ranges,
    "stage-compare": stage_compare,
    "router-contract": router_contract,
    "swiglu-limit": swiglu_limit,
    "swiglu-formula": swiglu_formula,
    "attention-backward-random": attention_backward_random,
    "attention-backward-structured": attention_backward_structured,
    "lse-contract": lse_contract,
    "compile-attention": compile_attention,
    "compile-parity": compile_parity,
    "determinism": determinism,
    "poisoned-memory": poisoned_memory_check,
    "teacher-forcing": teacher_forcing,
    "paged-batching": paged_batching,
    "draft-acceptance": draft_acceptance,
    "indexer-padding": indexer_padding,
    "backend-evidence": backend_evidence,
    "static-shapes": static_shapes,
    "compile-moe": compile_moe,
    "live-dtype": live_dtype,
    "fp4-known-bytes": fp4_known_bytes,
    "e8m0-bytes": e8m0_bytes,
    "official-goldens": official_goldens,
    "transformers-goldens": transformers_goldens,
    "dspark-goldens": dspark_goldens,
    "int8-weight-rows": int8_weight_rows,
    "int8-per-token": int8_per_token,
}
