"""Triton `rms_norm` and `rope_tail` vs the plain-torch reference, forward and backward.

fp32 results agree to a few fp32 ulp of the row's magnitude (the norm's sum of squares is added in another
order; under the interpreter cos / sin / rsqrt are numpy's); bf16 results differ by at most one bf16 ulp,
and almost never. Without CUDA the kernels run on the Triton CPU interpreter (`TRITON_INTERPRET=1`, set
only while these tests run; the kernel launcher reads it at launch).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import CUDA, DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
import dsv4.ops.triton.rownorm_rope as nr  # noqa: E402  (a missing kernel module is an error, not a skip)
from dsv4.ops import reference as ref  # noqa: E402

EPS = 1e-6


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()
    yield


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs (and partial sums) allocated by the backend start as NaN: every element must be written."""
    poison_allocator(monkeypatch, nr)


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(ints)


def check_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 8.0, bf16_frac: float = 0.02) -> None:
    """fp32: |got - want| <= ulps * eps32 * (max |want| of the row); half types: at most one ulp of the
    value (of the row's scale, for values far below it), and only on a small fraction of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    row = w.abs().amax(-1, keepdim=True)
    if want.dtype == torch.float32:
        bad = diff > ulps * 2.0**-23 * row
        assert not bad.any(), f"max diff {diff.max().item():.3g} (row scale {row.max().item():.3g})"
        return
    mant = torch.finfo(want.dtype).eps  # 2^-7 (bf16) / 2^-10 (fp16)
    mag = torch.maximum(w.abs(), 2.0**-8 * row)
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-300)))) * mant
    assert (diff <= ulp).all(), f"max diff {diff.max().item():.3g} exceeds one ulp"
    frac = (diff > 0).double().mean().item()
    assert frac <= bf16_frac, f"{frac:.2%} of the elements differ"


def structured_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """[12, n] rows: zeros, huge / tiny magnitudes, one spike, constant, random."""
    g = torch.Generator().manual_seed(4)
    r = torch.randn(12, n, generator=g)
    r[0] = 0.0
    r[1] *= 1e15
    r[2] *= 1e-15
    r[3] *= 1e-30
    r[4] = 0.0
    r[4, n // 3] = 7.5
    r[5] = -3.0
    r[6] *= 1e30 if dtype != torch.float16 else 1e4
    # fp32: subnormals; half types: the smallest normals (the Triton interpreter misreads bf16 subnormals)
    r[7] *= 2.0**-126 if dtype == torch.float32 else 2.0**-120 if dtype == torch.bfloat16 else 2.0**-12
    return r.to(dtype)


# ----------------------------------------------------------------------------- rms_norm
def norm_pair(x: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor):
    """(output, dx, dw) of the triton backend and of the reference."""
    out = []
    for backend in ("triton", "reference"):
        xr = x.clone().requires_grad_()
        wr = None if w is None else w.clone().requires_grad_()
        y = ops.rms_norm(xr, wr, EPS, backend=backend)
        y.backward(g)
        out.append((y.detach(), xr.grad, None if wr is None else wr.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 96), (2, 3, 4, 64), (1, 1, 1024)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_forward_backward(dtype, shape, weighted, poisoned):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1.0).to(DEV) if weighted else None
    grad = torch.randn(*shape, generator=gen).to(dtype).to(DEV)
    (y1, dx1, dw1), (y0, dx0, dw0) = norm_pair(x, w, grad)
    assert ops.calls()[("rms_norm", "triton")] == 1
    check_close(y1, y0)
    check_close(dx1, dx0, ulps=32)
    if weighted:
        contrib = (grad.float() * ref.rms_norm(x.float(), None, EPS)).abs().reshape(-1, shape[-1]).sum(0)
        assert ((dw1 - dw0).abs() <= 32 * 2.0**-23 * contrib + 1e-30).all()
    else:
        assert dw1 is None and dw0 is None


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x^2 overflows, on purpose
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_structured_rows(dtype, poisoned):
    """All-zero rows, huge (x^2 overflows) and tiny (x^2 underflows) magnitudes, a single spike."""
    x = structured_rows(80, dtype).to(DEV)
    w = torch.linspace(-2, 2, 80).to(DEV)
    for weight in (w, None):
        y1 = ops.rms_norm(x, weight, EPS, backend="triton")
        y0 = ref.rms_norm(x, weight, EPS)
        check_close(y1, y0, bf16_frac=0.05)
        assert torch.equal(y1[0], torch.zeros_like(y1[0]))


def test_rms_norm_strided_input():
    """A non-contiguous view (a slice of wider rows, and a transposed one) is read correctly."""
    base = torch.randn(4, 6, 130, device=DEV)
    w = torch.randn(96, device=DEV)
    for x in (base[..., 7:103], base[..., :96].transpose(0, 1)):
        assert not x.is_contiguous()
        check_close(ops.rms_norm(x, w, EPS, backend="triton"), ref.rms_norm(x, w, EPS))


def test_rms_norm_backward_partials_are_repeatable(poisoned):
    """Many rows (several programs, each looping over a ragged share of them): the weight gradient is
    bitwise repeatable and matches the reference."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 600, 512, generator=gen).to(DEV)
    w = torch.randn(512, generator=gen).to(DEV)
    g = torch.randn(1, 600, 512, generator=gen).to(DEV)
    (y1, dx1, dw1), (_, dx0, dw0) = norm_pair(x, w, g)
    (y2, dx2, dw2), _ = norm_pair(x, w, g)
    assert torch.equal(bits(y1), bits(y2)) and torch.equal(bits(dx1), bits(dx2))
    assert torch.equal(bits(dw1), bits(dw2))
    check_close(dx1, dx0, ulps=32)
    contrib = (g * ref.rms_norm(x, None, EPS)).abs().reshape(-1, 512).sum(0)
    assert ((dw1 - dw0).abs() <= 64 * 2.0**-23 * contrib).all()


def test_rms_norm_half_weight(poisoned):
    """A bf16 weight (a model cast to bf16): read as fp32, its gradient rounded once to bf16."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 7, 128, generator=gen).bfloat16().to(DEV)
    w = torch.randn(128, generator=gen).bfloat16().to(DEV)
    g = torch.randn(4, 7, 128, generator=gen).bfloat16().to(DEV)
    (y1, dx1, dw1), (y0, dx0, dw0) = norm_pair(x, w, g)
    check_close(y1, y0)
    check_close(dx1, dx0)
    assert dw1.dtype == torch.bfloat16
    check_close(dw1, dw0, bf16_frac=0.1)


def test_rms_norm_refusals(monkeypatch):
    x = torch.randn(2, 3, 64, device=DEV)
    with pytest.raises(ops.BackendUnavailable, match="dtype"):
        ops.rms_norm(x.double(), None, EPS, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="weight dtype"):
        ops.rms_norm(x, torch.ones(64, dtype=torch.float64, device=DEV), EPS, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="weight shape"):
        ops.rms_norm(x, torch.ones(32, device=DEV), EPS, backend="triton")
    wide = torch.randn(1, nr.MAX_NORM + 1, device=DEV)
    with pytest.raises(ops.BackendUnavailable, match="row width"):
        ops.rms_norm(wide, None, EPS, backend="triton")
    ops.rms_norm(wide, None, EPS)  # the default falls back to the reference
    assert ops.last_backend("rms_norm") == "reference"
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ops.BackendUnavailable, match="CUDA"):
            ops.rms_norm(x, None, EPS, backend="triton")


# ----------------------------------------------------------------------------- rope_tail
def freqs(r: int) -> torch.Tensor:
    return (1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r)).to(DEV)


def rope_pair(x: torch.Tensor, pos: torch.Tensor, f: torch.Tensor, inverse: bool, g: torch.Tensor):
    out = []
    for backend in ("triton", "reference"):
        xr = x.clone().requires_grad_()
        y = ops.rope_tail(xr, pos, f, inverse, backend=backend)
        y.backward(g)
        out.append((y.detach(), xr.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,r", [((2, 7, 128), 64), ((2, 5, 3, 112), 64), ((1, 4, 2, 16), 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_forward_backward(dtype, shape, r, inverse, poisoned):
    gen = torch.Generator().manual_seed(shape[-1] + r)
    x = torch.randn(*shape, generator=gen).to(dtype).to(DEV)
    g = torch.randn(*shape, generator=gen).to(dtype).to(DEV)
    pos = (torch.arange(shape[1]) * 977 + 3).to(DEV)
    f = freqs(r)
    (y1, dx1), (y0, dx0) = rope_pair(x, pos, f, inverse, g)
    assert ops.calls()[("rope_tail", "triton")] == 1
    nope = shape[-1] - r
    assert torch.equal(bits(y1[..., :nope]), bits(x[..., :nope]))  # copied, same bits
    assert torch.equal(bits(dx1[..., :nope]), bits(g[..., :nope]))
    check_close(y1, y0)
    check_close(dx1, dx0)


def test_rope_decode_positions_and_large_angles(poisoned):
    """Decode: one token, positions a [1] device tensor; and positions up to ~1e6 (large angles)."""
    f = freqs(64)
    x = torch.randn(3, 1, 4, 128, device=DEV)
    pos = torch.tensor([12345], device=DEV)
    check_close(ops.rope_tail(x, pos, f, backend="triton"), ref.rope_tail(x, pos, f))
    kv = torch.randn(2, 1, 128, device=DEV)
    check_close(ops.rope_tail(kv, pos, f, True, backend="triton"), ref.rope_tail(kv, pos, f, True))
    x = torch.randn(1, 6, 2, 128, device=DEV)
    pos = torch.tensor([0, 1, 65535, 65536, 999_999, 1_048_575], device=DEV)
    check_close(ops.rope_tail(x, pos, f, backend="triton"), ref.rope_tail(x, pos, f), ulps=16)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_tail(x, pos[:4], f, backend="triton")


def test_rope_strided_views_and_round_trip():
    """q as a head-transposed view, a slice of wider rows and a view with a non-unit inner stride; the
    inverse rotation undoes the forward one."""
    f = freqs(64)
    pos = torch.arange(5, device=DEV) * 31
    base = torch.randn(2, 3, 5, 128, device=DEV)
    wide = torch.randn(2, 5, 200, device=DEV)
    views = [base.transpose(1, 2), wide[..., 40:168], wide[..., :256:2][..., :100]]
    for x in views:
        assert not x.is_contiguous()
        y = ops.rope_tail(x, pos, f, backend="triton")
        check_close(y, ref.rope_tail(x, pos, f))
        back = ops.rope_tail(y, pos, f, True, backend="triton")
        assert torch.allclose(back, x, rtol=0, atol=1e-5 * float(x.abs().max()))
    xb = base.transpose(1, 2).bfloat16()
    back = ops.rope_tail(ops.rope_tail(xb, pos, f, backend="triton"), pos, f, True, backend="triton")
    assert torch.allclose(back.float(), xb.float(), rtol=2**-7, atol=2**-7)


def test_rope_repeatable_and_structured(poisoned):
    """Zero rows and huge / tiny magnitudes; two runs give the same bits."""
    f = freqs(32)
    x = structured_rows(96, torch.float32).view(2, 6, 96).to(DEV)
    pos = torch.arange(6, device=DEV) + 100
    y1 = ops.rope_tail(x, pos, f, backend="triton")
    y2 = ops.rope_tail(x, pos, f, backend="triton")
    assert torch.equal(bits(y1), bits(y2))
    check_close(y1, ref.rope_tail(x, pos, f), ulps=8)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_rewrites_only_the_tail(backend, dtype):
    """inplace=True returns x itself, its tail rotated as the out-of-place op rotates it (same bits), its
    first d - r dims left as they were (marked with NaN: anything written there but their own values shows);
    strided views included. Refused where autograd records x."""
    f = freqs(64)
    pos = torch.arange(5, device=DEV) * 31 + 7
    base = torch.randn(2, 5, 3, 128, device=DEV).to(dtype)  # [b, s, h, d]
    wide = torch.randn(2, 5, 200, device=DEV).to(dtype)
    heads_major = base.transpose(1, 2).contiguous()  # [b, h, s, d]: its transpose is a strided [b, s, h, d]
    for make in (lambda: base.clone(), lambda: heads_major.clone().transpose(1, 2), lambda: wide.clone()[..., 40:168]):
        for inverse in (False, True):
            x = make()
            want = ops.rope_tail(x, pos, f, inverse, backend=backend)
            nope = x[..., :-64]
            nope.fill_(float("nan"))  # marked: the in-place op must leave these alone
            got = ops.rope_tail(x, pos, f, inverse, inplace=True, backend=backend)
            assert got is x
            assert torch.isnan(x[..., :-64]).all()
            assert torch.equal(bits(x[..., -64:]), bits(want[..., -64:]))
    with torch.enable_grad():
        xr = base.clone().requires_grad_()
        with pytest.raises(ValueError, match="requires grad"):
            ops.rope_tail(xr, pos, f, inplace=True, backend=backend)
    with torch.no_grad():  # under no_grad the same tensor may be rotated in place
        xr = base.clone().requires_grad_()
        assert ops.rope_tail(xr, pos, f, inplace=True, backend=backend) is xr


def test_rope_many_tokens_and_odd_head_counts_match_the_reference():
    """Grids with several tokens per program and heads not a power of two (the program's head block is
    masked): in place and out of place, every head of every token rotated as the reference rotates it."""
    f = freqs(32)
    for shape in ((2, 700, 5, 96), (1, 1100, 3, 64), (3, 400, 96)):
        x = torch.randn(*shape, device=DEV)
        pos = torch.arange(shape[1], device=DEV) * 3 + 1
        want = ref.rope_tail(x, pos, f)
        check_close(ops.rope_tail(x, pos, f, backend="triton"), want)
        got = ops.rope_tail(x.clone(), pos, f, inplace=True, backend="triton")
        check_close(got, want)
        assert torch.equal(bits(got[..., :-32]), bits(x[..., :-32]))


def test_rope_refusals(monkeypatch):
    f = freqs(64)
    x = torch.randn(2, 4, 128, device=DEV)
    pos = torch.arange(4, device=DEV)
    with pytest.raises(ops.BackendUnavailable, match="dtype"):
        ops.rope_tail(x.double(), pos, f, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match=r"\[b, s, d\]"):
        ops.rope_tail(x[0], pos, f, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="positions"):
        ops.rope_tail(x, pos.float(), f, backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="rope dims"):
        ops.rope_tail(x, pos, freqs(256), backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="inv_freq"):
        ops.rope_tail(x, pos, f.double(), backend="triton")
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ops.BackendUnavailable, match="CUDA"):
            ops.rope_tail(x, pos, f, backend="triton")
        ops.rope_tail(x, pos, f)
        assert ops.last_backend("rope_tail") == "reference"


def test_fp16_inputs(poisoned):
    """fp16 activations through both ops, forward and backward."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 3, 128, generator=gen).half().to(DEV)
    g = torch.randn(2, 6, 3, 128, generator=gen).half().to(DEV)
    w = torch.randn(128, generator=gen).to(DEV)
    (y1, dx1, dw1), (y0, dx0, dw0) = norm_pair(x, w, g)
    check_close(y1, y0)
    check_close(dx1, dx0)
    assert torch.allclose(dw1, dw0, rtol=1e-5, atol=1e-5)
    pos = torch.arange(6, device=DEV) * 5
    (y1, dx1), (y0, dx0) = rope_pair(x, pos, freqs(64), False, g)
    check_close(y1, y0)
    check_close(dx1, dx0)


# ----------------------------------------------------------------------------- in the model
def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS normalization written out here, in float64: the oracle the model's norms are held to."""
    xd = x.double()
    y = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight.double() * y


def rope_f64(x: torch.Tensor, positions: torch.Tensor, theta: float, r: int, inverse: bool) -> torch.Tensor:
    """Rotary embedding of the last r dims as complex multiplication, in float64: pair (2i, 2i+1) is the
    complex number x[2i] + j x[2i+1], multiplied by exp(+-j * position * theta^(-2i/r))."""
    xd = x.double()
    freq = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = positions.double().cpu().unsqueeze(-1) * freq  # [s, r/2]
    if x.dim() == 4:
        ang = ang.unsqueeze(1)
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang).to(x.device)
    tail = torch.view_as_complex(xd[..., -r:].reshape(*x.shape[:-1], r // 2, 2).contiguous())
    out = torch.view_as_real(tail * rot).flatten(-2)
    return torch.cat([xd[..., :-r], out], -1)


def test_model_norm_and_rope_against_float64_formulas():
    """The model's norm, weightless query norm and rotary embedding (forward and the inverse applied to
    the attention output), with the reference backend, against formulas evaluated here in float64.

    fp32 evaluation: the norm's mean of squares and rsqrt each carry a few ulp, so |err| <= 16 * 2^-23 of
    the row's scale; the rope angle position * inv_freq is rounded in fp32 (|angle| < 2^5 here, so its
    error is < 2^-18 rad) and cos / sin / the products add a few ulp: |err| <= 2^-16 * the pair's norm."""
    from dsv4.config import ModelConfig
    from dsv4.model.layers import RMSNorm, rms_normalize
    from dsv4.model.rope import Rope, apply_rope_tail

    cfg = ModelConfig.preset("tiny")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 5, cfg.dim, generator=gen).to(DEV)
    norm = RMSNorm(cfg.dim).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cfg.dim, generator=gen))
    q = torch.randn(2, 5, 3, cfg.head_dim, generator=gen).to(DEV) * 3
    pos = torch.arange(5, device=DEV) + 7
    with ops.use_backend("reference"):
        for got, w, inp, eps in ((norm(x), norm.weight, x, norm.eps), (rms_normalize(q, 1e-6), None, q, 1e-6)):
            want = rms_norm_f64(inp, w, eps)
            scale = rms_norm_f64(inp, None, eps).abs().amax(-1, keepdim=True) * (1.0 if w is None else w.abs().max())
            assert got.dtype == torch.float32
            assert ((got.double() - want).abs() <= 16 * 2.0**-23 * scale).all()
        rope = Rope(cfg, compressed=False)  # window layers: theta = rope_theta, no YaRN
        for inverse in (False, True):
            got = apply_rope_tail(q, rope, pos, inverse=inverse)
            want = rope_f64(q, pos, cfg.rope_theta, cfg.rope_head_dim, inverse)
            nope = cfg.head_dim - cfg.rope_head_dim
            assert torch.equal(got[..., :nope], q[..., :nope])
            assert (got.double() - want).abs().max() <= 2.0**-16 * float(q.abs().max()) * 2
            pe = rope.apply(q[..., -rope.dim :], pos, inverse=inverse)
            assert (pe.double() - want[..., nope:]).abs().max() <= 2.0**-16 * float(q.abs().max()) * 2
        # closed forms: position 0 is the identity; inv_freq[0] = theta^0 = 1, so the first pair at
        # position p turns by exactly p radians
        tail = q[..., -rope.dim :]
        assert torch.equal(rope.apply(tail, torch.zeros(5, dtype=torch.long, device=DEV)), tail)
        assert rope.inv_freq[0].item() == 1.0
        turned = rope.apply(tail, pos)[..., :2].double()
        a, b = tail[..., 0].double(), tail[..., 1].double()
        c = torch.cos(pos.double()).view(1, 5, 1)
        s_ = torch.sin(pos.double()).view(1, 5, 1)
        assert torch.allclose(turned[..., 0], a * c - b * s_, rtol=0, atol=1e-5 * float(tail.abs().max()))
        assert torch.allclose(turned[..., 1], a * s_ + b * c, rtol=0, atol=1e-5 * float(tail.abs().max()))


def test_model_wiring_triton_close_to_reference():
    """The model's norms and rotary embeddings go through the ops: with the triton backend the fp32 logits
    agree with the reference backend's. Each op agrees to <= 8 fp32 ulps of its row's scale (~1e-6
    relative); the tiny model applies them a few dozen times with gains of order one, so the logits agree
    to 1e-4 of their largest magnitude - a single bf16 rounding anywhere (2^-9 relative) would not. Every
    other op runs its reference in both passes: the other ops' own backends differ by their own roundings,
    which can flip a near-tie of the indexer's or the router's top-k, a discrete change this bound is not
    about."""
    from dsv4.config import ModelConfig
    from dsv4.model.transformer import DeepSeekV4

    cfg = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    model = DeepSeekV4(cfg).to(DEV).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 8), device=DEV)
    with torch.no_grad():
        with ops.use_backend("reference"):
            want = model(tokens).logits.float()
        ops.reset_calls()
        with ops.use_backend("reference"), ops.use_backend({"rms_norm": "triton", "rope_tail": "triton"}, inherit=True):
            got = model(tokens).logits.float()
    ran = ops.calls()
    assert ran[("rms_norm", "triton")] > 10 and ran[("rope_tail", "triton")] > 4
    assert {b for (op, b) in ran if op not in ("rms_norm", "rope_tail")} == {"reference"}
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_bench_parity_rows():
    """`dsv4 bench ops --only parity` rows for the two ops (8 tokens here, 4096 on a GPU): outputs and
    gradients at the small preset's shapes agree with the reference."""
    from dsv4.bench.ops import parity_norm_rope

    rows: list[dict] = []
    parity_norm_rope(DEV, rows)
    parts = {(r["parity"], r["case"], r["part"]) for r in rows}
    assert len(parts) == len(rows) == 9
    for r in rows:
        assert r["rel"] <= (1e-5 if r["dtype"] == "float32" else 1e-3), r
        if r["part"] != "dw":  # bf16: identical but for rare one-ulp differences
            assert r["same_frac"] >= 0.99, r
