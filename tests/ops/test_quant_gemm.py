"""Quantized-weight GEMMs (FP8 128x128 blocks, MXFP4) vs dequantize-then-bf16-matmul.

Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1) at small shapes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import dsv4.ops as ops
from dsv4 import formats

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)

import dsv4.ops.triton._mm_utils  # noqa: E402,F401  (a missing kernel module is an error, not a skip)


def _bf16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.to(x.dtype))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_linear_matches_dequantized_matmul(scale_fmt):
    g = torch.Generator().manual_seed(0)
    n, k = 200, 320  # neither a multiple of the 128 block
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k)  # block scales differ along k
    q, s = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    x = torch.randn(3, 11, k, generator=g).bfloat16()
    ops.reset_calls()
    y = ops.call("fp8_linear", x, q, s, backend="triton")
    assert ops.last_backend("fp8_linear") == "triton"
    ref = _bf16_ref(x, formats.dequantize_fp8(q, s))
    assert y.shape == (3, 11, n) and y.dtype == torch.bfloat16
    err = (y.float() - ref.float()).abs().max()
    assert err <= 1e-2 * ref.float().abs().max(), err
    # the op's own reference backend agrees too
    assert torch.equal(ops.call("fp8_linear", x, q, s, backend="reference"), ref)


def test_fp8_linear_reads_each_block_scale():
    """x = identity reads the dequantized weight back: every element times its own block's scale."""
    n, k = 256, 256
    codes = torch.randint(0, 126, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    q = formats.fp8_from_bytes(codes)
    scale_bytes = torch.tensor([[120, 127], [131, 124]], dtype=torch.uint8)  # 2^-7, 1, 2^4, 2^-3
    s = formats.e8m0_from_bytes(scale_bytes)
    y = ops.call("fp8_linear", torch.eye(k).bfloat16(), q, s, backend="triton")  # [k, n] = W^T
    want = formats.e4m3_decode(codes) * torch.tensor([[2.0**-7, 1.0], [2.0**4, 2.0**-3]]).repeat_interleave(
        128, 0
    ).repeat_interleave(128, 1)
    assert torch.equal(y.t().float(), want.bfloat16().float())


def test_fp4_linear_known_bytes():
    """Bytes 0x21, 0x43 are codes 1, 2, 3, 4 (low nibble first, docs/bugzoo.md Z01); scale bytes are read as bits
    (docs/bugzoo.md Z02): byte 130 = 2^3."""
    n, k = 32, 64
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    packed[0, 0], packed[0, 1] = 0x21, 0x43
    packed[1, 0] = 0xF9  # codes 9 (-0.5) then 15 (-6)
    scale = torch.full((n, k // 32), 127, dtype=torch.uint8)
    scale[0, 0] = 130
    scale[1, 1] = 125
    packed[1, 16] = 0x07  # element 32 of row 1: code 7 (6.0) * 2^-2
    y = ops.call(
        "fp4_linear", torch.eye(k).bfloat16(), packed.view(torch.int8), formats.e8m0_from_bytes(scale), backend="triton"
    )  # [k, n] = W^T
    w = y.t().float()
    assert w[0, :4].tolist() == [0.5 * 8, 1.0 * 8, 1.5 * 8, 2.0 * 8]
    assert w[1, :2].tolist() == [-0.5, -6.0]
    assert w[1, 32].item() == 1.5
    assert torch.equal(w, formats.dequantize_mxfp4(packed.view(torch.int8), formats.e8m0_from_bytes(scale)))


def test_fp4_linear_matches_dequantized_matmul_and_repeats():
    g = torch.Generator().manual_seed(2)
    n, k = 96, 192
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)
    packed, s = formats.quantize_mxfp4(w)
    x = torch.randn(37, k, generator=g).bfloat16()
    ops.set_deterministic(True)
    try:
        y = ops.call("fp4_linear", x, packed, s, backend="triton")
        y2 = ops.call("fp4_linear", x, packed, s, backend="triton")
    finally:
        ops.set_deterministic(False)
    assert ops.last_backend("fp4_linear") == "triton"
    assert torch.equal(y, y2)
    ref = _bf16_ref(x, formats.dequantize_mxfp4(packed, s))
    err = (y.float() - ref.float()).abs().max()
    assert err <= 1e-2 * ref.float().abs().max(), err


def test_quant_linear_refuses_bad_inputs():
    q, s = formats.quantize_fp8(torch.randn(128, 128))
    with pytest.raises(ops.BackendUnavailable, match="scale shape"):
        ops.call("fp8_linear", torch.randn(2, 128).bfloat16(), q, s[:, :0], backend="triton")
    with pytest.raises(ops.BackendUnavailable, match="bf16"):
        ops.call("fp8_linear", torch.randn(2, 128), q, s, backend="triton")


@pytest.mark.parametrize("fmt", ["fp8-ue8m0", "fp8-fp32", "mxfp4"])
def test_dequant_mm_backend_is_bit_identical_to_reference(fmt, monkeypatch):
    """The chunked dequantize-then-matmul backend, with chunks forced small (3 chunks of 128 rows)."""
    qg = importlib.import_module("dsv4.ops.triton.quant_gemm")
    monkeypatch.setattr(qg, "_CHUNK_ELEMENTS", 128 * 256)
    g = torch.Generator().manual_seed(3)
    n, k = 300, 256
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)
    if fmt == "mxfp4":
        op, (q, s) = "fp4_linear", formats.quantize_mxfp4(w)
    else:
        op, (q, s) = "fp8_linear", formats.quantize_fp8(w, scale_fmt=fmt.split("-")[1])
    x = torch.randn(2, 5, k, generator=g).bfloat16()
    y = ops.call(op, x, q, s, backend="dequant_mm")
    assert ops.last_backend(op) == "dequant_mm"
    assert torch.equal(y, ops.call(op, x, q, s, backend="reference"))


def test_default_backend_follows_token_batch_size(monkeypatch):
    """Default dispatch: the fused kernel for few token rows (decode), dequantize-then-matmul from
    DEQUANT_MM_MIN_TOKENS rows on (threshold lowered here to keep the interpreter fast); an explicit
    request ignores the preference."""
    qg = importlib.import_module("dsv4.ops.triton.quant_gemm")
    monkeypatch.setattr(qg, "DEQUANT_MM_MIN_TOKENS", 8)
    q, s = formats.quantize_fp8(torch.randn(128, 128))
    few, many = torch.randn(1, 7, 128).bfloat16(), torch.randn(2, 4, 128).bfloat16()
    ops.call("fp8_linear", few, q, s)
    assert ops.last_backend("fp8_linear") == "triton"
    ops.call("fp8_linear", many, q, s)
    assert ops.last_backend("fp8_linear") == "dequant_mm"
    ops.call("fp8_linear", few, q, s, backend="dequant_mm")
    assert ops.last_backend("fp8_linear") == "dequant_mm"
