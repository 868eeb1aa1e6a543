"""The compiled W8A8 kernels on a CUDA GPU (FP8 tensor cores where the GPU has them) vs the references.

Skipped without a CUDA GPU (the CPU suite runs the same kernels on the Triton interpreter:
tests/ops/test_w8a8_gemm.py). Bound: the FP8 tensor cores accumulate the products of one 128-block with
reduced precision (about 14 mantissa bits on Hopper) before each fp32 promotion, so a 128-term partial sum
may be off by up to 128 * 2^-13 of its absolute sum: |got - want| <= 2^-6 * sum_k |a_k w_k| per output,
plus one rounding of the output dtype. A misplaced scale or a transposed tile is off by O(1) of the result.
"""

from __future__ import annotations

import pytest
import torch

import dsv4.ops as ops
from dsv4 import formats
from dsv4.ops import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores, sm89+ (compiled W8A8 kernels)",
    ),
]
pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
import dsv4.ops.triton.w8a8_gemm  # noqa: E402,F401  (a missing kernel module is an error, not a skip)

DEV = torch.device("cuda")


def bounded(got, want, absprod, out_dtype) -> bool:
    bound = 2.0**-6 * absprod + torch.finfo(out_dtype).eps * want.abs().double()
    return bool(((got.double() - want.double()).abs() <= bound).all())


@pytest.mark.parametrize("m", [1, 64, 1024])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_dense_w8a8_compiled(m, fmt):
    g = torch.Generator(device=DEV).manual_seed(m)
    n, k = 384, 1024
    w = torch.randn(n, k, device=DEV, generator=g) * k**-0.5
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    q, s = ops.act_quant(x, R.ACT_BLOCK, True)
    assert ops.last_backend("act_quant") == "triton"
    assert torch.equal(q.view(torch.uint8), R.act_quant(x, R.ACT_BLOCK, True)[0].view(torch.uint8))
    if fmt == "fp8":
        wq, ws = formats.quantize_fp8(w)
        op, wd = "fp8_gemm", formats.dequantize_fp8(wq, ws)
    else:
        wq, ws = formats.quantize_mxfp4(w)
        op, wd = "fp4_gemm", formats.dequantize_mxfp4(wq, ws)
    absprod = R.act_dequant(q, s).double().abs() @ wd.double().abs().t()
    want = getattr(R, op)(q, s, wq, ws, torch.float32)
    for be in [b for b in ops.backends(op) if b != "reference"]:
        if be == "triton_splitk" and m > 64:  # decode-sized calls only (its refusal says so)
            assert "decode-sized" in ops.refusal(op, be, q, s, wq, ws, torch.bfloat16)
            continue
        try:
            got = ops.call(op, q, s, wq, ws, torch.bfloat16, backend=be)
        except ops.BackendUnavailable as e:
            if be == "scaled_mm":  # optional: torch / CUDA / GPU may lack it (reported)
                print(f"{op} {be}: {e}")
                continue
            raise
        assert bounded(got, want, absprod, torch.bfloat16), be


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantized_moe_experts_compiled(fmt):
    g = torch.Generator(device=DEV).manual_seed(1)
    t, k, e, d, inter = 300, 4, 16, 512, 384
    ws = {}
    for name, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        w = torch.randn(e, *shape, device=DEV, generator=g) * shape[1] ** -0.5
        if fmt == "fp4":
            q, sc = formats.quantize_mxfp4(w)
        else:
            pairs = [formats.quantize_fp8(w[j]) for j in range(e)]
            q, sc = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        ws[name] = (q.view(torch.uint8), sc.view(torch.uint8))
    x = torch.randn(t, d, device=DEV, generator=g).bfloat16()
    idx = torch.rand(t, 20, device=DEV, generator=g).topk(k, -1).indices  # 4 of 20: some foreign
    wts = torch.rand(t, k, device=DEV, generator=g)
    args = (x, wts, idx, *ws["w1"], *ws["w2"], *ws["w3"], 8.0, 2, fmt, "ue8m0")
    want = R.quantized_moe_experts(*args)
    got = ops.quantized_moe_experts(*args)
    assert ops.last_backend("quantized_moe_experts") == "triton"
    # bf16 gate / up / outputs in both; the activation requantization of h can flip where they differ
    err = float((got - want).norm() / want.norm())
    assert err < 2.0**-6, err
    few = (x[:8], wts[:8], idx[:8], *args[3:])  # decode-sized: the split-K grouped GEMMs too
    want = R.quantized_moe_experts(*few)
    for be in ("triton", "triton_splitk"):
        got = ops.quantized_moe_experts(*few, backend=be)
        err = float((got - want).norm() / want.norm())
        assert err < 2.0**-6, (be, err)
