"""The INT8 W8A8 GEMMs compiled on a CUDA GPU (Triton INT8 dot, torch._int_mm / cuBLASLt) vs the references,
and an INT8 model's decode step replayed from a CUDA graph.

Skipped without a CUDA GPU of sm80+ (the CPU suite runs the Triton kernels on the interpreter:
tests/formats/test_int8_triton.py). INT32 sums are exact and every backend dequantizes with the same fp32
operations in the same order, so results must equal the reference bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import dsv4.ops as ops
from dsv4.ops import reference as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
        reason="needs a CUDA GPU with INT8 tensor cores usable by Triton, sm80+",
    ),
]
pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
import dsv4.ops.triton.int8_decode  # noqa: E402,F401  (a missing kernel module is an error, not a skip)
import dsv4.ops.triton.int8_gemm  # noqa: E402,F401

DEV = torch.device("cuda")


@pytest.mark.parametrize("m", [1, 16, 17, 300])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_gemm_compiled_is_exact(m, out_dtype):
    g = torch.Generator(device=DEV).manual_seed(m)
    n, k = 384, 1024
    wq, ws = R.int8_quant(torch.randn(n, k, device=DEV, generator=g))
    q, s = R.int8_quant(torch.randn(m, k, device=DEV, generator=g))
    want = R.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype)
    assert torch.equal(ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype, backend="triton"), want)
    if m <= 64:  # the decode-sized split-K kernel: INT32 partials, exact as well
        assert torch.equal(ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype, backend="triton_splitk"), want)
    if m > 16:
        assert torch.equal(ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype, backend="int_mm"), want)
    else:
        assert "more than 16 rows" in ops.refusal("int8_gemm", "int_mm", q, s, wq, ws.squeeze(-1), out_dtype)
    ops.int8_gemm(q, s, wq, ws.squeeze(-1), out_dtype)
    assert ops.last_backend("int8_gemm") == ("int_mm" if m >= 256 else "triton")


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_quant_and_fused_linear_compiled_are_exact(m, dtype):
    """`int8_quant`'s kernel and the fused `int8_linear` (quantization inside the GEMM), compiled: the
    reference's codes, scales and outputs bit for bit (div_rn and ties to even as torch computes them); a
    decode-sized INT8 linear runs "parts" by default (the faster on the H200), the same bits."""
    g = torch.Generator(device=DEV).manual_seed(m)
    n, k = 384, 1024
    wq, ws = R.int8_quant(torch.randn(n, k, device=DEV, generator=g))
    x = (torch.randn(m, k, device=DEV, generator=g) * torch.logspace(-3, 3, m, device=DEV).unsqueeze(1)).to(dtype)
    q, s = ops.int8_quant(x, backend="triton")
    want_q, want_s = R.int8_quant(x)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    want = R.int8_linear(x, wq, ws.squeeze(-1))
    assert torch.equal(ops.int8_linear(x, wq, ws.squeeze(-1), backend="triton"), want)
    ops.reset_calls()
    assert torch.equal(ops.int8_linear(x, wq, ws.squeeze(-1)), want)
    assert ops.last_backend("int8_linear") == "parts" and ops.last_backend("int8_quant") == "triton"


@pytest.mark.parametrize("t", [1, 64])
def test_int8_experts_compiled_are_exact(t):
    from test_int8 import moe_case

    case = {k: v.to(DEV) if torch.is_tensor(v) else v for k, v in moe_case(t=t, d=256, inter=128, k=2).items()}
    want = R.int8_moe_experts(**case)
    for be in ("triton", "int_mm"):
        assert torch.equal(ops.int8_moe_experts(**case, backend=be), want), be


def test_int8_decode_step_replays_from_a_cuda_graph():
    from dsv4.bench.graphs import GraphedDecoder
    from dsv4.check.inputs import check_config
    from dsv4.model import DeepSeekV4

    model = DeepSeekV4.from_config(
        check_config("tiny").replace(quant_mode="int8"), seed=0, dtype=torch.bfloat16, device=DEV
    ).eval()
    prompt = torch.randint(2, 1024, (2, 20), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    eager, graphed = model.new_cache(2, 64), model.new_cache(2, 64)
    with torch.no_grad():
        nxt = model.prefill(prompt, eager)[:, -1].argmax(-1, keepdim=True)
        model.prefill(prompt, graphed)
        step = GraphedDecoder(model, graphed).step
        for _ in range(4):
            a = model.decode_step(nxt, eager)
            b = step(nxt)
            assert torch.equal(a, b)
            nxt = a[:, -1].argmax(-1, keepdim=True)
