"""Fast MoE and mHC backends vs the references: forward, backward, poisoned memory, determinism.

Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1) at small shapes.
"""

from __future__ import annotations

import importlib

import bounds
import pytest
import torch

import dsv4.ops as ops
from dsv4.ops import reference as R

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)

import dsv4.ops.triton._mm_utils  # noqa: E402,F401  (a missing kernel module is an error, not a skip)

MOE_BACKENDS = ["grouped", "triton"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- MoE
def _moe_inputs(
    seed: int = 0,
    t: int = 37,
    d: int = 64,
    inter: int = 32,
    e: int = 8,
    k: int = 3,
    n_global: int = 12,
    offset: int = 2,
):
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    x = (torch.randn(t, d, generator=g) * 2).to(dt)
    w1 = (torch.randn(e, inter, d, generator=g) * 0.25).to(dt)
    w3 = (torch.randn(e, inter, d, generator=g) * 0.25).to(dt)
    w2 = (torch.randn(e, d, inter, generator=g) * 0.2).to(dt)
    idx = torch.stack([torch.randperm(n_global, generator=g)[:k] for _ in range(t)])  # distinct per token
    idx[0] = torch.tensor([0, 1, n_global - 1])[:k]  # token 0: only other ranks' experts
    idx[1] = torch.tensor([offset, offset + 1, offset + 2])[:k]
    wts = torch.rand(t, k, generator=g) + 0.1
    return x, wts, idx, w1, w2, w3


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    x, wts, idx, w1, w2, w3 = leaves
    y = fn(x, wts, idx.detach(), w1, w2, w3)
    gs = torch.autograd.grad(y, [x, wts, w1, w2, w3], grad_out)
    return y.detach(), gs


@pytest.mark.parametrize("backend", MOE_BACKENDS)
def test_moe_matches_reference_forward_and_backward(backend):
    inputs = _moe_inputs()
    limit = 2.0  # well inside the activations' range: the clamp is exercised (docs/bugzoo.md Z05)
    ref_y = R.moe_experts(*inputs, limit, 2)
    grad_out = torch.randn_like(ref_y)
    y0, g0 = _grads(lambda *a: R.moe_experts(*a, limit, 2), inputs, grad_out)
    ops.reset_calls()
    y1, g1 = _grads(lambda *a: ops.moe_experts(*a, limit, 2, backend=backend), inputs, grad_out)
    assert ops.last_backend("moe_experts") == backend
    assert y1.dtype == torch.float32 and y1.shape == y0.shape
    assert torch.equal(y1[0], torch.zeros_like(y1[0]))  # all experts foreign -> exactly zero
    assert rel(y1, y0) < 5e-3, rel(y1, y0)
    for name, a, b in zip(["x", "weights", "w1", "w2", "w3"], g1, g0):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    # inference path (no autograd: the fused gate/up/SwiGLU kernel for triton)
    with torch.no_grad():
        y2 = ops.moe_experts(*inputs, limit, 2, backend=backend)
    assert rel(y2, y0) < 5e-3


def _nan_empty(real):
    def empty(*size, **kw):
        t = real(*size, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    return empty


@pytest.mark.parametrize("backend", MOE_BACKENDS)
def test_moe_poisoned_memory(backend, monkeypatch):
    """Every fresh buffer (and every grouped-GEMM row past the last group) starts as NaN (docs/bugzoo.md Z09)."""
    inputs = _moe_inputs(seed=1, t=24)
    ref_y = R.moe_experts(*inputs, 10.0, 2)
    grad_out = torch.randn_like(ref_y)
    y0, g0 = _grads(lambda *a: ops.moe_experts(*a, 10.0, 2, backend=backend), inputs, grad_out)

    real_gmm = torch._grouped_mm

    def poisoned_gmm(a, b, offs=None, **kw):
        out = real_gmm(a, b, offs=offs, **kw)
        out[offs[-1] :] = float("nan")
        return out

    monkeypatch.setattr(torch, "empty", _nan_empty(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_empty(torch.empty_like))
    monkeypatch.setattr(torch, "_grouped_mm", poisoned_gmm)
    y1, g1 = _grads(lambda *a: ops.moe_experts(*a, 10.0, 2, backend=backend), inputs, grad_out)
    assert ops.last_backend("moe_experts") == backend
    assert torch.isfinite(y1).all()
    assert torch.equal(y1, y0)
    for a, b in zip(g1, g0):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", MOE_BACKENDS)
def test_moe_deterministic_repeats(backend):
    inputs = _moe_inputs(seed=2, t=16)
    grad_out = torch.randn(16, 64)
    ops.set_deterministic(True)
    try:
        runs = [_grads(lambda *a: ops.moe_experts(*a, 10.0, 2, backend=backend), inputs, grad_out) for _ in range(2)]
    finally:
        ops.set_deterministic(False)
    (ya, ga), (yb, gb) = runs
    assert torch.equal(ya, yb)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_moe_default_backend_and_refusal():
    """The default is the highest-priority backend that can run; an impossible explicit request raises."""
    inputs = _moe_inputs(seed=3, t=5)
    ops.moe_experts(*inputs, 10.0, 2)
    assert ops.last_backend("moe_experts") == "triton"  # interpreter mode: triton can run on CPU
    with pytest.raises(ops.BackendUnavailable, match="must all be bf16"):
        ops.moe_experts(inputs[0].float(), *inputs[1:3], *(w.float() for w in inputs[3:]), 10.0, 2, backend="triton")


def _routing(case: str, t: int, k: int, n_local: int, offset: int, n_global: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_global, (t, k), generator=g)
    if case == "one_expert":
        idx.fill_(offset + n_local - 1)
    elif case == "sparse":  # most experts empty, plus a few foreign slots
        idx = offset + 2 * torch.randint(0, 3, (t, k), generator=g)
        idx[::5, 0] = offset + n_local
    elif case == "foreign":
        idx = offset + n_local + torch.randint(0, 4, (t, k), generator=g)
    wts = torch.rand(t, k, generator=g) + 0.1
    return wts, idx


PLAN_CASES = [  # case, T, k, n_local, expert_offset, n_global   (T*k never a multiple of 64)
    ("random", 37, 3, 8, 2, 12),
    ("random", 23, 1, 8, 0, 8),
    ("random", 45, 6, 32, 4, 48),
    ("one_expert", 50, 4, 8, 3, 16),
    ("sparse", 41, 2, 16, 5, 32),
    ("foreign", 30, 3, 8, 8, 32),
    ("random", 19, 4, 256, 20, 300),
    ("random", 13, 6, 384, 0, 400),
]


@pytest.mark.parametrize("case,t,k,n_local,offset,n_global", PLAN_CASES)
def test_moe_triton_plan_equals_sort_plan(case, t, k, n_local, offset, n_global):
    """The counting-sort plan is `moe_plan` bit for bit (stable order, foreign slots last), and the
    tile table its last kernel writes is the one `_Tiles` builds from `ends`."""
    from dsv4.ops.moe_shared import moe_plan

    moe = importlib.import_module("dsv4.ops.triton.moe")
    wts, idx = _routing(case, t, k, n_local, offset, n_global)
    for w, i in ((wts, idx), (wts.bfloat16(), idx.int())):
        want = moe_plan(w, i, n_local, offset)
        got, tiles = moe._plan_and_tiles(w, i, n_local, offset, 16)
        for name in ("order", "token", "valid", "weight", "ends"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
        assert (got.n_tokens, got.topk) == (t, k)
        ref = moe._Tiles(want.ends, t * k, 16)
        for name in ("group", "row", "end"):
            assert torch.equal(getattr(tiles, name), getattr(ref, name)), name
    assert torch.equal(moe.triton_moe_plan(wts, idx, n_local, offset).order, want.order)


def test_moe_triton_plan_many_chunks(monkeypatch):
    """Several chunks of several 64-slot blocks each, and counts read back in several tiles."""
    from dsv4.ops.moe_shared import moe_plan

    moe = importlib.import_module("dsv4.ops.triton.moe")
    monkeypatch.setattr(moe, "_PLAN_CT", 4 * 512)  # 4 chunks per tile of counts
    for t, n_local in ((555, 256), (161, 8)):  # 2220 slots in 18 chunks; 644 in 11
        wts, idx = _routing("random", t, 4, n_local, 1, n_local + 4, seed=t)
        want = moe_plan(wts, idx, n_local, 1)
        got = moe.triton_moe_plan(wts, idx, n_local, 1)
        for name in ("order", "token", "valid", "weight", "ends"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    # more experts than the kernels take: the sort plan, and the tile table still matches
    monkeypatch.setattr(moe, "_PLAN_MAX_BUCKETS", 8)
    got, tiles = moe._plan_and_tiles(wts, idx, n_local, 1, 16)
    assert torch.equal(got.order, want.order) and torch.equal(got.ends, want.ends)
    assert torch.equal(tiles.group, moe._Tiles(want.ends, want.order.numel(), 16).group)


def test_moe_triton_output_unchanged_by_plan(monkeypatch):
    """The Triton backend gives the same bits with the counting-sort plan as with the sort plan."""
    from dsv4.ops.moe_shared import moe_plan

    moe = importlib.import_module("dsv4.ops.triton.moe")
    inputs = _moe_inputs(seed=4, t=21)
    grad_out = torch.randn(21, 64)
    with torch.no_grad():
        y_new = ops.moe_experts(*inputs, 2.0, 2, backend="triton")
    g_new = _grads(lambda *a: ops.moe_experts(*a, 2.0, 2, backend="triton"), inputs, grad_out)

    def sort_plan(weights, indices, n_local, expert_offset, bm):
        plan = moe_plan(weights, indices, n_local, expert_offset)
        return plan, moe._Tiles(plan.ends, plan.order.numel(), bm)

    monkeypatch.setattr(moe, "_plan_and_tiles", sort_plan)
    with torch.no_grad():
        y_old = ops.moe_experts(*inputs, 2.0, 2, backend="triton")
    g_old = _grads(lambda *a: ops.moe_experts(*a, 2.0, 2, backend="triton"), inputs, grad_out)
    assert torch.equal(y_new, y_old)
    assert torch.equal(g_new[0], g_old[0]) and all(torch.equal(a, b) for a, b in zip(g_new[1], g_old[1]))


# ----------------------------------------------------------------------------- mHC
def _mhc():
    return importlib.import_module("dsv4.ops.triton.mhc")


def _hc_inputs(seed: int = 0, b: int = 2, s: int = 9, hc: int = 4, d: int = 64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    x = torch.randn(b, s, hc, d, generator=g)
    x[0, 0] *= 30.0  # one token with a large residual
    if b > 1 and s > 2:
        x[1, 2, 1] = 0.0  # one all-zero copy
    x = x.to(dtype)
    fn = torch.randn(mix, hc * d, generator=g) * 0.05
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(mix, generator=g) * 0.3
    return x, fn, scale, base


def test_hc_rows_do_not_depend_on_the_batch_under_exact_accumulation():
    """The engine's deterministic mode (exact accumulation): a token's hc_pre and hc_head outputs alone
    equal its outputs among others, bit for bit, at token counts whose automatic K split differs."""
    from dsv4.ops.precision import exact_accumulation

    mhc = _mhc()
    x, fn, scale, base = _hc_inputs(seed=21, b=1, s=80, d=256)
    counts = (1, 7, 80)
    assert len({mhc._split_plan(t, 4 * 256, x.device) for t in counts}) > 1  # (the automatic plans differ)
    g = torch.Generator().manual_seed(22)
    hfn, hscale, hbase = torch.randn(4, 4 * 256, generator=g) * 0.05, torch.rand(1, generator=g) + 0.5, torch.randn(4)
    with torch.no_grad(), exact_accumulation(True):
        assert len({mhc._split_plan(t, 4 * 256, x.device) for t in counts}) == 1
        outs = [ops.hc_pre(x[:, :t], fn, scale, base, 1e-6, 1e-6, 20, backend="triton") for t in counts]
        heads = [ops.hc_head(x[:, :t], hfn, hscale, hbase, 1e-6, 1e-6, backend="triton") for t in counts]
    for out in outs[1:]:
        assert all(torch.equal(a, b[:, :1]) for a, b in zip(outs[0], out))
        assert all(torch.equal(a[:, :7], b[:, :7]) for a, b in zip(outs[1], out))
    assert all(torch.equal(heads[0], h[:, :1]) for h in heads[1:])


def test_launch_plans_do_not_depend_on_the_batch_under_exact_accumulation(monkeypatch):
    """Under exact accumulation a kernel's plan for a row is the same at any row count: the grouped GEMMs'
    row tile (their autotuned config is keyed on it), sparse attention's plan (key block, splits) and the
    RMSNorm's rows per program (how threads share a row's sum), which otherwise change between
    decode-sized and prefill-sized calls. Checked as compiled for a GPU (the
    interpreter pins some of them)."""
    from dsv4.ops.precision import exact_accumulation
    from dsv4.ops.triton import int8_gemm, moe, rownorm_rope, sparse_attention

    for mod in (moe, int8_gemm):
        monkeypatch.setattr(mod, "_INTERPRET", False)
    monkeypatch.setattr(sparse_attention, "interpret_mode", lambda: False)
    monkeypatch.setattr(sparse_attention, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    rows = (1, 64, 4096, 65536)
    # the automatic plans differ with the batch (what makes this test able to fail)
    assert len({moe._block_m(n, 8) for n in rows}) > 1 and len({int8_gemm._block_m(n, 8) for n in rows}) > 1
    for heads in (64, 16):  # (16 heads: the narrow head block's configs)
        assert len({str(sparse_attention.plan_forward(n, 1, heads, 640, dev)) for n in rows}) > 1
    assert len({rownorm_rope._norm_tiles(1024, n) for n in rows}) > 1
    with exact_accumulation(True):
        assert len({moe._block_m(n, 8) for n in rows}) == 1
        assert len({int8_gemm._block_m(n, 8) for n in rows}) == 1
        for heads in (64, 16):
            assert len({str(sparse_attention.plan_forward(n, 1, heads, 640, dev)) for n in rows}) == 1
        assert len({rownorm_rope._norm_tiles(1024, n) for n in rows}) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp16 x meets bf16 weight parts
@pytest.mark.parametrize("split", [0, None])  # single kernel; automatic (split K at 18 tokens)
def test_hc_pre_matches_reference_forward_and_backward(split, dtype, monkeypatch):
    monkeypatch.setattr(_mhc(), "SPLIT_K", split)
    x, fn, scale, base = _hc_inputs(dtype=dtype)
    leaves0 = [t.clone().requires_grad_() for t in (x, fn, scale, base)]
    leaves1 = [t.clone().requires_grad_() for t in (x, fn, scale, base)]
    out0 = R.hc_pre(*leaves0, 1e-6, 1e-6, 20)
    ops.reset_calls()
    out1 = ops.hc_pre(*leaves1, 1e-6, 1e-6, 20, backend="triton")
    assert ops.last_backend("hc_pre") == "triton"
    y0, post0, comb0 = out0
    y1, post1, comb1 = out1
    assert y1.dtype == x.dtype and post1.dtype == torch.float32 and comb1.shape == comb0.shape
    assert (y1.float() - y0.float()).abs().max() <= 2e-2 * y0.float().abs().max()
    assert torch.allclose(post1, post0, rtol=1e-5, atol=1e-6)
    assert torch.allclose(comb1, comb0, rtol=1e-5, atol=1e-6)
    gs = [torch.randn_like(o.float()).to(o.dtype) for o in out0]
    g0 = torch.autograd.grad(out0, leaves0, gs)
    g1 = torch.autograd.grad(out1, leaves1, gs)
    for name, a, b in zip(["x", "fn", "scale", "base"], g1, g0):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < (1e-2 if name == "x" else 1e-4), (name, rel(a, b))


def test_hc_post_matches_reference_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    b, s, hc, d = 2, 5, 4, 96
    f = torch.randn(b, s, d, generator=g).bfloat16()
    res = torch.randn(b, s, hc, d, generator=g).bfloat16()
    post = torch.rand(b, s, hc, generator=g) * 2
    comb = torch.rand(b, s, hc, hc, generator=g)
    l0 = [t.clone().requires_grad_() for t in (f, res, post, comb)]
    l1 = [t.clone().requires_grad_() for t in (f, res, post, comb)]
    o0 = R.hc_post(*l0)
    o1 = ops.hc_post(*l1, backend="triton")
    assert ops.last_backend("hc_post") == "triton"
    assert o1.dtype == o0.dtype
    assert torch.equal(o1, o0) or (o1.float() - o0.float()).abs().max() <= 1e-2
    go = torch.randn_like(o0.float()).bfloat16()
    for name, a, bb in zip(
        ["f", "res", "post", "comb"], torch.autograd.grad(o1, l1, go), torch.autograd.grad(o0, l0, go)
    ):
        assert rel(a, bb) < 5e-3, (name, rel(a, bb))


def _head_inputs(seed: int, b: int = 2, s: int = 9, d: int = 64, dtype=torch.bfloat16):
    x, *_ = _hc_inputs(seed=seed, b=b, s=s, d=d, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    fn = torch.randn(4, 4 * d, generator=g) * 0.2  # (mixes of a few units: the sigmoids far from flat)
    scale = torch.rand(1, generator=g) + 0.5
    base = torch.randn(4, generator=g) * 0.3
    return x, fn, scale, base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [0, None])  # single kernel; automatic (split K at 18 tokens)
def test_hc_head_matches_reference_forward_and_backward(split, dtype, monkeypatch):
    """The head's forward keeps its mixes and RMS scales; its backward (g_pre, the sigmoid's derivative, the
    projection and RMS gradients: hc_pre's without the Sinkhorn) against the reference's autograd."""
    monkeypatch.setattr(_mhc(), "SPLIT_K", split)
    assert (_mhc()._split_plan(2 * 9, 4 * 64, torch.device("cpu"))[0] > 1) == (split is None)
    check_head_backward(torch.device("cpu"), dtype, b=2, s=9, d=64, seed=4)


def check_head_backward(dev: torch.device, dtype: torch.dtype, b: int, s: int, d: int, seed: int) -> None:
    """hc_head's triton forward and backward against the reference's autograd and the float64 formula."""
    inputs = [v.to(dev) for v in _head_inputs(seed, b=b, s=s, d=d, dtype=dtype)]
    x = inputs[0]
    leaves0 = [t.clone().requires_grad_() for t in inputs]
    leaves1 = [t.clone().requires_grad_() for t in inputs]
    y0 = R.hc_head(*leaves0, 1e-6, 1e-6)
    ops.reset_calls()
    y1 = ops.hc_head(*leaves1, 1e-6, 1e-6, backend="triton")
    assert ops.last_backend("hc_head") == "triton"
    assert y1.dtype == x.dtype
    assert (y1.float() - y0.float()).abs().max() <= 1e-2 * y0.float().abs().max()
    gy = torch.randn(y0.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dev, dtype)
    g0 = torch.autograd.grad(y0, leaves0, gy)
    g1 = torch.autograd.grad(y1, leaves1, gy)
    # g_x = t1 + t2: t1 = pre_i g_y (the weighted sum's), t2 = the mixes' (projection and RMS scale). The
    # triton backward evaluates it in fp32 (within err of the exact value, `bounds.hc_head_grad_x`) and rounds
    # once to x's dtype (unit roundoff u); the reference's autograd evaluates t1 and t2 in fp32, rounds each
    # to x's dtype and adds them there. The parameters' fp32 gradients differ by fp32 sums in another order and
    # the two sigmoids' last bits: each within `bounds.hc_head_param_grads` of the exact value
    u = bounds.U[dtype]
    t1, proj, rms, err = bounds.hc_head_grad_x(x, *inputs[1:], gy, 1e-6, 1e-6)
    t2 = proj + rms
    exact = t1 + t2
    to_exact = err + u * (exact.abs() + err)
    to_reference = 2 * err + u * (t1.abs() + t2.abs() + 2 * exact.abs() + 4 * err)
    params = bounds.hc_head_param_grads(x, *inputs[1:], gy, 1e-6, 1e-6)
    for name, a, b in zip(["x", "fn", "scale", "base"], g1, g0):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        if name == "x":
            for want, bound in ((exact, to_exact), (b, to_reference)):
                ok, msg = bounds.within(a, want, bound)
                assert ok, msg
        else:
            for got in (a, b):
                ok, msg = bounds.within(got, *params[name])
                assert ok, (name, msg)
    # the smallest part of g_x, the RMS scale's gradient, exceeds those bounds: a g_x without it fails
    assert (rms.abs() > to_reference).any()


def test_hc_pre_deterministic_and_refuses_fp32():
    x, fn, scale, base = _hc_inputs(seed=6, s=3)
    hashes = []
    ops.set_deterministic(True)
    try:
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (x, fn, scale, base)]
            out = ops.hc_pre(*leaves, 1e-6, 1e-6, 6, backend="triton")  # 6 Sinkhorn iterations
            grads = torch.autograd.grad(out[0].float().sum() + out[2].sum(), leaves)
            hashes.append([o.detach().clone() for o in out] + list(grads))
    finally:
        ops.set_deterministic(False)
    assert all(torch.equal(a, b) for a, b in zip(*hashes))
    with pytest.raises(ops.BackendUnavailable, match="bf16"):
        ops.hc_pre(x.float(), fn, scale, base, 1e-6, 1e-6, 20, backend="triton")


def test_moe_slot_sums_add_in_slot_order_and_follow_no_batch():
    """The inference path's last launch: a token's k slot rows summed in fp32 from 0.0 in slot order (the
    bits of that loop, wide magnitudes so that another order would round differently), and a token's sum
    the same alone as among other tokens."""
    sum_slots = importlib.import_module("dsv4.ops.triton.moe").sum_slots
    g = torch.Generator().manual_seed(5)
    t, k, d = 9, 6, 1100  # d over one program's 1,024 columns
    mag = torch.tensor([1e6, 1.0, -1e6, 3e-3, 7.0, -2.5]).view(1, k, 1)
    out = (torch.randn(t, k, d, generator=g) * mag).to(torch.bfloat16)
    want = torch.zeros(t, d)
    for j in range(k):
        want = want + out[:, j].float()
    got = sum_slots(out.view(t * k, d), t, k)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(sum_slots(out[4].contiguous(), 1, k), want[4:5])
    assert sum_slots(out[:0].reshape(0, d), 0, k).shape == (0, d)


def test_moe_tile_table_covers_every_row_once():
    """Device-built tile table: every row of every group (empty groups, foreign bucket) exactly once."""
    moe = importlib.import_module("dsv4.ops.triton.moe")
    g = torch.Generator().manual_seed(7)
    # (a decode step's few rows among many experts: fewer tiles than groups; 6 rows in 257 buckets, the last
    # one the foreign bucket)
    for n_groups, n_rows, bm in ((1, 0, 16), (3, 5, 16), (33, 250, 16), (8, 200, 64), (256, 6, 16), (256, 40, 16)):
        key = torch.randint(0, n_groups + 1, (n_rows,), generator=g).sort().values
        ends = torch.searchsorted(key, torch.arange(n_groups), right=True).int()
        t = moe._Tiles(ends, n_rows, bm)
        seen = torch.zeros(n_rows, dtype=torch.int64)
        for grp, row, end in zip(t.group.tolist(), t.row.tolist(), t.end.tolist()):
            if grp > n_groups:
                assert end == 0
                continue
            lo = 0 if grp == 0 else int(ends[grp - 1])
            hi = int(ends[grp]) if grp < n_groups else n_rows
            assert end == hi and lo <= row < hi and (row - lo) % bm == 0
            seen[row : min(row + bm, end)] += 1
        assert torch.equal(seen, torch.ones_like(seen))


def test_moe_tile_count_bounds_every_routing():
    """`_n_tiles` (known before the routing is) is at least the tiles any routing of n rows over E experts plus
    the foreign bucket needs, including one row per bucket (the most buckets), and below one tile per expert
    when the rows are fewer than the experts (a decode step's)."""
    moe = importlib.import_module("dsv4.ops.triton.moe")
    g = torch.Generator().manual_seed(3)
    for n_rows, n_groups, bm in ((1, 256, 16), (6, 256, 16), (96, 256, 64), (250, 8, 16), (1000, 3, 128)):
        bound = moe._n_tiles(n_rows, bm, n_groups)
        spread = torch.arange(n_rows) % (n_groups + 1)  # as many buckets as can hold rows
        routings = [spread] + [torch.randint(0, n_groups + 1, (n_rows,), generator=g) for _ in range(50)]
        for key in routings:
            rows = torch.bincount(key, minlength=n_groups + 1)
            assert int(((rows + bm - 1) // bm).sum()) <= bound
        if n_rows < n_groups:
            assert bound < n_groups


def test_hc_pre_sees_in_place_updates_of_fn():
    """An optimizer-style in-place update of fn must reach the next call (nothing stale is reused)."""
    x, fn, scale, base = _hc_inputs(seed=8, s=3)
    fn = torch.nn.Parameter(fn)
    with torch.no_grad():
        ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton")
        fn.mul_(3.0)
        y1 = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, backend="triton")
        y0 = R.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    assert torch.allclose(y1[2], y0[2], rtol=1e-5, atol=1e-6)
    assert (y1[0].float() - y0[0].float()).abs().max() <= 2e-2 * y0[0].float().abs().max()


@pytest.mark.parametrize("hc, head", [(4, False), (4, True), (2, False)])
def test_hc_fn_split_kernel_is_exact(hc, head):
    """The kernel's three bf16 parts equal the torch definition bit for bit, and sum back to fn in fp32,
    on values spread over many binades with zeros, ties and bf16-exact entries mixed in (fp32 subnormals
    are left out: the CPU interpreter flushes them, and mixing weights never come near 1e-38)."""
    from dsv4.ops.torch_native import bf16_parts

    mhc_fn = importlib.import_module("dsv4.ops.triton.mhc_fn")
    k, mix = 96, hc if head else (2 + hc) * hc
    g = torch.Generator().manual_seed(5)
    fn = torch.randn(mix, k, generator=g) * torch.exp2(torch.randint(-40, 40, (mix, k), generator=g).float())
    fn[0, :8] = 0.0
    fn[1, :8] = torch.tensor([1.0, -2.5, 3.0078125, 1 + 2**-8, 1 + 2**-9, 1 + 3 * 2**-9, 3e-30, -1e-20])
    fpp, fcb = mhc_fn.make_split(fn, hc, head)
    parts = torch.stack(bf16_parts(fn.t()))  # [3, K, mix]
    n_pp = hc if head else 2 * hc
    assert torch.equal(fpp[:, :, :n_pp].view(torch.int16), parts[:, :, :n_pp].view(torch.int16))
    assert not fpp[:, :, n_pp:].float().any()  # zero-padded columns
    if not head:
        assert torch.equal(fcb.view(torch.int16), parts[:, :, n_pp:].contiguous().view(torch.int16))
    whole = torch.cat([fpp[:, :, :n_pp], fcb], dim=2) if not head else fpp[:, :, :n_pp]
    back = whole[0].float() + whole[1].float() + whole[2].float()
    rel = ((back - fn.t()).abs() / fn.t().abs().clamp_min(1e-30)).max()
    assert rel <= 2.0**-24


def _pre_fwd_bwd(fwd, inputs, gs):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fwd(*leaves, 1e-6, 1e-6, 20)
    grads = torch.autograd.grad(out, leaves, gs)
    return [o.detach() for o in out], list(grads)


@pytest.mark.parametrize("with_y", [True, False])
def test_hc_pre_projection_grads_over_several_token_splits(with_y, monkeypatch):
    """The backward's one-pass g_x / g_fn kernel with its tokens in several splits (the last one partial)
    and K in several column tiles, against the reference's autograd; without y in the loss (g_y None) only
    the mixes carry x's gradient. g_x: the kernel rounds its fp32 sum once to bf16, the reference's autograd
    rounds the gradients of x's two uses (the mixes, the weighted sum) to bf16 and adds them in bf16: a few
    bf16 steps (2^-8 relative each) of the terms apart, 1e-2 in norm as the test above (the float64 formula
    test below checks the kernel's g_x tightly); g_fn, scale, base: fp32 sums of the same products in
    another order (far below 1e-4 relative at 70 tokens)."""
    mhc_bwd = importlib.import_module("dsv4.ops.triton.mhc_bwd")
    grids, launch = [], mhc_bwd._launch

    def record(kernel, grid, *a, **kw):
        if kernel is mhc_bwd._hc_pre_gx_kernel:
            grids.append(grid)
        launch(kernel, grid, *a, **kw)

    monkeypatch.setattr(mhc_bwd, "_launch", record)
    inputs = _hc_inputs(seed=31, b=2, s=35, d=96)
    g = torch.Generator().manual_seed(32)
    gs = [torch.randn(2, 35, 96, generator=g).bfloat16(), torch.randn(2, 35, 4, generator=g)]
    gs.append(torch.randn(2, 35, 4, 4, generator=g))
    grads = []
    for fwd in (R.hc_pre, lambda *a: ops.hc_pre(*a, backend="triton")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fwd(*leaves, 1e-6, 1e-6, 20)
        used = range(3) if with_y else range(1, 3)
        grads.append(torch.autograd.grad([out[i] for i in used], leaves, [gs[i] for i in used]))
    assert len(grids) == 1 and grids[0][0] > 1 and grids[0][1] > 1, grids  # K tiles x token splits
    (gx0, *rest0), (gx1, *rest1) = grads
    assert gx1.dtype == gx0.dtype == torch.bfloat16
    assert rel(gx1, gx0) < 1e-2, rel(gx1, gx0)
    for name, a, b in zip(["fn", "scale", "base"], rest1, rest0):
        assert rel(a, b) < 1e-4, (name, rel(a, b))


def check_projection_kernel(device: torch.device, t: int, d: int, hc: int = 4, mix: int = 24) -> None:
    """`mhc_bwd.projection_grads` on inputs whose three g_x terms are of one size (so that each one shows),
    against the formula in float64: g_x = gmr fn - c x + pre g_y, g_fn = gmr^T x. The kernel's products are
    exact (tensor-core products of exact bf16 parts of the fp32 operands) and those it leaves out are below
    2^-24 relative each, so fp32 sums of n terms stay within (n + 4) 2^-24 of the sum of the terms'
    magnitudes; a g_x of bf16 x is rounded once more to bf16 (within 2^-8 of itself). x fp32 (split three
    ways as gmr) and bf16 (one exact part); also without g_y (the pre term drops, g_fn is unchanged)."""
    mhc_bwd = importlib.import_module("dsv4.ops.triton.mhc_bwd")
    g = torch.Generator().manual_seed(33)
    x32 = torch.randn(t, hc * d, generator=g)
    gy = torch.randn(t, d, generator=g)
    fn = torch.randn(mix, hc * d, generator=g) / mix**0.5
    gmr = torch.randn(t, mix, generator=g)
    c = torch.randn(t, generator=g)
    pre = torch.rand(t, hc, generator=g) + 0.5
    for x in (x32, x32.bfloat16()):
        X, G, F, M, C, P = (v.double() for v in (x, gy, fn, gmr, c, pre))
        on = [v.to(device) for v in (x, gy, fn, gmr, c, pre)]
        g_x, g_fn = (v.cpu() for v in mhc_bwd.projection_grads(*on))
        assert g_x.dtype == x.dtype and g_fn.dtype == torch.float32
        pg = P.repeat_interleave(d, 1) * G.repeat(1, hc)  # pre[t, k // d] g_y[t, k % d]
        want_x = M @ F - C[:, None] * X + pg
        size_x = M.abs() @ F.abs() + (C[:, None] * X).abs() + pg.abs()
        rounding = 2.0**-8 * g_x.double().abs() if x.dtype == torch.bfloat16 else 0.0
        assert ((g_x.double() - want_x).abs() <= (mix + 4) * 2.0**-24 * size_x + rounding).all()
        want_fn, size_fn = M.t() @ X, M.t().abs() @ X.abs()
        assert ((g_fn.double() - want_fn).abs() <= (t + 4) * 2.0**-24 * size_fn).all()
        on[1] = None
        g_x0, g_fn0 = (v.cpu() for v in mhc_bwd.projection_grads(*on))
        rounding = 2.0**-8 * g_x0.double().abs() if x.dtype == torch.bfloat16 else 0.0
        assert ((g_x0.double() - (want_x - pg)).abs() <= (mix + 4) * 2.0**-24 * size_x + rounding).all()
        assert torch.equal(g_fn0, g_fn)


def test_hc_pre_projection_kernel_against_its_formula_in_float64():
    check_projection_kernel(torch.device("cpu"), t=45, d=40)  # 3 token splits, 5 column tiles here


def test_hc_pre_backward_of_an_empty_batch():
    """No tokens: empty gradients for x, zero ones for the weights, and no launch (a zero grid fails)."""
    x, fn, scale, base = (t.requires_grad_() for t in _hc_inputs(seed=2, b=1, s=1))
    y, post, comb = ops.hc_pre(x[:, :0], fn, scale, base, 1e-6, 1e-6, 20, backend="triton")
    (y.float().sum() + post.sum() + comb.sum()).backward()
    assert x.grad.abs().sum() == 0 and fn.grad.abs().sum() == 0 and base.grad.abs().sum() == 0


def test_a_marked_mix_weight_is_split_once(monkeypatch):
    """`ops.keep_splits` (the serving engine, the graphed decoders) marks the mHC mix weights too: hc_pre
    and hc_head then split a weight into its bf16 parts once, with the bits of a split made at the call,
    and again after an in-place write; a weight autograd tracks is split at every call (training, whose
    captured graphs must replay the split against the weights of the moment)."""
    from torch import nn

    from dsv4.memory import hc_fn_split_bytes

    mhc_fn = importlib.import_module("dsv4.ops.triton.mhc_fn")
    made: list[tuple[int, bool]] = []
    real = mhc_fn.make_split
    monkeypatch.setattr(mhc_fn, "make_split", lambda fn, hc, head: made.append((hc, head)) or real(fn, hc, head))
    x, fn, scale, base = _hc_inputs(seed=31, b=1, s=5, d=32)
    g = torch.Generator().manual_seed(32)
    mod = nn.Module()
    mod.fn = nn.Parameter(fn.clone())
    mod.head_fn = nn.Parameter(torch.randn(4, 4 * 32, generator=g) * 0.05)

    def run(fn_, head_fn_):
        pre = ops.hc_pre(x, fn_, scale, base, 1e-6, 1e-6, 20, backend="triton")
        return (*pre, ops.hc_head(x, head_fn_, scale[:1], base[:4], 1e-6, 1e-6, backend="triton"))

    def fresh():  # unmarked copies: split at the call
        return run(mod.fn.detach().clone(), mod.head_fn.detach().clone())

    with torch.no_grad():
        want = fresh()
        assert len(made) == 2
        made.clear()
        for fn_ in (mod.fn, mod.head_fn):  # what is kept is what `dsv4.memory` counts
            parts = {id(t): t for t in mhc_fn.split_fn(fn_, 4, fn_.size(0) == 4)}.values()
            assert sum(t.numel() * t.element_size() for t in parts) == hc_fn_split_bytes(*fn_.shape, 4)
        ops.keep_splits(mod)
        made.clear()
        got = [run(mod.fn, mod.head_fn) for _ in range(3)]
        assert made == [(4, False), (4, True)]  # once each, the first call
        assert all(torch.equal(a, b) for out in got for a, b in zip(out, want))
        mod.fn.mul_(-2.0)  # in place: its version moves
        made.clear()
        after = run(mod.fn, mod.head_fn)
        assert made == [(4, False)]
        assert all(torch.equal(a, b) for a, b in zip(after, fresh()))
    made.clear()
    for _ in range(2):  # tracked by autograd: split at every call
        y, post, comb = ops.hc_pre(x, mod.fn, scale, base, 1e-6, 1e-6, 20, backend="triton")
    (y.float().sum() + post.sum() + comb.sum()).backward()
    assert made == [(4, False)] * 2 and mod.fn.grad is not None and mod.fn.grad.abs().sum() > 0


@pytest.mark.parametrize("t, d, split", [(1, 256, None), (3, 256, 6), (17, 256, 3), (1, 1024, None)])
def test_hc_pre_split_k_matches_reference_and_single_kernel(t, d, split, monkeypatch):
    """Decode shapes (one token per sequence) through the split-K path: partial mixes over uneven K slices
    summed in a second kernel, the weighted reduce shared out over column blocks."""
    mhc = _mhc()
    tile = 128 if d > 256 else 64  # fewer interpreter steps (128: the compiled tile sizes)
    monkeypatch.setattr(mhc, "_SPLIT_BK", tile)
    monkeypatch.setattr(mhc, "_FINISH_BD", tile)
    inputs = _hc_inputs(seed=10 + t, b=t, s=1, d=d)
    x = inputs[0]
    monkeypatch.setattr(mhc, "SPLIT_K", split)
    assert mhc._split_plan(t, 4 * d, x.device)[0] > 1
    g = torch.Generator().manual_seed(t)
    gs = [
        torch.randn(t, 1, d, generator=g).bfloat16(),
        torch.randn(t, 1, 4, generator=g),
        torch.randn(t, 1, 4, 4, generator=g),
    ]
    (y0, post0, comb0), g0 = _pre_fwd_bwd(R.hc_pre, inputs, gs)
    (y1, post1, comb1), g1 = _pre_fwd_bwd(lambda *a: ops.hc_pre(*a, backend="triton"), inputs, gs)
    assert ops.last_backend("hc_pre") == "triton"
    assert (y1.float() - y0.float()).abs().max() <= 2e-2 * y0.float().abs().max()
    assert torch.allclose(post1, post0, rtol=1e-5, atol=1e-6)
    assert torch.allclose(comb1, comb0, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["x", "fn", "scale", "base"], g1, g0):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < (1e-2 if name == "x" else 1e-4), (name, rel(a, b))
    if d > 256:
        return
    monkeypatch.setattr(mhc, "SPLIT_K", 0)  # the single kernel: equal up to fp32 summation order
    with torch.no_grad():
        y2, post2, comb2 = ops.hc_pre(*inputs, 1e-6, 1e-6, 20, backend="triton")
    # y: two fp32 evaluations of sum_h pre_h x_h (each within hc_weighted_sum_error of the exact value, the
    # mixes summed in another order), each rounded once to bf16: not "1 bf16 ulp of y", since y can be
    # much smaller than the terms it sums
    x, fn, scale, base = inputs
    v_err = bounds.hc_weighted_sum_error(x, fn, scale, base, 1e-6, 1e-6)  # [t, 1, d]
    ok, msg = bounds.within(y1, y2, 2 * v_err + bounds.rounding_pair(y1, y2))
    assert ok, msg
    # post = 2 sigmoid(mix * scale + base): sigmoid' <= 1/4, each side off by |scale| / 4 * mix error
    mix_err = bounds.hc_mix_error(x, fn, 1e-6)[1][..., 4:8]
    post_err = 2 * (abs(float(scale[1])) / 4 * mix_err + bounds.FUNC_ULPS * bounds.U32)
    ok, msg = bounds.within(post1, post2, 2 * post_err)
    assert ok, msg
    assert torch.allclose(comb1, comb2, rtol=1e-5, atol=1e-7)


def test_hc_pre_split_k_bitwise_repeats_on_poisoned_memory(monkeypatch):
    """Split path: every workspace entry read is written (NaN-filled fresh buffers change nothing) and
    the partials are summed in a fixed order (bit-identical repeats)."""
    mhc = _mhc()
    monkeypatch.setattr(mhc, "SPLIT_K", 3)
    inputs = _hc_inputs(seed=12, b=5, s=1, d=64)
    gs = [torch.randn(5, 1, 64).bfloat16(), torch.randn(5, 1, 4), torch.randn(5, 1, 4, 4)]
    fwd = lambda *a: ops.hc_pre(*a, backend="triton")  # noqa: E731
    runs = [_pre_fwd_bwd(fwd, inputs, gs)]
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _nan_empty(torch.empty))
        runs.append(_pre_fwd_bwd(fwd, inputs, gs))
    runs.append(_pre_fwd_bwd(fwd, inputs, gs))
    flat = [out + grads for out, grads in runs]
    assert all(torch.isfinite(a).all() for a in flat[1])
    for other in flat[1:]:
        assert all(torch.equal(a, b) for a, b in zip(flat[0], other))


@pytest.mark.parametrize("t, d", [(1, 64), (17, 160)])
def test_hc_head_split_k(t, d, monkeypatch):
    """hc_head shares the launcher: split K (and 160 columns shared out unevenly) vs reference and vs
    the single kernel."""
    mhc = _mhc()
    x, *_ = _hc_inputs(seed=13, b=t, s=1, d=d)
    g = torch.Generator().manual_seed(14)
    fn = torch.randn(4, 4 * d, generator=g) * 0.05
    scale = torch.rand(1, generator=g) + 0.5
    base = torch.randn(4, generator=g) * 0.3
    outs = []
    for split in (None, 0):
        monkeypatch.setattr(mhc, "SPLIT_K", split)
        assert (mhc._split_plan(t, 4 * d, x.device)[0] > 1) == (split is None)
        with torch.no_grad():
            outs.append(ops.hc_head(x, fn, scale, base, 1e-6, 1e-6, backend="triton"))
        assert ops.last_backend("hc_head") == "triton"
    y0 = R.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    # each of the three is an fp32 evaluation of sum_h pre_h x_h (within v_err of the exact value) rounded
    # once to bf16 (see bounds.hc_weighted_sum_error)
    v_err = bounds.hc_weighted_sum_error(x, fn, scale, base, 1e-6, 1e-6)
    for a, b in ((outs[0], y0), (outs[0], outs[1])):
        ok, msg = bounds.within(a, b, 2 * v_err + bounds.rounding_pair(a, b))
        assert ok, msg


def test_hc_split_plan_by_waves(monkeypatch):
    """The automatic K split (outside exact accumulation), on a 132-SM device: past one wave of the partial
    kernel's 64-row programs the single kernel; up to one wave, 2 to 8 slices (under half a wave, about one
    wave of programs). Every plan's slices cover K exactly once."""
    mhc = _mhc()
    monkeypatch.setattr(mhc, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(mhc, "_SPLIT_BK", 128)
    monkeypatch.setattr(mhc, "SPLIT_K", None)
    k = 4 * 1024
    dev = torch.device("cpu")
    assert mhc._split_plan(133 * 64, k, dev) == (1, k)
    for t in (66 * 16, 1088, 1600, 132 * 16, 2176, 4096, 132 * 64):
        n, ks = mhc._split_plan(t, k, dev)
        assert 2 <= n <= 8 and (n - 1) * ks < k <= n * ks and ks % 128 == 0
    n, ks = mhc._split_plan(64, k, dev)  # 4 programs of 16 rows: 32 slices (K's 32 blocks of 128) at most
    assert n == 32 and ks == 128
    assert mhc._split_plan(0, k, dev) == (1, k)
