"""The shared expert's clamped SwiGLU (`clamped_swiglu`, backend "triton") against its plain-torch reference.

The kernel does the reference's fp32 operations in the reference's order (module docstring of
`dsv4.ops.triton.swiglu`). On CUDA it calls libdevice's exp as torch's silu does and divides correctly
rounded: every output is the reference's bits (`test_cuda_matches_the_reference_bit_for_bit`). On the CPU
interpreter numpy's exp replaces libdevice's and torch's CPU silu uses its own vectorized exp (each within
1 ulp): silu's exp differs by at most 2 ulp, which moves 1 + exp by at most 2 ulp; each side rounds the sum,
the division, the product with up and the weight's product once (half an ulp each, 2 ulp for the two
sides): under 6 ulp of the larger value, asserted as 8. Rounded to bf16 / fp16, two such fp32 values are at
most one ulp of the 16-bit type apart (equal unless a rounding boundary lies between them).
The clamps, the NaN that clamp keeps, the overflow of exp (silu = -0) are exact everywhere.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import swiglu as swiglu_module  # noqa: E402

ULPS = 8  # fp32 outputs on the interpreter (module docstring)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    poison_allocator(monkeypatch, swiglu_module)
    ops.reset_calls()
    yield


def check(gate, up, limit, out_dtype, weight=None):
    """Run both and assert what must hold (module docstring); return the kernel's output."""
    got = ops.clamped_swiglu(gate, up, limit, out_dtype, weight, backend="triton")
    assert ops.last_backend("clamped_swiglu") == "triton"
    want = ref.clamped_swiglu(gate, up, limit, out_dtype, weight)
    assert got.dtype == out_dtype and got.shape == gate.shape
    assert torch.equal(got.isnan(), want.isnan())
    if CUDA:  # the same bits wherever the value is a number (NaN payloads are not the reference's business)
        bits = torch.int16 if out_dtype != torch.float32 else torch.int32
        num = ~want.isnan()
        assert torch.equal(got[num].view(bits), want[num].view(bits))
        return got
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=ULPS * 2.0**-23, atol=1e-37, equal_nan=True)
    else:  # one rounding of the kernel's own fp32 values; so within one 16-bit ulp of the reference's
        own = ops.clamped_swiglu(gate, up, limit, torch.float32, weight, backend="triton").to(out_dtype)
        num = ~own.isnan()
        assert torch.equal(got.isnan(), ~num) and torch.equal(got[num], own[num])
        g, w = got.float(), want.float()
        ulp = torch.finfo(out_dtype).eps * torch.maximum(g.abs(), w.abs())
        ok = ((g - w).abs() <= ulp + torch.finfo(out_dtype).smallest_normal) | (g.isnan() & w.isnan())
        assert ok.all(), f"{(~ok).sum().item()} elements more than one ulp apart"
    return got


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_random_inputs_match_the_reference(in_dtype, out_dtype, weighted):
    g = torch.Generator().manual_seed(1)
    for T, I in ((1, 512), (7, 96), (64, 768), (3, 5)):
        gate = (torch.randn(T, I, generator=g) * 6).to(in_dtype).to(DEV)
        up = (torch.randn(T, I, generator=g) * 6).to(in_dtype).to(DEV)
        weight = torch.rand(T, 1, generator=g).to(DEV) if weighted else None
        check(gate, up, 7.0, out_dtype, weight)


def test_structured_inputs():
    """The clamps at and beyond the limit, both signs; zeros; NaN in either input (kept); +inf gates
    (clamped to the limit); gates so negative that exp overflows (silu = -0, the product a signed zero);
    no clamp at a limit of 0."""
    L = 2.5
    special = [0.0, -0.0, L, -L, L * 1.5, -L * 1.5, 1e30, -1e30, float("nan"), float("inf"), -100.0, -89.0, 88.0]
    vals = torch.tensor(special)
    gate = vals.repeat_interleave(len(special)).view(len(special), len(special)).to(DEV)
    up = vals.repeat(len(special)).view(len(special), len(special)).to(DEV)
    out = check(gate, up, L, torch.float32)
    assert out[gate > L].isnan().sum() == up[gate > L].isnan().sum()  # only up's NaN survive a clamped gate
    assert (out.abs() <= L * L).logical_or(out.isnan()).all()  # |silu(min(g, L))| <= L and |up| <= L
    check(gate, up, L, torch.bfloat16)
    finite = torch.where(gate.isinf() | (gate.abs() > 1e3), 0.0, gate)
    check(finite, up.nan_to_num(posinf=3.0, neginf=-3.0), 0.0, torch.float32)  # no clamp


def test_every_element_is_written_at_block_edges():
    """Sizes around the kernel's block (the poisoned allocator: an unwritten element is NaN)."""
    g = torch.Generator().manual_seed(2)
    for n in (1, 1023, 1024, 1025, 3 * 1024 + 7):
        gate = torch.randn(1, n, generator=g).to(DEV)
        up = torch.randn(1, n, generator=g).to(DEV)
        out = check(gate, up, 7.0, torch.float32)
        assert not out.isnan().any()
    empty = torch.zeros(0, 8, device=DEV)
    assert ops.clamped_swiglu(empty, empty, 7.0, torch.bfloat16, backend="triton").shape == (0, 8)


def test_refusals_name_their_reason():
    x = torch.randn(4, 16, device=DEV)

    def why(*args, **kw):
        return ops.refusal("clamped_swiglu", "triton", *args, **kw)

    assert why(x, x, 7.0, torch.bfloat16) is None
    assert "one shape" in why(x, x[:, :8], 7.0, torch.bfloat16)
    assert "contiguous" in why(x.t(), x.t(), 7.0, torch.bfloat16)
    assert "fp32 / bf16 / fp16" in why(x.double(), x.double(), 7.0, torch.bfloat16)
    assert "weight" in why(x, x, 7.0, torch.bfloat16, torch.ones(4, device=DEV))
    x.requires_grad_(True)
    assert why(x, x, 7.0, torch.bfloat16) is None  # autograd: the kernel has its backward


def _grads(fn, gate, up, weight, limit, out_dtype, go):
    leaves = [t.clone().requires_grad_() for t in (gate, up)] + (
        [weight.clone().requires_grad_()] if weight is not None else []
    )
    out = fn(*leaves[:2], limit, out_dtype, leaves[2] if weight is not None else None)
    out.backward(go)
    return out.detach(), [t.grad for t in leaves]


def check_backward(gate, up, limit, out_dtype, weight=None, seed=0):
    """The kernel's gradients against the reference's autograd. Each side evaluates the same fp32 formulas:
    the sigmoid s from exp (within 2 ulp: libdevice or numpy against torch's) and two roundings, so within 4u
    relative (u = 2^-24); silu's derivative s (1 + g (1 - s)) within 6u (1 + |g|) of s absolutely, the
    products within a few u more: gate's gradient within 16u |go w up| s (1 + |g|) per side, up's within 16u
    |go w silu(g)| (as the forward's 8 ulp), the weight's (a sum over the row of I terms) within (I + 16)u
    of the sum of |go silu(g) up|. Twice that between the two sides, plus one ulp of a 16-bit gradient; the
    clamped elements' gradient is exactly 0 on both."""
    g = torch.Generator().manual_seed(seed)
    go = (torch.randn(gate.shape, generator=g) * 3).to(out_dtype).to(DEV)
    _, got = _grads(lambda *a: ops.clamped_swiglu(*a, backend="triton"), gate, up, weight, limit, out_dtype, go)
    assert ops.last_backend("clamped_swiglu") == "triton"
    _, want = _grads(ref.clamped_swiglu, gate, up, weight, limit, out_dtype, go)
    G, U, O = gate.double(), up.double(), go.double()
    W = weight.double() if weight is not None else torch.ones_like(G[..., :1])
    if limit > 0:
        G, U = G.clamp(max=limit), U.clamp(-limit, limit)
    sig = torch.sigmoid(G)
    # (a NaN input's magnitude counts 0: where its gradient is a number, both sides must agree exactly)
    mags = [((O * W * U).abs() * sig * (1 + G.abs())).nan_to_num(0.0), (O * W * G * sig).abs().nan_to_num(0.0)]
    u = 2.0**-24
    for name, a, b, mag, t in zip(("gate", "up"), got[:2], want[:2], mags, (gate, up)):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert torch.equal(a.isnan(), b.isnan()), name
        num = ~b.isnan()
        ulp = torch.finfo(t.dtype).eps * torch.maximum(a.abs(), b.abs()).double() if t.dtype != torch.float32 else 0
        bound = 32 * u * mag + ulp + torch.finfo(t.dtype).smallest_normal
        assert ((a.double() - b.double()).abs() <= bound)[num].all(), name
        assert torch.equal(a[b == 0], b[b == 0]), name  # the clamped elements pass nothing
    if weight is not None:
        a, b = got[2], want[2]
        assert a.dtype == torch.float32 and a.shape == weight.shape
        i = gate.size(-1)
        bound = 2 * (i + 16) * u * (O * G * sig * U).abs().nan_to_num(0.0).sum(-1, keepdim=True)
        assert torch.equal(a.isnan(), b.isnan())
        assert ((a.double() - b.double()).abs() <= bound + 1e-37)[~b.isnan()].all(), "weight"


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_backward_matches_the_reference_autograd(in_dtype, weighted):
    g = torch.Generator().manual_seed(6)
    for T, I, limit in ((1, 512, 7.0), (7, 96, 7.0), (40, 300, 7.0), (3, 5, 0.0), (17, 130, 2.0)):
        gate = (torch.randn(T, I, generator=g) * 6).to(in_dtype).to(DEV)
        up = (torch.randn(T, I, generator=g) * 6).to(in_dtype).to(DEV)
        weight = torch.rand(T, 1, generator=g).to(DEV) if weighted else None
        check_backward(gate, up, limit, in_dtype, weight, seed=T)


def test_the_backward_at_the_limits():
    """Gates and ups at, beyond and inside the clamps, both signs, zeros, very negative gates (exp
    overflows), NaN (its gradient NaN where it is not clamped away, as the reference's)."""
    L = 2.5
    special = [0.0, -0.0, L, -L, L * 1.5, -L * 1.5, -1.2785, -100.0, -89.0, 88.0, 1e30, -1e30, float("nan")]
    vals = torch.tensor(special)
    gate = vals.repeat_interleave(len(special)).view(len(special), len(special)).to(DEV)
    up = vals.repeat(len(special)).view(len(special), len(special)).to(DEV)
    weight = torch.rand(len(special), 1, generator=torch.Generator().manual_seed(7)).to(DEV)
    check_backward(gate, up, L, torch.float32, weight)
    check_backward(gate[:, :-1], up[:, :-1], L, torch.float32, weight)  # no NaN up: numbers in every row's sum
    check_backward(gate.bfloat16(), up.bfloat16(), L, torch.bfloat16)


def test_the_backward_writes_every_element_of_empty_and_odd_shapes():
    """Row counts around the backward's row block, columns around its column step (the poisoned allocator
    makes an unwritten gradient NaN); no rows: empty gradients and a zero weight gradient."""
    g = torch.Generator().manual_seed(8)
    for t, i in ((1, 1), (15, 129), (16, 128), (33, 257)):
        gate, up = (torch.randn(t, i, generator=g).to(DEV) for _ in range(2))
        check_backward(gate, up, 7.0, torch.float32, torch.rand(t, 1, generator=g).to(DEV))
    gate = torch.zeros(0, 8, device=DEV, requires_grad=True)
    w = torch.zeros(0, 1, device=DEV, requires_grad=True)
    ops.clamped_swiglu(gate, gate, 7.0, torch.bfloat16, w, backend="triton").sum().backward()
    assert gate.grad.shape == (0, 8) and w.grad.shape == (0, 1)


def test_the_shared_expert_runs_the_kernel_forward_and_backward():
    """A no-grad forward picks the kernel for every layer's shared expert and gives the reference's output
    (bit for bit on CUDA, within the interpreter's bounds on the CPU); so does a training forward, whose
    backward is the kernel's too."""
    from dsv4.config import ModelConfig
    from dsv4.model import DeepSeekV4

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).to(DEV)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEV)
    expert = model.layers[0].ffn.shared_experts
    x = torch.randn(5, cfg.dim, generator=torch.Generator().manual_seed(3)).to(DEV)
    with torch.no_grad():
        with ops.use_backend({"clamped_swiglu": "triton"}, inherit=True):
            got = expert(x)
        assert ops.last_backend("clamped_swiglu") == "triton"
        with ops.use_backend({"clamped_swiglu": "reference"}, inherit=True):
            want = expert(x)
    if CUDA:
        assert torch.equal(got, want)
    else:  # each activation within 8 ulp (module docstring), then each side's fp32 sum of I products rounds
        # within I ulp of sum |w2| |h| (the standard bound of a dot product, I u < 0.01)
        with torch.no_grad():
            h = ref.clamped_swiglu(expert.w1(x), expert.w3(x), expert.swiglu_limit, x.dtype)
            mag = h.abs() @ expert.w2.weight.abs().t()  # [5, dim]: sum_i |h_i| |w2_oi|
        u, inner = 2.0**-23, h.size(-1)
        bound = (ULPS * u * 1.01 + 2 * inner * u * 1.01) * mag
        assert ((got - want).abs() <= bound).all()
    with ops.prefer_backend("triton"):
        with torch.no_grad(), ops.which_ran() as ran:
            model(tokens)
        assert ran["clamped_swiglu"] == ["triton"]
        with ops.which_ran() as ran:
            model(tokens)
        assert ran["clamped_swiglu"] == ["triton"]


def test_the_fused_sum_of_the_shared_expert_changes_no_bit():
    """Without autograd or a stage recorder the MoE adds the shared expert to the routed experts' fp32 sum
    and rounds it to the model's dtype in one kernel (`add` into the shared expert's output); with either,
    an fp32 sum and then a cast. The same fp32 addition, rounded once: the same bits."""
    from dsv4.config import ModelConfig
    from dsv4.model import DeepSeekV4
    from dsv4.model.layers import recording

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.bfloat16).to(DEV)
    moe = model.layers[-1].ffn
    x = torch.randn(1, 9, cfg.dim, generator=torch.Generator().manual_seed(4)).to(DEV, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5)).to(DEV)
    with ops.use_backend("reference"), torch.no_grad():
        with AddsIntoOutputs() as fast_adds:
            fast = moe(x, ids, {}, 0.0)
        with recording(lambda name, t: None), AddsIntoOutputs() as slow_adds:
            slow = moe(x, ids, {}, 0.0)
    assert fast_adds.n == slow_adds.n + 1  # the fused sum ran (and only without the recorder)
    assert fast.dtype == slow.dtype == torch.bfloat16
    assert torch.equal(fast, slow)


class AddsIntoOutputs(TorchDispatchMode):
    """Counts the additions into a given output tensor (`add.out`) dispatched inside the block."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ == "add" and func._overloadname == "out"
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_matches_the_reference_bit_for_bit():
    """V4's shapes (moe_inter_dim 2048, 3072) at decode and prefill sizes, bf16 and fp32 projections."""
    g = torch.Generator().manual_seed(5)
    for T, I in ((1, 2048), (64, 2048), (4096, 3072)):
        for dt in (torch.bfloat16, torch.float32):
            gate = (torch.randn(T, I, generator=g) * 8).to(dt).cuda()
            up = (torch.randn(T, I, generator=g) * 8).to(dt).cuda()
            weight = torch.rand(T, 1, generator=g).cuda()
            for out_dtype in (torch.bfloat16, torch.float32):
                check(gate, up, 7.0, out_dtype)
                check(gate, up, 7.0, out_dtype, weight)
