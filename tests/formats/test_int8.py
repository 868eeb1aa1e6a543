"""INT8 W8A8 ops (`int8_quant`, `int8_gemm`, `int8_moe_experts`): the reference against the definitions
written out here, and the "int_mm" backend (`torch._int_mm`) against the reference.

The arithmetic makes exact comparisons the right ones: INT8 x INT8 products summed as integers are exact
(here with int64 on one side, float64 or INT32 on the other), and every backend then performs the same fp32
operations in the same order (fp32(acc) * token scale * row scale), so results agree bit for bit. The one
exception is the experts' sum over a token's k slots, whose order differs between backends: with k = 2 it
is one addition (commutative, so still exact); with k > 2 it is bounded by (k - 1) * 2^-24 * sum |slot|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dsv4.ops as ops
from dsv4.ops import int8_native
from dsv4.ops import reference as R


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: s = max(|row|, 2^-100) / 127 in fp32, q = round half to even of x / s, in [-127, 127]."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(2.0**-100) / 127
    return torch.round(xf / s).clamp(-127, 127).to(torch.int8), s


def gemm_exact(q, s, w, sw) -> torch.Tensor:
    """Integer sums in int64, then fp32(acc) * s * sw in fp32."""
    acc = q.long().reshape(-1, q.size(-1)) @ w.long().t()
    return (acc.float() * s.reshape(-1, 1) * sw).view(*q.shape[:-1], w.size(0))


def rand_weight(n, k, seed, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-spread, 0, n).unsqueeze(1)


# ----------------------------------------------------------------------------- int8_quant
def test_int8_quant_rounds_to_nearest_even_per_row():
    x = torch.tensor(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5],  # scale exactly 1: ties
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # zero row: codes 0, a normal scale
            [-254.0, 1.0, 3.0, -3.0, 253.0, 0.0, 2.0],
        ]
    )  # scale 2: 1 -> 0, 3 -> 2 (ties even)
    q, s = ops.int8_quant(x)
    assert ops.last_backend("int8_quant") == "reference"
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 1)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, 126]
    assert q[1].abs().sum() == 0 and 0 < s[1, 0] < 1e-30 and torch.isfinite(s[1, 0])
    assert s[2, 0] == 2.0 and q[2].tolist() == [-127, 0, 2, -2, 126, 0, 1]


def test_int8_quant_matches_the_definition_and_its_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=g).float())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype) if dtype != torch.float16 else (x / x.abs().amax() * 1e4).to(dtype)
        q, s = R.int8_quant(xd)
        wq, ws = quant_rows(xd)
        assert torch.equal(q, wq) and torch.equal(s, ws), dtype
        assert bool((q.abs().amax(-1) == 127).all())  # the row's amax maps to 127
        err = (R.int8_dequant(q, s) - xd.float()).abs()
        assert bool((err <= s * (0.5 + 2.0**-20)).all())  # round to nearest (+ fp32 x/s)


# ----------------------------------------------------------------------------- int8_gemm
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_gemm_reference_and_int_mm_are_exact(out_dtype):
    g = torch.Generator().manual_seed(1)
    n, k = 200, 333  # ragged: no multiple of 8 or 128
    wq, ws = quant_rows(rand_weight(n, k, 2))
    x = torch.randn(3, 5, k, generator=g) * torch.logspace(0, -2, k)
    q, s = quant_rows(x)
    want = gemm_exact(q, s, wq, ws.squeeze(-1)).to(out_dtype)
    assert torch.equal(R.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype), want)
    ops.reset_calls()
    got = ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype)  # the default on a CPU
    assert ops.last_backend("int8_gemm") == "int_mm" and got.shape == (3, 5, n) and got.dtype == out_dtype
    assert torch.equal(got, want)
    assert torch.equal(
        ops.int8_gemm(q[:1, :1], s[:1, :1], wq, ws.squeeze(-1), out_dtype, backend="int_mm"), want[:1, :1]
    )  # one token (decode)
    assert not torch.equal(got, ops.int8_gemm(q, s * 2, wq, ws.squeeze(-1), out_dtype))  # the scale is read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_quant_then_gemm_on_every_backend(dtype):
    """`int8_linear` (what an INT8 linear runs) = the definition's per-token codes times the INT8 weight, in
    x's dtype; on a CPU backend "parts" runs, which dispatches the two ops to their own backends."""
    from dsv4.model.int8 import Int8Linear

    g = torch.Generator().manual_seed(4)
    n, k = 96, 200
    w = rand_weight(n, k, 3)
    x = (torch.randn(2, 3, k, generator=g) * torch.logspace(-2, 2, 3).unsqueeze(1)).to(dtype)
    q, s = quant_rows(x)
    wq, ws = quant_rows(w)
    want = gemm_exact(q, s, wq, ws.squeeze(-1)).to(dtype)
    assert torch.equal(R.int8_linear(x, wq, ws.squeeze(-1)), want)
    lin = Int8Linear.from_weight(w)
    ops.reset_calls()
    got = lin(x)
    assert ops.last_backend("int8_linear") == "parts" and ops.last_backend("int8_gemm") == "int_mm"
    assert got.dtype == dtype and torch.equal(got, want)


def test_int8_gemm_large_sums_stay_exact():
    """|sum| up to K * 127^2 = 2^25+: past fp32's 2^24, the INT32 (and float64) sums stay exact and round
    to fp32 once, identically on every backend."""
    k = 2048
    q = torch.full((2, k), 127, dtype=torch.int8)
    q[1, ::3] = -127
    w = torch.full((8, k), 127, dtype=torch.int8)
    w[:, 1] = 2  # a sum that is odd and above 2^24: rounds in fp32
    s, sw = torch.ones(2, 1), torch.ones(8)
    want = gemm_exact(q, s, w, sw)
    assert float(want[0, 0]) != float(q[0].long() @ w[0].long())  # fp32 rounded it
    assert torch.equal(R.int8_gemm(q, s, w, sw), want)
    assert torch.equal(ops.int8_gemm(q, s, w, sw, backend="int_mm"), want)


def test_int_mm_says_why_it_cannot_run(monkeypatch):
    q, s = quant_rows(torch.randn(4, 64))
    wq, ws = quant_rows(torch.randn(32, 64))
    assert (
        ops.refusal("int8_gemm", "int_mm", q.float(), s, wq, ws.squeeze(-1))
        == "q and weight must be int8, got torch.float32 and torch.int8"
    )
    assert "[N, K=64]" in ops.refusal("int8_gemm", "int_mm", q, s, wq[:, :32], ws.squeeze(-1))
    assert "one per token" in ops.refusal("int8_gemm", "int_mm", q, s.squeeze(-1), wq, ws.squeeze(-1))
    with pytest.raises(ops.BackendUnavailable, match="int_mm"):
        ops.int8_gemm(q.float(), s, wq, ws.squeeze(-1), backend="int_mm")
    # cuBLASLt's rules on CUDA (the capability is the only thing asked of the device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    cuda = torch.device("cuda")
    assert "more than 16 rows, got 16" in int8_native.int_mm_reason(16, 64, 64, cuda)
    assert "multiples of 8, got K=60" in int8_native.int_mm_reason(17, 60, 64, cuda)
    assert int8_native.int_mm_reason(17, 64, 64, cuda) is None
    assert int8_native.int_mm_reason(None, 64, 64, cuda) is None  # the experts pad their rows
    assert "overflow" in int8_native.int_mm_reason(17, 2**20, 64, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert "sm75+" in int8_native.int_mm_reason(32, 64, 64, cuda)


# ----------------------------------------------------------------------------- int8_moe_experts
def experts_by_definition(x, weights, indices, w1, s1, w2, s2, w3, s3, limit, offset=0):
    """Token by token, slot by slot: quantize, gate / up in fp32, clamp, silu(gate) * up * weight in fp32,
    quantize again, down; the k slots summed in slot order."""
    y = torch.zeros(x.shape)
    for t in range(x.size(0)):
        for j in range(indices.size(1)):
            e = int(indices[t, j]) - offset
            if not 0 <= e < w1.size(0):
                continue
            q, s = quant_rows(x[t : t + 1])
            gate = gemm_exact(q, s, w1[e], s1[e]).clamp(max=limit)
            up = gemm_exact(q, s, w3[e], s3[e]).clamp(-limit, limit)
            h = F.silu(gate) * up * weights[t, j]
            hq, hs = quant_rows(h)
            y[t] += gemm_exact(hq, hs, w2[e], s2[e])[0]
    return y


def moe_case(t=13, d=64, inter=96, e=8, k=2, seed=3, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * scale
    indices = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1

    def stack(o, i):
        q, s = quant_rows(torch.randn(e, o, i, generator=g) * i**-0.5)
        return q, s.squeeze(-1)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, d), stack(inter, d), stack(d, inter)
    return dict(x=x, weights=weights, indices=indices, w1=w1, s1=s1, w2=w2, s2=s2, w3=w3, s3=s3, swiglu_limit=10.0)


def test_int8_experts_reference_matches_the_definition():
    case = moe_case(scale=8.0)  # pre-activations past the clamp
    want = experts_by_definition(*case.values())
    got = R.int8_moe_experts(**case)
    assert torch.equal(got, want)  # k = 2: the slot sum is one (commutative) addition
    gate = gemm_exact(*quant_rows(case["x"]), case["w1"][0], case["s1"][0])
    assert float(gate.abs().max()) > 10.0  # the clamp is exercised


@pytest.mark.parametrize("k,offset", [(2, 0), (3, 0), (2, 4)])
def test_int_mm_experts_match_the_reference(k, offset):
    case = moe_case(k=k, seed=4 + k)
    if offset:  # this rank holds experts 4..7 only
        case = {**case, **{w: case[w][4:] for w in ("w1", "s1", "w2", "s2", "w3", "s3")}}
    want = R.int8_moe_experts(**case, expert_offset=offset)
    ops.reset_calls()
    got = ops.int8_moe_experts(**case, expert_offset=offset)
    assert ops.last_backend("int8_moe_experts") == "int_mm"
    if k == 2:
        assert torch.equal(got, want)
    else:  # two summation orders of k slots: each within (k - 1) 2^-24 sum |slot|
        slots = sum(
            R.int8_moe_experts(
                **{**case, "weights": case["weights"] * (torch.arange(k) == j)}, expert_offset=offset
            ).abs()
            for j in range(k)
        )
        assert bool(((got - want).abs() <= 2 * (k - 1) * 2.0**-24 * slots).all())
        assert not torch.equal(slots, want.abs())  # the slots really are summed
    if offset:
        local = (case["indices"] >= 4).any(-1)
        assert bool((got[~local] == 0).all()) and bool((got[local] != 0).all())
