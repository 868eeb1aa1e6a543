"""W8A8 GEMM kernels (FP8 activations x FP8 / MXFP4 weights, dense and grouped experts) vs the references.

Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1) at small shapes. There the block products
are exact fp32 products of E4M3 x E4M3 (or E2M1-derived) values, so kernel and reference differ only in
fp32 summation order: the bound used is K * 2^-24 * sum_k |a_k w_k| per output (plus the output rounding).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import dsv4.ops as ops
from dsv4 import formats
from dsv4.ops import reference as R

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)

import dsv4.ops.triton._mm_utils  # noqa: E402,F401  (a missing kernel module is an error, not a skip)


def within_fp32_sum_bound(
    got: torch.Tensor, want: torch.Tensor, abs_products: torch.Tensor, k: int, out_dtype: torch.dtype
) -> bool:
    """|got - want| <= k eps32 sum|a w| (+ one rounding of the output dtype on |want|)."""
    eps_out = torch.finfo(out_dtype).eps
    bound = k * 2.0**-24 * abs_products + eps_out * want.abs().double()
    return bool(((got.double() - want.double()).abs() <= bound).all())


def abs_products(q, s, w_deq) -> torch.Tensor:
    a = R.act_dequant(q, s).double().abs()
    return a @ w_deq.double().abs().t()


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_matches_reference(scale_fmt, out_dtype):
    g = torch.Generator().manual_seed(0)
    n, k = 200, 320  # neither a multiple of 128 (ragged blocks)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k)
    wq, ws = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    x = torch.randn(3, 11, k, generator=g) * torch.logspace(0, -2, k)
    q, s = R.act_quant(x, 128, pow2=scale_fmt == "ue8m0")
    ops.reset_calls()
    got = ops.fp8_gemm(q, s, wq, ws, out_dtype, backend="triton")
    assert ops.last_backend("fp8_gemm") == "triton" and got.shape == (3, 11, n) and got.dtype == out_dtype
    want = R.fp8_gemm(q, s, wq, ws, out_dtype)
    assert within_fp32_sum_bound(got, want, abs_products(q, s, formats.dequantize_fp8(wq, ws)), k, out_dtype)
    assert not torch.equal(got, R.fp8_gemm(q, s * 2, wq, ws, out_dtype))  # the activation scale is read


def test_fp8_gemm_reads_each_block_scale():
    """Identity activations read the weight back: every element times its own 128x128 block scale."""
    n, k = 256, 256
    codes = torch.randint(0, 126, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    wq = formats.fp8_from_bytes(codes)
    ws = formats.e8m0_from_bytes(torch.tensor([[120, 127], [131, 124]], dtype=torch.uint8))
    q, s = R.act_quant(torch.eye(k), 128, True)  # scale 2^-8 per block with a 1 in it, else the floor
    got = ops.fp8_gemm(q, s, wq, ws, torch.float32, backend="triton")
    assert torch.equal(got, R.fp8_gemm(q, s, wq, ws, torch.float32))  # one non-zero product each


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp4_gemm_matches_reference(out_dtype):
    g = torch.Generator().manual_seed(2)
    n, k = 96, 192
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)
    wp, ws = formats.quantize_mxfp4(w)
    x = torch.randn(37, k, generator=g)
    q, s = R.act_quant(x, 128, True)
    got = ops.fp4_gemm(q, s, wp, ws, out_dtype, backend="triton")
    assert ops.last_backend("fp4_gemm") == "triton"
    want = R.fp4_gemm(q, s, wp, ws, out_dtype)
    assert within_fp32_sum_bound(got, want, abs_products(q, s, formats.dequantize_mxfp4(wp, ws)), k, out_dtype)


def test_fp4_tiles_exact_and_refusal():
    """An MXFP4 weight whose 32-group exponents within a 128-column block span more than 2^14 cannot be held
    by one FP8 tile: the Triton backend refuses it by name and the default falls back to the reference."""
    wg = importlib.import_module("dsv4.ops.triton.w8a8_gemm")
    n, k = 32, 128
    g = torch.Generator().manual_seed(3)
    wp, ws = formats.quantize_mxfp4(torch.randn(n, k, generator=g))
    assert wg.fp4_tiles_exact(ws)
    wide = formats.as_e8m0_bytes(ws).clone()
    wide[5, 2] = wide[5, :4].max() - 15  # one group 2^15 below its block's largest
    wide = formats.e8m0_from_bytes(wide)
    assert not wg.fp4_tiles_exact(wide)
    q, s = R.act_quant(torch.randn(4, k, generator=g), 128, True)
    with pytest.raises(ops.BackendUnavailable, match="span more than"):
        ops.fp4_gemm(q, s, wp, wide, torch.float32, backend="triton")
    ops.fp4_gemm(q, s, wp, wide, torch.float32)
    assert ops.last_backend("fp4_gemm") == "reference"
    # at the limit (2^14) the tile is exact
    edge = formats.as_e8m0_bytes(ws).clone()
    edge[5, 2] = edge[5, :4].max() - 14
    edge = formats.e8m0_from_bytes(edge)
    got = ops.fp4_gemm(q, s, wp, edge, torch.float32, backend="triton")
    want = R.fp4_gemm(q, s, wp, edge, torch.float32)
    assert within_fp32_sum_bound(got, want, abs_products(q, s, formats.dequantize_mxfp4(wp, edge)), k, torch.float32)


def _experts(fmt: str, e: int, inter: int, d: int, g):
    out = {}
    for name, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        w = torch.randn(e, *shape, generator=g) * shape[1] ** -0.5
        if fmt == "fp4":
            q, s = formats.quantize_mxfp4(w)
        else:
            pairs = [formats.quantize_fp8(w[j]) for j in range(e)]
            q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        out[name] = (formats.as_fp8_bytes(q) if fmt == "fp8" else formats.as_packed_bytes(q), formats.as_e8m0_bytes(s))
    return out


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("act", ["ue8m0", "fp32"])
def test_quantized_moe_experts_matches_reference(fmt, act):
    """Grouped W8A8 experts, a rank holding experts 2..6 of 9 (foreign slots skipped), inter dim not a
    multiple of 128 (ragged activation blocks of h), fp32 model dtype (outputs compared before any bf16
    rounding could hide a difference)."""
    g = torch.Generator().manual_seed(4)
    t, k, e, offset, d, inter = 19, 2, 5, 2, 256, 96
    ws = _experts(fmt, e, inter, d, g)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(9, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g) + 0.1
    args = (x, wts, idx, *ws["w1"], *ws["w2"], *ws["w3"], 4.0, offset, fmt, act)
    want = R.quantized_moe_experts(*args)
    ops.reset_calls()
    got = ops.quantized_moe_experts(*args, backend="triton")
    assert ops.last_backend("quantized_moe_experts") == "triton"
    assert got.shape == want.shape and got.dtype == torch.float32
    # fp32 summation order inside each projection only; a flip of one rounded value of h would show as a
    # relative error of order 2^-4 of that element, far above this bound
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err
    assert torch.equal(got[0] == 0, want[0] == 0)  # a token routed only to foreign experts: zero


def test_fp4_to_fp8_tile_rescaling_is_exact_within_the_span():
    """The kernel's MXFP4 -> FP8 tile: code value v times 2^(e_g - r + 6) is an E4M3 value for every E2M1
    value and every exponent gap d = r - e_g <= 14, and not for some at d = 15 (checked with torch's cast)."""
    vals = torch.tensor(formats.FP4_VALUES)
    for d in range(0, 16):
        t = vals * 2.0 ** (6 - d)
        back = t.to(torch.float8_e4m3fn).float()
        assert torch.equal(back, t) == (d <= 14), d
    assert float(vals.abs().max()) * 2.0**6 <= 448


def test_scaled_mm_backend_says_why_it_cannot_run():
    q, s = R.act_quant(torch.randn(4, 256), 128, True)
    wq, ws = formats.quantize_fp8(torch.randn(256, 256))
    with pytest.raises(ops.BackendUnavailable, match="CUDA"):
        ops.fp8_gemm(q, s, wq, ws, torch.bfloat16, backend="scaled_mm")


def test_bench_w8a8_rows_and_summary_on_the_interpreter(monkeypatch):
    """The bench's code paths at the tiny preset's shapes with the timer replaced (times are fixed: the
    ratios then follow from the op counts), so a GPU run does not fail on a code path first."""
    from dsv4.bench import w8a8 as bench
    from dsv4.config import ModelConfig

    monkeypatch.setattr(bench, "_time_ms", lambda fn, reps=20, warmup=3: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "_graphed_ms", lambda fn, reps=20: (fn(), 4.0)[1])
    cfg = ModelConfig.preset("tiny")
    limits = {"matmul_tflops": 1.0, "copy_gbs": 1.0}
    rows: list = []
    for name, (n, k) in list(bench.flash_linears(cfg).items())[:2]:
        bench.bench_gemm(8, n, k, name, torch.device("cpu"), limits, rows, "gemm")
    bench.bench_experts(
        6, cfg, bench._expert_weights(cfg, torch.device("cpu")), torch.device("cpu"), limits, rows, "experts"
    )
    fp8 = [r for r in rows if r["op"] == "fp8_gemm" and "ms" in r]
    # 8 token rows: the dense kernel and the decode-sized split-K one, each timed
    assert {r["backend"] for r in fp8} == {"triton", "triton_splitk"} and all(r["x_bf16"] == 1.0 for r in fp8)
    assert all(r["rel_l2"] < 1e-2 for r in fp8)
    assert any(r.get("backend") == "scaled_mm" and "skipped" in r for r in rows)
    moe = [r for r in rows if r["op"] == "quantized_moe_experts fp4" and "ms" in r]
    assert moe and moe[0]["rel_l2"] < 1e-2 and moe[0]["x_bf16"] == 1.0
    summary = bench.summarize(rows)
    assert summary["gemm"]["met"] is False and summary["experts"]["met"] is True
