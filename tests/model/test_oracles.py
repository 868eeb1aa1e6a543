"""Model semantics held to oracles that share no code with the implementation: formulas written here and
evaluated in float64, closed forms, and invariances the architecture guarantees.

Each test names the one-line bug it exists to catch; `python3 tools/mutate.py` plants those bugs
and shows which tests kill them.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import formats as fm
from dsv4 import ops
from dsv4.check.capture import capture
from dsv4.config import ModelConfig
from dsv4.model.attention import Attention
from dsv4.model.transformer import DeepSeekV4
from dsv4.ops import reference as ref
from dsv4.ops.moe_shared import clamped_swiglu
from dsv4.train import optim

E4M3_MAX = 448.0


# ----------------------------------------------------------------------------- formulas, in float64
def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 value, from its definition (1 sign, 4 exponent bits with bias 7,
    3 mantissa bits, subnormals at exponent 0, no infinities, 0x7F NaN)."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals and zero
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def on_fp8_grid_pow2(v: torch.Tensor, block: int) -> torch.Tensor:
    """Per block of the last dim: is every value an E4M3 value times the block's UE8M0 scale
    2^ceil(log2(amax / 448))? Returns a bool [..., n / block]."""
    grid = e4m3_grid()
    b = v.double().unflatten(-1, (v.size(-1) // block, block))
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    r = (b / scale).abs()
    nearest = grid[torch.bucketize(r.clamp(max=E4M3_MAX), grid).clamp(max=grid.numel() - 1)]
    lower = grid[(torch.bucketize(r.clamp(max=E4M3_MAX), grid) - 1).clamp(min=0)]
    return ((nearest == r) | (lower == r)).all(-1)


def attention_f64(q, kv, sink, idx, scale):
    """Softmax over the selected keys' scores plus one sink logit per head (the sink is a logit as it is:
    not scaled), the sink's share of the probability dropped; keys = values = kv."""
    q, kv, sink = q.double(), kv.double(), sink.double()
    b, s, h, d = q.shape
    o = torch.zeros(b, s, h, d, dtype=torch.float64)
    lse = torch.zeros(b, s, h, dtype=torch.float64)
    for bi in range(b):
        for t in range(s):
            keys = [int(j) for j in idx[bi, t] if j >= 0]
            for hh in range(h):
                logits = [float(q[bi, t, hh] @ kv[bi, j]) * scale for j in keys] + [float(sink[hh])]
                m = max(logits)
                z = sum(math.exp(v - m) for v in logits)
                lse[bi, t, hh] = m + math.log(z)
                for j, v in zip(keys, logits):
                    o[bi, t, hh] += math.exp(v - m) / z * kv[bi, j]
    return o, lse


def test_sparse_attention_against_float64_softmax_with_sink():
    """Catches: the sink logit multiplied by the softmax scale, a dropped sink, a wrong scale."""
    g = torch.Generator().manual_seed(1)
    b, s, h, d, n = 1, 3, 2, 16, 5
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, n, d, generator=g)
    sink = torch.tensor([1.5, -0.7])
    idx = torch.tensor([[[0, 1, 4], [2, -1, 3], [-1, -1, 0]]])
    scale = d**-0.5
    o, lse = ref.sparse_attention(q, kv, sink, idx, scale)
    o64, lse64 = attention_f64(q, kv, sink, idx, scale)
    # fp32: dot products of 16 terms and a softmax over 4 logits: a few ulp of the magnitudes involved
    assert torch.allclose(o.double(), o64, rtol=0, atol=1e-5 * float(kv.abs().max()))
    assert torch.allclose(lse.double(), lse64, rtol=0, atol=1e-5 * float(lse64.abs().max()))


def test_clamped_swiglu_against_formula():
    """silu(min(gate, limit)) * clamp(up, -limit, limit): the gate is clamped from above only. Catches a
    gate clamped from below too (silu(-20) != silu(-10)), and an unclamped up."""
    limit = 10.0
    gate = torch.tensor([-30.0, -20.0, -10.5, -1.0, 0.0, 3.0, 10.0, 12.0, 50.0])
    up = torch.tensor([5.0, 5.0, -5.0, 2.0, 1.0, 11.0, -12.0, 3.0, 0.5])
    gd, ud = gate.double().clamp(max=limit), up.double().clamp(-limit, limit)
    want = gd / (1 + torch.exp(-gd)) * ud
    tol = 4 * 2.0**-23 * want.abs() + 1e-12
    assert ((clamped_swiglu(gate, up, limit).double() - want).abs() <= tol).all()
    w1, w3 = torch.diag(gate)[:, :], torch.diag(up)
    x = torch.ones(1, gate.numel())
    w2 = torch.eye(gate.numel())
    got = ref.expert_ffn(x, w1, w2, w3, limit)
    assert ((got[0].double() - want).abs() <= tol + 2.0**-23 * want.abs().max()).all()


# ----------------------------------------------------------------------------- the model
def tiny(**kw) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**kw)


def run_stages(cfg: ModelConfig, seed: int = 0, s: int = 16):
    torch.manual_seed(seed)
    model = DeepSeekV4(cfg).eval()
    tokens = torch.randint(2, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ops.use_backend("reference"):
        out, stages = capture(lambda: model(tokens))
    return out.logits, stages


def test_fp8_kv_simulation_happens():
    """With fp8_kv_sim the window KV (and the compressed KV of the compressed layers) holds FP8 values:
    per block of 64 of the non-rope dims, E4M3 values times a power-of-two scale; the rope dims are left in
    full precision. Without it, the same KV is off that grid. Catches a simulation silently skipped."""
    cfg = tiny()
    assert cfg.fp8_kv_sim and cfg.kv_scale_pow2
    nope = cfg.head_dim - cfg.rope_head_dim
    logits_sim, on = run_stages(cfg)
    logits_off, off = run_stages(cfg.replace(fp8_kv_sim=False))
    kv_stages = [k for k in on if (k.endswith(".attn.kv") or k.endswith(".attn.compressed_kv")) and on[k].numel()]
    assert any(k.endswith("compressed_kv") for k in kv_stages) and len(kv_stages) >= cfg.n_layers
    for k in kv_stages:
        assert on_fp8_grid_pow2(on[k][..., :nope], 64).all(), k
        assert not on_fp8_grid_pow2(on[k][..., nope:], 64).all(), k  # rope dims: not rounded
    layer0 = off["layers.0.attn.kv"][..., :nope]
    assert not on_fp8_grid_pow2(layer0, 64).any()
    # the first layer's KV differs by the FP8 rounding alone: at most half an E4M3 step (2^-4 relative)
    # of the block scale, and not by nothing
    diff = (on["layers.0.attn.kv"][..., :nope] - layer0).abs()
    blocks = layer0.abs().unflatten(-1, (nope // 64, 64)).amax(-1, keepdim=True)
    assert (diff.unflatten(-1, (nope // 64, 64)) <= blocks * 2.0**-4).all()
    assert diff.max() > 0 and not torch.equal(logits_sim, logits_off)


def test_attention_is_translation_invariant():
    """q.k depends on the relative position only, and the output is de-rotated at the query's position,
    so shifting every position by a constant leaves a window layer's output unchanged. Catches the output
    rotated forward instead of back, and rope applied at different positions to q and kv."""
    cfg = tiny(fp8_kv_sim=False)
    torch.manual_seed(5)
    attn = Attention(cfg, 0).eval()
    assert attn.ratio == 0
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(cfg.n_heads))
        x = torch.randn(1, 12, cfg.dim)
        with ops.use_backend("reference"):
            base = attn(x, torch.arange(12))
            shifted = attn(x, torch.arange(12) + 1000)
    # fp32 angles at positions ~1000 carry ~1000 * 2^-24 rad of rounding: ~1e-4 relative
    assert (shifted - base).abs().max() <= 1e-3 * base.abs().max()
    assert base.abs().max() > 0


# ----------------------------------------------------------------------------- optimizer diagnostics
def ns5_by_hand(g: torch.Tensor) -> torch.Tensor:
    """Muon's quintic Newton-Schulz, written out: X <- aX + (bA + cA^2)X with A = XX^T, five times, from
    X = G / ||G||_F (the wide orientation), coefficients (3.4445, -4.7750, 2.0315), in float64."""
    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm()
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def test_newton_schulz_diagnostic_is_five_quintic_steps():
    """Catches: 4 (or 6) steps, a wrong coefficient, the normalization skipped."""
    for shape in ((24, 40), (40, 24)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
        got = optim.newton_schulz(g).double()
        want = ns5_by_hand(g)
        # fp32 evaluation of 5 steps of products of [24, 40] matrices with entries <= ~2: ~1e-5 absolute
        assert (got - want).abs().max() <= 1e-4
        s = torch.linalg.svdvals(want)
        assert optim.orthogonalization_error(g) == pytest.approx(float((s - 1).abs().max()), abs=1e-4)


# ----------------------------------------------------------------------------- storage formats
def test_fp8_scale_bytes_from_the_formula():
    """Block scale byte = 127 + ceil(log2(amax / 448)) per 128 x 128 block (UE8M0), computed here with
    math.frexp, not by the encoder under test; fp32 scales = amax / 448."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 300, generator=g) * torch.exp2(torch.randint(-12, 12, (200, 1), generator=g).float())
    _, s = fm.quantize_fp8(w, scale_fmt="ue8m0")
    _, s32 = fm.quantize_fp8(w, scale_fmt="fp32")
    got = fm.as_e8m0_bytes(s).tolist()
    for bi in range(2):
        for bj in range(3):
            amax = float(w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128].abs().max())
            m, e = math.frexp(amax / E4M3_MAX)  # amax/448 = m * 2^e, m in [0.5, 1)
            want = 127 + (e - 1 if m == 0.5 else e)
            assert got[bi][bj] == want, (bi, bj)
            assert float(s32[bi, bj]) == pytest.approx(amax / E4M3_MAX, rel=2.0**-23)


def test_mxfp4_scale_bytes_from_the_formula():
    """Block scale byte = 127 + ceil(log2(amax / 6)) per 32 values."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (4, 1), generator=g).float())
    _, s = fm.quantize_mxfp4(w)
    got = fm.as_e8m0_bytes(s).tolist()
    for r in range(4):
        for b in range(3):
            m, e = math.frexp(float(w[r, b * 32 : (b + 1) * 32].abs().max()) / 6.0)
            assert got[r][b] == 127 + (e - 1 if m == 0.5 else e), (r, b)


def test_hc_sinkhorn_against_hand_written_iteration():
    """mHC's comb matrix: row softmax (+eps), one column normalization, then iters-1 (row, column)
    normalizations, each dividing by (sum + eps); pre = sigmoid(.) + eps, post = 2 sigmoid(.). Written out
    here in float64 and run for 3 iterations on sharp logits (far from converged, so one iteration more or
    less shows). Catches a wrong iteration count, a missing eps, pre / post swapped or unscaled."""
    hc, iters, eps = 4, 3, 1e-6
    g = torch.Generator().manual_seed(8)
    mixes = torch.randn(5, (2 + hc) * hc, generator=g, dtype=torch.float64) * 4
    scale = torch.tensor([0.7, 1.3, 2.0], dtype=torch.float64)
    base = torch.randn((2 + hc) * hc, generator=g, dtype=torch.float64) * 0.5
    pre, post, comb = ref.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    want_pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    want_post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(5, hc, hc)
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    # float64 in, float64 accumulation or fp32 (acc_dtype): 1e-6 covers fp32 rounding of values <= 2
    for got, want in ((pre, want_pre), (post, want_post), (comb, c)):
        assert (got.double() - want).abs().max() <= 1e-6
