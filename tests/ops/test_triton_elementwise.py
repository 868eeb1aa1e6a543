"""Triton round trips, Hadamard, compress_pool and pool_groups vs the plain-torch reference.

Round trips must be bit-identical (random and structured inputs: all-zero blocks, huge / tiny / subnormal
magnitudes, grid midpoints, scales just above a power of two, NaN / inf blocks, signed zeros). Hadamard
and compress_pool agree to fp32 rounding (Hadamard bit-for-bit under exact accumulation). Without CUDA the
kernels run on the Triton CPU interpreter (`TRITON_INTERPRET=1`, set only while these tests run; the
kernel launcher reads it at launch).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

from triton_interp import DEV, interpret_unless_cuda, poison_allocator  # noqa: E402

import dsv4.ops as ops  # noqa: E402
import dsv4.ops.triton.elementwise as ew  # noqa: E402  (a missing kernel module is an error, not a skip)
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.precision import exact_accumulation  # noqa: E402

ROUND_TRIPS = {"fp8_round_trip": 64, "fp4_round_trip": 32}
QMAX = {"fp8_round_trip": 448.0, "fp4_round_trip": 6.0}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    interpret_unless_cuda(monkeypatch)
    ops.reset_calls()
    yield


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs allocated by the backend start as NaN: every element must be written."""
    poison_allocator(monkeypatch, ew)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN matches any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.masked_fill(nan_a, 0).view(ints), b.masked_fill(nan_b, 0).view(ints))


def run_op(op: str, *args, backend: str = "triton"):
    return getattr(ops, op)(*args, backend=backend)


# ----------------------------------------------------------------------------- round trips
def structured_blocks(op: str, block: int) -> torch.Tensor:
    """[rows, block] fp32 rows that each probe one corner of the quantizer (one block per row)."""
    qmax = QMAX[op]
    g = torch.Generator().manual_seed(1)
    rows = []
    if op == "fp8_round_trip":  # E4M3: 3 mantissa bits, subnormal step 2^-9
        grid_mid = [(m + 0.5) * 2.0 ** (e - 3) for e in range(-6, 9) for m in range(8, 16)][:200]
        grid_mid += [(j + 0.5) * 2.0**-9 for j in range(8)]
    else:  # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; the ties
        grid_mid = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.5, 3.0, 0.1, 5.9]
    mids = torch.tensor(grid_mid)
    for k in (-100, -20, -7, 0, 3, 20, 100):  # scale exactly 2^k: amax = qmax * 2^k
        for sgn in (1.0, -1.0):
            vals = mids[torch.randint(len(mids), (block,), generator=g)] * sgn
            vals[0] = qmax
            rows.append(vals * 2.0**k)
    for k in (-120, -60, -20, -8, -3, 9, 20, 60, 110):  # amax / qmax just above / below a power of two
        for ulps in (1, 2, 3, 5, 9, 17, 22, -1, -3):
            top = torch.tensor(qmax * 2.0**k, dtype=torch.float32)
            top = (top.view(torch.int32) + ulps).view(torch.float32)
            vals = torch.randn(block, generator=g) * 2.0 ** (k - 8) * qmax
            vals[3] = top
            vals[5] = 2.0 ** (k - 9) * qmax  # lands near the subnormal range of the format
            rows.append(vals)
    rows.append(torch.zeros(block))  # all-zero block
    rows.append(-torch.zeros(block))  # negative zeros
    rows.append(torch.full((block,), 1e-30))  # tiny (below the amax floor)
    rows.append(torch.full((block,), 1e-45))  # fp32 subnormals
    rows.append(torch.full((block,), 3e38) * torch.sign(torch.randn(block, generator=g)))  # near fp32 max
    rows.append(torch.randn(block, generator=g) * 1e-3)
    poisoned_row = torch.randn(block, generator=g)
    poisoned_row[1] = float("nan")
    rows.append(poisoned_row)  # NaN: whole block NaN
    inf_row = torch.randn(block, generator=g)
    inf_row[2] = float("-inf")
    rows.append(inf_row)  # inf: whole block NaN
    mixed = torch.randn(block, generator=g) * 1e-5
    mixed[: block // 2] = -0.0
    rows.append(mixed)
    return torch.stack(rows)


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact_structured(op, dtype, poisoned):
    block = ROUND_TRIPS[op]
    x = structured_blocks(op, block).reshape(-1, 2 * block)  # two blocks per row
    x = x.to(dtype).to(DEV)
    want = getattr(ref, op)(x, block)
    got = run_op(op, x, block)
    assert ops.last_backend(op) == "triton"
    assert same_bits(got, want), (got.float() - want.float()).abs().nan_to_num(1.0).max()


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bit_exact_random(op, dtype):
    block = ROUND_TRIPS[op]
    g = torch.Generator().manual_seed(2)
    # magnitudes spread over many binades so every scale exponent and the subnormal range are hit
    x = torch.randn(3, 5, 4 * block, generator=g) * torch.exp2(
        torch.randint(-30, 30, (3, 5, 4, 1), generator=g)
    ).repeat_interleave(block, -1).flatten(-2)
    x = (x * torch.exp2(torch.randint(-6, 2, x.shape, generator=g).float())).to(dtype).to(DEV)
    assert same_bits(run_op(op, x, block), getattr(ref, op)(x, block))


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
def test_round_trip_shapes_strides_and_blocks(op):
    block = ROUND_TRIPS[op]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 3, 1, 2 * block + 64, generator=g).to(DEV)
    cases = [
        full[..., : 2 * block],  # the model's `kv[..., :-rope]`: row-strided view
        full[..., : 2 * block].transpose(0, 1),  # odd leading strides
        torch.randn(block, generator=g).to(DEV),  # 1-D
        torch.randn(7, 1, 3 * block, generator=g).to(DEV),
        torch.randn(2 * block, 3, generator=g).to(DEV).t(),  # last dim strided: copied
        torch.randn(0, block, generator=g).to(DEV),  # empty
    ]
    for x in cases:
        assert same_bits(run_op(op, x, block), getattr(ref, op)(x, block)), tuple(x.shape)
    for other in (16, 128):  # other power-of-two blocks
        x = torch.randn(3, 256, generator=g).to(DEV) * 100
        assert same_bits(run_op(op, x, other), getattr(ref, op)(x, other))


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
def test_round_trip_straight_through_backward(op):
    block = ROUND_TRIPS[op]
    x = torch.randn(2, 3, 2 * block, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y = run_op(op, x, block)
    assert y.requires_grad
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(getattr(ref, op)(x2, block), x2, g)
    assert torch.equal(gx, gr) and torch.equal(gx, g)
    with torch.no_grad():
        assert not run_op(op, x, block).requires_grad


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
def test_round_trip_dispatch_and_refusals(op):
    block = ROUND_TRIPS[op]
    x = torch.randn(4, 2 * block, device=DEV)
    ops.reset_calls()
    getattr(ops, op)(x, block)  # default on a device the backend can run on
    assert ops.last_backend(op) == "triton" and ops.calls()[(op, "triton")] == 1
    ragged = torch.randn(2, block + 2, device=DEV)
    if op == "fp4_round_trip":
        with pytest.raises(ValueError, match="not a multiple"):
            run_op(op, ragged, block)
    else:  # FP8: the last block of a row holds the rest
        assert same_bits(run_op(op, ragged, block), getattr(ref, op)(ragged, block))
    odd = torch.randn(2, 48, device=DEV)
    with pytest.raises(ops.BackendUnavailable, match="power of two"):
        run_op(op, odd, 48)  # explicit request: no silent fallback
    assert same_bits(getattr(ops, op)(odd, 48), getattr(ref, op)(odd, 48))
    assert ops.last_backend(op) == "reference"  # the default falls back to the reference
    with pytest.raises(ops.BackendUnavailable, match="dtype"):
        run_op(op, x.double(), block)


def test_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 64)
    with pytest.raises(ops.BackendUnavailable, match="CUDA"):
        ops.fp8_round_trip(x, 64, backend="triton")
    ops.hadamard(x)
    assert ops.last_backend("hadamard") == "reference"


# ----------------------------------------------------------------------------- hadamard
def ulp_close(a: torch.Tensor, b: torch.Tensor, ulps: float) -> bool:
    """|a - b| <= ulps * eps(dtype) * max|b| per row (fp32 rounding of a +-1 weighted sum)."""
    eps = torch.finfo(b.dtype).eps
    scale = b.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return bool(((a.float() - b.float()).abs() <= ulps * eps * scale).all())


@pytest.mark.parametrize("n", [2, 8, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hadamard_forward(n, dtype, poisoned):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 1, 5, n, generator=g) * 3).to(dtype).to(DEV)
    x[0, 0, 0] = 0.0
    x[1, 0, 1] = 0.0
    x[1, 0, 1, 0] = 1.0  # a delta: a row of the matrix, exactly
    got, want = run_op("hadamard", x), ref.hadamard(x)
    assert ops.last_backend("hadamard") == "triton"
    assert ulp_close(got, want, 8 if dtype == torch.float32 else 1.0)
    assert torch.equal(got[0, 0, 0], want[0, 0, 0]) and torch.equal(got[1, 0, 1], want[1, 0, 1])
    # involution: H H = I (up to rounding)
    if dtype == torch.float32:
        assert ulp_close(run_op("hadamard", got), x, 16)


def test_hadamard_bit_exact_under_exact_accumulation():
    g = torch.Generator().manual_seed(5)
    for n in (4, 128):
        x = torch.randn(6, n, generator=g).to(DEV)
        with exact_accumulation():
            assert same_bits(run_op("hadamard", x), ref.hadamard(x))
        xb = x.to(torch.bfloat16)
        with exact_accumulation():
            assert same_bits(run_op("hadamard", xb), ref.hadamard(xb))


def test_hadamard_strided_backward_and_refusals():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(4, 3, 160, generator=g).to(DEV)
    x = base[..., 16:144].transpose(0, 1)  # non-contiguous [3, 4, 128]
    assert ulp_close(run_op("hadamard", x), ref.hadamard(x), 8)
    xr = x.detach().clone().requires_grad_(True)
    xt = x.detach().clone().requires_grad_(True)
    gout = torch.randn(x.shape, generator=g).to(DEV)
    (gr,) = torch.autograd.grad(ref.hadamard(xr), xr, gout)
    (gt,) = torch.autograd.grad(run_op("hadamard", xt), xt, gout)
    assert ulp_close(gt, gr, 8)
    with pytest.raises(ops.BackendUnavailable, match="power of two"):
        run_op("hadamard", torch.randn(2, 96, device=DEV))


# ----------------------------------------------------------------------------- compress_pool
def pool_inputs(lead, slots, c, seed=7, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*lead, slots, c, generator=g) * 2
    score = torch.randn(*lead, slots, c, generator=g) * 3
    flat = score.view(-1, slots, c)
    flat[0, : slots // 2] = float("-inf")  # empty slots (the first group's missing half)
    flat[-1, :, 0] = 40.0  # a peaked softmax: one slot takes everything
    flat[-1, 0, 0] = 80.0
    return kv.to(dtype).to(DEV), score.to(dtype).to(DEV)


@pytest.mark.parametrize("slots,c", [(8, 40), (128, 16), (5, 33), (1, 8)])
def test_compress_pool_forward_backward(slots, c, poisoned):
    kv, score = pool_inputs((2, 3), slots, c)
    want = ref.compress_pool(kv, score)
    got = run_op("compress_pool", kv, score)
    assert ops.last_backend("compress_pool") == "triton"
    assert torch.allclose(got, want, rtol=2e-6, atol=2e-6), (got - want).abs().max()
    gout = torch.randn(want.shape, generator=torch.Generator().manual_seed(8)).to(DEV)
    leaves_r = [kv.clone().requires_grad_(True), score.clone().requires_grad_(True)]
    leaves_t = [kv.clone().requires_grad_(True), score.clone().requires_grad_(True)]
    gr = torch.autograd.grad(ref.compress_pool(*leaves_r), leaves_r, gout)
    gt = torch.autograd.grad(run_op("compress_pool", *leaves_t), leaves_t, gout)
    for a, b in zip(gt, gr):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    assert torch.equal(gt[1][0, 0, : slots // 2], torch.zeros_like(gt[1][0, 0, : slots // 2]))


def test_compress_pool_special_values_and_layouts():
    kv, score = pool_inputs((3,), 8, 24, seed=9)
    score[1, :, 3] = float("-inf")  # a channel with no slot: NaN, as the reference
    got, want = run_op("compress_pool", kv, score), ref.compress_pool(kv, score)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want[1, 3])
    ok = ~torch.isnan(want)
    assert torch.allclose(got[ok], want[ok], rtol=2e-6, atol=2e-6)
    big_kv, big_score = pool_inputs((2, 2), 8, 32, seed=10)
    kv_t, score_t = big_kv.transpose(0, 1), big_score[..., :20]  # strided views
    assert torch.allclose(
        run_op("compress_pool", kv_t, big_score.transpose(0, 1)),
        ref.compress_pool(kv_t, big_score.transpose(0, 1)),
        rtol=2e-6,
        atol=2e-6,
    )
    assert torch.allclose(
        run_op("compress_pool", big_kv[..., :20], score_t),
        ref.compress_pool(big_kv[..., :20], score_t),
        rtol=2e-6,
        atol=2e-6,
    )
    with exact_accumulation():
        a, b = run_op("compress_pool", big_kv, big_score), ref.compress_pool(big_kv, big_score)
    assert torch.allclose(a, b, rtol=1e-7, atol=1e-7)
    kvb, scb = pool_inputs((2,), 8, 16, seed=11, dtype=torch.bfloat16)
    got, want = run_op("compress_pool", kvb, scb), ref.compress_pool(kvb, scb)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want.float(), rtol=8e-3, atol=8e-3)
    with pytest.raises(ops.BackendUnavailable, match="must both be"):
        run_op("compress_pool", kv, score[:, :4])


def test_compressor_pool_matches_reference_in_the_model():
    """The model's own call (overlapping ratio-4 groups, fp32) through the triton backend."""
    from dsv4.config import ModelConfig
    from dsv4.model.attention import Compressor
    from dsv4.model.rope import Rope

    cfg = ModelConfig.preset("tiny")
    rope = Rope(cfg, compressed=True)
    comp = Compressor(cfg, 4, cfg.head_dim, rope, rotate=False).to(DEV)
    x = torch.randn(2, 12, cfg.dim, device=DEV)
    pos = torch.arange(12, device=DEV)
    with ops.use_backend("reference"):
        want = comp(x, pos)[0]
    with ops.use_backend({"compress_pool": "triton", "fp8_round_trip": "triton"}):
        got = comp(x, pos)[0]
    assert ops.calls().get(("compress_pool", "triton"), 0) >= 1
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def pool_groups_inputs(T, R, G, r, coff, c, seed, index_dtype=torch.int64):
    """Rows and indices as a paged step has them: slots from this step's rows and from the ring, ring row 1
    an empty slot (kv 0, score -inf), a group wholly from each source, a peaked softmax, dead groups."""
    g = torch.Generator().manual_seed(seed)
    W, n = coff * c, coff * r
    kv, score = torch.randn(T, W, generator=g) * 2, torch.randn(T, W, generator=g) * 3
    ring_kv, ring_score = torch.randn(R, W, generator=g) * 2, torch.randn(R, W, generator=g) * 3
    ring_kv[1], ring_score[1] = 0.0, float("-inf")
    score[0, 0] = 80.0  # one slot takes everything where row 0 is read
    new = torch.randint(0, T, (G, n), generator=g)
    new[torch.rand(G, n, generator=g) < 0.5] = -1
    new[0] = -1
    new[1] = torch.arange(n) % T
    ring = torch.randint(2, R, (G, n), generator=g)
    ring[0, : r if coff == 2 else 1] = 1
    live = torch.rand(G, generator=g) < 0.5
    live[:2] = True
    live[-1] = False
    args = [kv, score, ring_kv, ring_score, new.to(index_dtype), ring.to(index_dtype), live]
    return [a.to(DEV) for a in args] + [coff]


def gathered(kv, score, ring_kv, ring_score, new, ring, live, coff):
    """The groups as [G, n, c] tensors (what `pool_groups` pools), built with plain indexing."""
    n = new.size(1)
    r, c = n // coff, kv.size(1) // coff
    fresh = (new >= 0).unsqueeze(-1)
    new, ring = new.long(), ring.long()
    out = []
    for src, kept in ((kv, ring_kv), (score, ring_score)):
        rows = torch.where(fresh, src[new.clamp_min(0)], kept[ring])
        out.append(torch.cat([rows[:, i * r : (i + 1) * r, i * c : (i + 1) * c] for i in range(coff)], 1))
    return out


@pytest.mark.parametrize(
    "T,R,G,r,coff,c,index_dtype",
    [(9, 11, 6, 4, 2, 40, torch.int64), (5, 7, 4, 128, 1, 33, torch.int64), (3, 6, 5, 4, 2, 16, torch.int32)],
)
def test_pool_groups_carries_compress_pools_bits(T, R, G, r, coff, c, index_dtype, poisoned):
    """The fused gather + pool gives, for every live group, the bits the compress_pool kernel gives the
    gathered group (the same arithmetic after the loads), and 0 for the others. Against the reference: each
    side's fp32 softmax weights are within (n + 4) ulp (n exps summed, exp's own error, the division) and
    its n products summed with weights adding to 1 add n ulp of max|kv|, so each is within (2n + 8) 2^-24
    max|kv| of the exact value and the two within twice that."""
    args = pool_groups_inputs(T, R, G, r, coff, c, seed=G + c, index_dtype=index_dtype)
    live = args[6]
    got = run_op("pool_groups", *args)
    assert ops.last_backend("pool_groups") == "triton"
    g_kv, g_score = gathered(*args)
    pooled = run_op("compress_pool", g_kv, g_score)
    assert same_bits(got[live], pooled[live])
    assert torch.equal(got[~live], torch.zeros_like(got[~live])) and not got.isnan().any()
    want = ref.pool_groups(*args)
    n = args[4].size(1)
    bound = 2 * (2 * n + 8) * 2.0**-24 * max(args[0].abs().max().item(), args[2].abs().max().item())
    assert (got - want).abs().max().item() <= bound, ((got - want).abs().max(), bound)
    with exact_accumulation():
        got64, pooled64 = run_op("pool_groups", *args), run_op("compress_pool", g_kv, g_score)
    assert same_bits(got64[live], pooled64[live])


def test_pool_groups_strided_rows_and_refusals():
    """Rows read through their row stride (the model passes kv[0] of a [1, T, W] projection, the rings are
    row slices of one buffer), a strided live mask; what the kernel cannot take is refused with its reason."""
    kv, score, ring_kv, ring_score, new, ring, live, coff = pool_groups_inputs(6, 8, 4, 4, 2, 24, seed=3)
    wide = torch.zeros(kv.size(0), 3 * kv.size(1), device=DEV)
    wide[:, 5 : 5 + kv.size(1)] = kv
    kv_view = wide[:, 5 : 5 + kv.size(1)]
    args = (kv_view, score, ring_kv, ring_score, new, ring, live, coff)
    assert same_bits(run_op("pool_groups", *args), run_op("pool_groups", kv, *args[1:]))
    live2 = torch.stack([live, ~live], 1)[:, 0]  # a strided bool view
    assert live2.stride(0) == 2
    assert same_bits(run_op("pool_groups", *args[:6], live2, coff), run_op("pool_groups", *args))
    bad = {
        "forward only": (kv.clone().requires_grad_(True), *args[1:]),
        "dtypes": (kv.bfloat16(), *args[1:]),
        "coff": (*args[:7], 3),
        "unit channel stride": (kv.t().contiguous().t(), *args[1:]),
        "live is": (*args[:6], live.long(), coff),
        "group_new": (kv, score, ring_kv, ring_score, new[:, :4], ring, live, coff),
    }
    for why, a in bad.items():
        with pytest.raises(ops.BackendUnavailable, match=why):
            run_op("pool_groups", *a)


@pytest.mark.parametrize("op", sorted(ROUND_TRIPS))
def test_round_trip_every_scale_exponent(op):
    """amax / qmax at and just around every power of two the scale can take: the exact power-of-two
    rounding up of amax * fp32(1/qmax) (one ulp above 2^k gives 2^(k+1)) is matched."""
    block, qmax = ROUND_TRIPS[op], QMAX[op]
    lo = -22 if op == "fp8_round_trip" else -126
    k = torch.arange(lo, 120).repeat_interleave(12)
    j = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 22, 34, -1, -2]).repeat(len(k) // 12)
    top = ((torch.exp2(k.float()) * qmax).view(torch.int32) + j).view(torch.float32)  # [m]
    x = torch.zeros(len(top), block)
    x[:, 0] = top
    unit = top / qmax  # ~ the scale: probes in the format's subnormal range,
    x[:, 1] = -unit * 1.25 * 2.0**-9  # where a scale twice as large rounds differently
    x[:, 2] = unit * 0.3
    x[:, 3] = unit * 0.7
    x = x.reshape(-1, 4 * block).to(DEV)
    assert same_bits(run_op(op, x, block), getattr(ref, op)(x, block))


# ----------------------------------------------------------------------------- act_quant / amax-scaled round trip
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_codes_and_scales_bit_exact(pow2, dtype, poisoned):
    """E4M3 bytes and fp32 scales of the W8A8 activation quantizer, blocks of 128 with a ragged last block
    (n = 300), over structured corners (grid midpoints, every scale exponent, zeros, subnormals)."""
    block = 128
    rows = structured_blocks("fp8_round_trip", block)
    rows = rows[torch.isfinite(rows).all(-1)]  # NaN blocks: bytes are unspecified
    x = torch.cat([rows, rows.flip(0), rows[:, :44]], -1).to(dtype).to(DEV)  # [r, 300]: 2 full blocks + 44
    q, s = ops.act_quant(x, block, pow2, backend="triton")
    wq, ws = ref.act_quant(x, block, pow2)
    assert ops.last_backend("act_quant") == "triton"
    assert q.dtype == wq.dtype == torch.float8_e4m3fn and s.shape == ws.shape == (x.size(0), 3)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(s, ws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_amax_scales_bit_exact(dtype):
    """pow2=False (a checkpoint whose scale_fmt is null): scale amax * fp32(1/448) kept as it is, values
    divided by it (correctly rounded) before rounding to E4M3."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, 192, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 5, 1), generator=g).float())
    x = x.to(dtype).to(DEV)
    got = ops.fp8_round_trip(x, 64, False, backend="triton")
    want = ref.fp8_round_trip(x, 64, False)
    assert same_bits(got, want)
    assert not same_bits(got, ref.fp8_round_trip(x, 64, True))  # the scale format matters


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_in_place_on_a_keys_first_dims(backend, dtype, poisoned):
    """`inplace=True` on a key's dims before its RoPE tail (what inference does instead of a round trip and
    a concatenation): those dims take the bits of the round trip made out of place, the tail and every
    other element keep theirs; the result is x itself. Refused where autograd records x; a tensor whose
    rows have no strided view is not written through a copy (the kernel refuses, the reference runs)."""
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(2, 7, 96, generator=g) * torch.exp2(torch.randint(-12, 12, (2, 7, 1), generator=g).float())
    kv = kv.to(dtype).to(DEV)
    before = kv.clone()
    nope = kv[..., :64]  # [2, 7, 64] of rows 96 apart
    want = ref.fp8_round_trip(before[..., :64], 32, True)
    with torch.no_grad():
        out = ops.fp8_round_trip(nope, 32, True, inplace=True, backend=backend)
    assert out.data_ptr() == nope.data_ptr() and ops.last_backend("fp8_round_trip") == backend
    assert same_bits(kv[..., :64], want) and same_bits(kv[..., 64:], before[..., 64:])
    leaf = torch.randn(3, 64, device=DEV, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        ops.fp8_round_trip(leaf, 32, True, inplace=True, backend=backend)
    if backend == "triton":
        cols = before.clone().transpose(0, 1)[..., :64]  # [7, 2, 64]: no [14, 64] view of its rows
        assert "strided view" in ops.refusal("fp8_round_trip", "triton", cols, 32, True, inplace=True)
        with torch.no_grad():
            ops.fp8_round_trip(cols, 32, True, inplace=True)  # (the default: triton where it can run)
        assert ops.last_backend("fp8_round_trip") == "reference"
        assert same_bits(cols, want.transpose(0, 1))
