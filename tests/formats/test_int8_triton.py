"""The Triton INT8 kernels (`int8_quant`, `int8_gemm`, the fused `int8_linear`, grouped `int8_moe_experts`)
vs the references, on the CPU interpreter (TRITON_INTERPRET=1) at small shapes.

INT32 sums of INT8 products are exact and the kernels dequantize with the reference's fp32 operations in
its order (fp32(acc) * token scale * row scale, then one rounding to the output dtype), so they must agree
bit for bit; the experts' k = 2 slot sum is one commutative addition, exact as well.
"""

from __future__ import annotations

import pytest
import torch
from test_int8 import moe_case, quant_rows, rand_weight

import dsv4.ops as ops
from dsv4.ops import reference as R

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)

import dsv4.ops.triton.int8_decode  # noqa: E402,F401  (a missing kernel module is an error, not a skip)
import dsv4.ops.triton.int8_gemm  # noqa: E402,F401
import dsv4.ops.triton.int8_quant  # noqa: E402,F401


def _quant_cases() -> list[torch.Tensor]:
    """Rows that exercise every rule of the definition: random spreads, a zero row (the floor), quotients
    that are exact ties (amax 127: s = 1, so x / s = x), tiny and huge magnitudes, a row longer than one
    loop block of the kernel (1,024 columns)."""
    g = torch.Generator().manual_seed(11)
    k = 200
    rand = torch.randn(5, k, generator=g) * torch.logspace(-3, 3, 5).unsqueeze(1)
    ties = torch.zeros(1, k)
    ties[0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    tiny = torch.randn(1, k, generator=g) * 2.0**-120  # below the floor: s = 2^-100 / 127, codes 0
    huge = torch.randn(1, k, generator=g) * 1e37
    return [torch.cat([rand, torch.zeros(1, k), ties, tiny, huge]), torch.randn(3, 2500, generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_quant_kernel_is_exact(dtype):
    for x in _quant_cases():
        x = x.to(dtype) if dtype != torch.float16 else x.clamp(-6e4, 6e4).to(dtype)
        ops.reset_calls()
        q, s = ops.int8_quant(x.view(1, *x.shape), backend="triton")  # leading dims kept
        assert ops.last_backend("int8_quant") == "triton"
        want_q, want_s = R.int8_quant(x.view(1, *x.shape))
        assert q.dtype == torch.int8 and q.shape == want_q.shape and s.shape == want_s.shape
        assert torch.equal(q, want_q) and torch.equal(s, want_s)


def test_int8_quant_kernel_ties_and_non_finite_rows():
    """Ties round to even; a NaN row gets the reference's NaN scale and an infinite row its inf scale, with
    codes 0 (where the reference casts NaN to int8, which torch leaves undefined); other rows unchanged."""
    x = torch.zeros(3, 8)
    x[0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    q, s = ops.int8_quant(x, backend="triton")
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126] and s[0].item() == 1.0
    want_s = R.int8_quant(x)[1]
    assert bool(s[1].isnan()) and bool(want_s[1].isnan())
    assert s[2].item() == float("inf") == want_s[2].item()
    assert q[1:].eq(0).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 37])
def test_int8_gemm_kernel_is_exact(out_dtype, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 72, 200  # ragged tiles in N and K
    wq, ws = quant_rows(rand_weight(n, k, 5))
    q, s = quant_rows(torch.randn(rows, k, generator=g) * 3)
    ops.reset_calls()
    got = ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype, backend="triton")
    assert ops.last_backend("int8_gemm") == "triton" and got.dtype == out_dtype and got.shape == (rows, n)
    assert torch.equal(got, R.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype))


def test_int8_gemm_kernel_reads_every_row_scale():
    """Identity activations read the weight back row by row, times each row's own scale."""
    k = 96
    wq = torch.randint(-127, 128, (40, k), dtype=torch.int8, generator=torch.Generator().manual_seed(6))
    ws = torch.exp2(torch.arange(40, dtype=torch.float32) - 20)
    q = torch.eye(k, dtype=torch.int8)
    got = ops.int8_gemm(q, torch.ones(k, 1), wq, ws, backend="triton")
    assert torch.equal(got, (wq.float() * ws.unsqueeze(1)).t())


@pytest.mark.parametrize("offset", [0, 4])
def test_int8_grouped_experts_kernel_is_exact(offset):
    case = moe_case(t=9, k=2, seed=7, scale=6.0)
    if offset:  # experts 4..7 here; slots of 0..3 belong elsewhere
        case = {**case, **{w: case[w][4:] for w in ("w1", "s1", "w2", "s2", "w3", "s3")}}
    ops.reset_calls()
    got = ops.int8_moe_experts(**case, expert_offset=offset, backend="triton")
    assert ops.last_backend("int8_moe_experts") == "triton"
    assert torch.equal(got, R.int8_moe_experts(**case, expert_offset=offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fused_int8_linear_is_exact(dtype, rows):
    """Quantization and GEMM in one kernel: `int8_gemm(int8_quant(x))` bit for bit, with ragged column and K
    tiles (K = 300 spans several K blocks) and rows of magnitudes four decades apart (each its own scale)."""
    g = torch.Generator().manual_seed(rows)
    for n, k in ((72, 300), (40, 64)):
        wq, ws = quant_rows(rand_weight(n, k, 5))
        x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)).to(dtype)
        ops.reset_calls()
        got = ops.int8_linear(x.view(1, rows, k), wq, ws.squeeze(-1), backend="triton")
        assert ops.last_backend("int8_linear") == "triton" and got.dtype == dtype and got.shape == (1, rows, n)
        assert torch.equal(got[0], R.int8_linear(x, wq, ws.squeeze(-1)))
        wide = ops.int8_linear(x, wq, ws.squeeze(-1), torch.float32, backend="triton")  # (the shared expert's)
        assert wide.dtype == torch.float32 and torch.equal(wide, R.int8_linear(x, wq, ws.squeeze(-1), torch.float32))


def test_fused_int8_linear_refuses_prompt_sized_calls():
    wq, ws = quant_rows(torch.randn(16, 64))
    reason = ops.refusal("int8_linear", "triton", torch.randn(17, 64), wq, ws.squeeze(-1))
    assert "17 token rows" in reason
    ops.reset_calls()
    ops.int8_linear(torch.randn(17, 64), wq, ws.squeeze(-1))
    assert ops.last_backend("int8_linear") == "parts" and ops.last_backend("int8_gemm") == "triton"


def test_int8_triton_refusals():
    assert "dtype" in ops.refusal("int8_quant", "triton", torch.zeros(2, 8, dtype=torch.float64))
    assert "empty" in ops.refusal("int8_quant", "triton", torch.zeros(2, 0))
    q, s = quant_rows(torch.randn(3, 64))
    wq, ws = quant_rows(torch.randn(16, 64))
    assert "int8" in ops.refusal("int8_gemm", "triton", q.float(), s, wq, ws.squeeze(-1))
    assert "out_dtype" in ops.refusal("int8_gemm", "triton", q, s, wq, ws.squeeze(-1), torch.float64)
    case = moe_case(t=2)
    assert "inference-only" in ops.refusal("int8_moe_experts", "triton", **{**case, "x": case["x"].requires_grad_()})


def test_triton_moe_fp16_keeps_gate_and_up_in_fp32():
    """The bf16 / fp16 grouped-GEMM MoE kernel (dsv4.ops.triton.moe): for fp16 inputs gate and up are not
    rounded to fp16 before the clamp, so a gate beyond -65504 stays finite (rounded, it would give NaN)."""
    from test_fp16 import formula, overflow_case

    case = overflow_case()
    got = ops.moe_experts(**case, backend="triton")
    assert ops.last_backend("moe_experts") == "triton" and bool(torch.isfinite(got).all())
    want = formula(case)
    w2_rows = sum(case["w2"][e].double().abs().sum(-1) for e in range(case["w1"].size(0)))
    assert bool(((got.double() - want).abs() <= 2.0**-10 * 75 * w2_rows + 2.0**-10 * want.abs()).all())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_split_k_int8_gemm_is_exact(out_dtype, rows):
    """The decode-sized split-K kernel: INT32 partials are exact in any grouping, so bit for bit."""
    from dsv4.ops.triton import int8_decode, w8a8_decode

    g = torch.Generator().manual_seed(rows)
    n, k = 40, 300  # five K blocks of 64 on the interpreter, the last ragged
    wq, ws = quant_rows(rand_weight(n, k, 8))
    q, s = quant_rows(torch.randn(rows, k, generator=g) * 3)
    assert w8a8_decode.splits_for(rows, n, k, 16, 32, w8a8_decode._sm_count(q.device), block=64)[0] > 1
    got = ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype, backend="triton_splitk")
    assert ops.last_backend("int8_gemm") == "triton_splitk" and got.dtype == out_dtype and got.shape == (rows, n)
    assert torch.equal(got, R.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype))
    big = quant_rows(torch.randn(int8_decode.MAX_ROWS + 1, k, generator=g))
    with pytest.raises(ops.BackendUnavailable, match="decode-sized"):
        ops.int8_gemm(*big, wq, ws.squeeze(-1), backend="triton_splitk")
    ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype)
    assert ops.last_backend("int8_gemm") == "triton"  # the dense kernel stays the default until measured


def test_split_k_int8_reads_every_row_scale_through_every_split():
    """Unit activations spread over every K block read the weight back, times each row's own scale."""
    k = 256
    wq = torch.randint(-127, 128, (24, k), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    ws = torch.exp2(torch.arange(24, dtype=torch.float32) - 12)
    cols = [0, 63, 64, 100, 127, 128, 200, 255]
    q = torch.zeros(len(cols), k, dtype=torch.int8)
    q[torch.arange(len(cols)), cols] = 1
    got = ops.int8_gemm(q, torch.ones(len(cols), 1), wq, ws, backend="triton_splitk")
    assert torch.equal(got, (wq.float() * ws.unsqueeze(1)).t()[cols])
