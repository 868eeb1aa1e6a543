"""Model-level checks: stages against the reference, the router contract, SwiGLU, decode against
prefill, paged batching, the draft, the indexer's padding."""

from __future__ import annotations

import copy

import torch

from ... import ops
from ...config import ModelConfig
from ...ops import reference as ref
from ...ops.precision import exact_accumulation
from ..inputs import indexer_inputs, moe_inputs, upcast
from ..metrics import DTYPE_NAMES, TOLERANCES, compare_stages
from ..result import CheckResult, skipped
from .context import (
    Context,
    moe_backends,
    rel_err,
    tolerance,
)


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
            return CheckResult(
                False,
                err,
                f"layers.{i}: routing weights sum to {float(w.sum(-1).mean()):.4f}, "
                f"route_scale is {ctx.cfg.route_scale}",
            )
    return CheckResult(True, worst, "hash routing = tid2eid; weights sum to route_scale")


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
            return CheckResult(
                False, e, f"routed experts ({ops.last_backend('moe_experts')}, {dtype}) vs clamped fp32 reference"
            )
    shared = ctx.model.layers[0].ffn.shared_experts
    if shared is not None:
        x = inp["x"].to(ctx.model_dtype)
        with torch.no_grad():
            got_s = shared(x)
        want_s = ref.expert_ffn(
            x.float(),
            shared.w1.weight.float(),
            shared.w2.weight.float(),
            shared.w3.weight.float(),
            ctx.cfg.swiglu_limit,
        )
        err_s = rel_err(got_s, want_s)
        if err_s > tolerance(ctx.model_dtype, 1e-4):
            return CheckResult(False, err_s, "shared expert vs clamped reference")
        err = max(err, err_s)
    return CheckResult(True, err, f"experts clamp at swiglu_limit ({dtype}, tolerance {tol:g})")


# gate / up pre-activations straddling the clamp, in units of the limit: far below -limit, just around
# -limit, inside, just around +limit and far above it; with a limit of few significant bits (10: 4) every
# value is exact in bf16 (8 significant bits) as well as fp32 (the check verifies it)
SWIGLU_GRID = (
    -4.0,
    -2.0,
    -1.25,
    -1.0625,
    -1.0,
    -0.9375,
    -0.5,
    -0.125,
    0.0,
    0.125,
    0.5,
    0.9375,
    1.0,
    1.0625,
    1.25,
    2.0,
    4.0,
)


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
    gate, up = grid[pair % n], grid[(pair // n) % n]  # every (gate, up) pair of the grid
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
    indices = torch.stack([(t_ids + j) % e for j in range(k)], dim=1)  # slot 0: the token's expert
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
        rtol = {torch.float32: 2.0**-20, torch.float16: 2.0**-10 + 2.0**-16}.get(dtype, 2.0**-8 + 2.0**-16)
        atol = 2.0**-24 if dtype == torch.float16 else tiny
        diff = (got.detach().double().cpu() - want).abs()
        bad = diff > rtol * want.abs() + atol
        ratio = float((diff / (want.abs() + atol)).max())
        return ratio, int(bad.sum())

    worst, ran, refused = 0.0, [], []
    requested = ops.requested("moe_experts")
    names = [requested] if requested is not None else ops.backends("moe_experts")
    for be in names:
        for dtype in (torch.float32, torch.bfloat16):
            inp = {
                "x": x.to(dev, dtype),
                "weights": weights.to(dev),
                "indices": indices.to(dev),
                "w1": w1.to(dev, dtype),
                "w2": w2.to(dev, dtype),
                "w3": w3.to(dev, dtype),
                "swiglu_limit": lim,
            }
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
            return CheckResult(
                False,
                ratio,
                f"moe_experts backend {be} ({dtype}): {bad} of {want.numel()} "
                f"elements off the clamped-SwiGLU formula (worst relative {ratio:.3g})",
            )
    for i, layer in enumerate(ctx.model.layers):
        shared = getattr(layer.ffn, "shared_experts", None)
        if shared is None:
            continue
        probe = copy.deepcopy(shared)
        dtype = probe.w1.weight.dtype
        with torch.no_grad():  # column t of each w is non-zero in one expert only: the sum
            probe.w1.weight.copy_(w1.sum(0).to(dev, dtype))  # holds every token's values
            probe.w3.weight.copy_(w3.sum(0).to(dev, dtype))
            probe.w2.weight.copy_(w2[0].to(dev, dtype))
            got = probe(x.to(dev, dtype))
        ratio, bad = judge(got, dtype)
        worst = max(worst, ratio)
        if bad:
            return CheckResult(
                False,
                ratio,
                f"layers.{i} shared expert ({dtype}): {bad} elements off the "
                f"clamped-SwiGLU formula (worst relative {ratio:.3g})",
            )
        ran.append(f"layers.{i}.shared ({str(dtype).removeprefix('torch.')})")
    note = f"; not run here: {'; '.join(refused)}" if refused else ""
    return CheckResult(
        True,
        worst,
        f"{len(ran)} expert implementations match silu(min(g, L)) * clamp(u, -L, L) "
        f"per element: {', '.join(ran)}{note}",
    )


# ------------------------------------------------------------------------------ decode / indexer
def teacher_forcing(ctx: Context) -> CheckResult:
    """Prefill + decode across compression boundaries vs one full prefill (uses dsv4.check.teacher_forcing)."""
    from ..teacher_forcing import teacher_forcing as tf

    # exact accumulation runs the reference ops (a backend a mutant planted still runs): the cache machinery
    rep = tf(ctx.model, ctx.tokens[:1, :18], prefill=9)  # decode crosses 4- and 16-groups
    where = f" first at position {rep.first_position}" + (f", stage {rep.first_stage}" if rep.first_stage else "")
    return CheckResult(
        rep.ok,
        rep.max_rel_error,
        "prefill vs decode logits (reference ops, exact accumulation)" + ("" if rep.ok else where),
    )


def paged_batching(ctx: Context) -> CheckResult:
    """Three sequences of different lengths at once through the serving engine (prompts in chunks of 9
    tokens, 16-position pages, so they cross page, window and compression-group boundaries side by side):
    every greedy token is the full forward's choice, with the full forward's log-probability."""
    from ...engine import Engine, EngineConfig, SamplingParams

    flat = ctx.tokens.flatten().tolist()
    prompts = [flat[:7], flat[7:40], flat[40:61]]
    new = 6
    choice = {op: ops.requested(op) or "reference" for op in ops.ops()}  # as teacher-forcing
    with ops.use_backend(choice), exact_accumulation(True), torch.no_grad():
        engine = Engine(
            ctx.model,
            EngineConfig(
                max_seqs=4,
                max_batch_tokens=9,
                page_size=16,
                deterministic=True,
                prefix_caching=False,
                cuda_graphs=False,
            ),
        )
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
            ref = torch.log_softmax(ctx.model(seq).logits[0, len(p) - 1 : -1].double(), -1)  # [new, V]
            for t, lp in enumerate(got[i]):
                worst = max(worst, abs(lp.logprob - float(ref[t, lp.token])))
                if float(ref[t, lp.token]) < float(ref[t].max()) - tolerance(ctx.model_dtype, 1e-5):
                    bad.append((i, t))
    ok = not bad and worst <= tolerance(ctx.model_dtype, 1e-4)
    return CheckResult(
        ok,
        worst,
        "engine with 3 concurrent sequences vs the full forward (greedy tokens, "
        "log-probabilities)" + (f"; non-greedy tokens at {bad[:3]}" if bad else ""),
    )


DRAFT_PROMPTS = (
    "def read_lines(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n",
)
MIN_ACCEPTANCE = 0.25


def draft_acceptance(ctx: Context) -> CheckResult:
    """Speculative decoding with the shipped model (its MTP block is trained): greedy, 3 drafts per step,
    48 tokens after each of three Python prompts; at least 25% of the drafts must be accepted (the correct
    draft keeps 40-60% on such text; a draft fed the wrong token or a head of its own keeps about 1%)."""
    from ... import defaults
    from ...checkpoint.load import load_pretrained
    from ...engine import Engine, EngineConfig, SamplingParams
    from ...tokenizer import Tokenizer

    path = defaults.shipped_model_dir()
    if path is None:
        return skipped("the shipped model is not installed with this package")
    model = load_pretrained(path, device=ctx.device, progress=False).eval()
    tok = Tokenizer.from_file(path)
    engine = Engine(model, EngineConfig(max_seqs=4, speculative=3, cuda_graphs=False))
    for i, text in enumerate(DRAFT_PROMPTS):
        engine.add_request(
            str(i), [tok.bos_id] + tok.encode(text), SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        )
    while engine.has_work():
        engine.step()
    st = engine.spec_stats
    rate = st["accepted"] / max(1, st["drafted"])
    return CheckResult(
        rate >= MIN_ACCEPTANCE,
        rate,
        f"{st['accepted']} of {st['drafted']} drafted tokens accepted (at least {MIN_ACCEPTANCE:.0%} needed)",
    )


def indexer_padding(ctx: Context) -> CheckResult:
    """Top-k slots past the visible entries are -1; picked entries are visible (j < (t+1)//ratio)."""
    inp = indexer_inputs(s=13, seed=ctx.seed, device=ctx.device, dtype=ctx.dtype("indexer_topk"))
    got = ops.indexer_topk(**inp)
    visible = (inp["positions"] + 1) // inp["ratio"]  # [s]
    n_vis = visible.view(1, -1, 1)
    slot = torch.arange(got.size(-1), device=got.device).view(1, 1, -1)
    bad_pad = (slot >= n_vis) & (got != -1)
    bad_pick = (slot < n_vis) & ((got < 0) | (got >= n_vis))
    frac = float((bad_pad | bad_pick).float().mean())
    if frac:
        return CheckResult(
            False, frac, f"{int(bad_pad.sum())} padding slots not -1, {int(bad_pick.sum())} picks invisible"
        )
    want = ref.indexer_topk(**upcast(inp))
    same = torch.equal(got.sort(-1).values, want.sort(-1).values)  # the order inside a row is free
    return CheckResult(same, 0.0, "padding slots -1, picks visible, the reference's picks")
