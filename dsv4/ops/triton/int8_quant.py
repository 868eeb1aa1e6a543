"""`int8_quant` (backend "triton"): per-row symmetric INT8 codes and scales in one launch.

The reference is a chain of some nine elementwise kernels over the row (upcast, abs, amax, clamp, two
divisions, round, clamp, cast). Every quantized linear of `quant_mode="int8"` runs it on its input before
the GEMM, so at decode sizes, where each of those launches costs more than the bytes it touches, it made
the INT8 step slower than the bf16 one on a GPU. Here one program quantizes one row, in two passes over it:

1. amax = max |x| over the row in fp32 (a NaN anywhere gives NaN, an infinity inf, as torch's `amax`),
   then max(amax, INT8_AMAX_FLOOR) and s = amax / 127, one correctly rounded division (`div_rn`);
2. q = clamp(round(x / s), -127, 127): the quotient correctly rounded (`div_rn`), rounded to the nearest
   integer with ties to even ((|v| + 2^23) - 2^23: exact for |v| < 2^22, and |v| <= 127 + 1 ulp here).

Those are the reference's operations in its order, so codes and scales equal it bit for bit on finite
rows. A row holding a NaN or an infinity has the reference's scale (NaN, or inf) and codes 0 (the
reference's codes there are a float-to-int8 cast of NaN, which torch leaves undefined).
"""

from __future__ import annotations

import torch
import triton.language as tl

from .. import register
from ..reference import INT8_AMAX_FLOOR, INT8_MAX
from ._common import Kernel, interpret_mode
from .elementwise import _vector_reason

BLOCK = 1024  # columns per loop iteration


def _int8_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, floor, qmax, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    xrow = x_ptr + row * stride_x
    big = tl.zeros((BLOCK,), tl.float32)
    nan = tl.zeros((BLOCK,), tl.int32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(xrow + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, (x != x).to(tl.int32))
        big = tl.maximum(big, tl.where(x == x, tl.abs(x), 0.0))
    amax = tl.maximum(tl.max(big, axis=0), floor)
    amax = tl.where(tl.max(nan, axis=0) > 0, float("nan"), amax)  # torch's amax: a NaN wins
    s = tl.math.div_rn(amax, qmax)
    qrow = q_ptr + row * stride_q
    for k0 in range(0, K, BLOCK):
        inside = k0 + offs < K
        x = tl.load(xrow + k0 + offs, mask=inside, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, s)
        a = (tl.abs(v) + 8388608.0) - 8388608.0  # round to integer, ties to even
        a = tl.minimum(a, qmax)
        r = tl.where(v < 0, -a, a)
        r = tl.where(v == v, r, 0.0)  # NaN (a non-finite row): code 0
        tl.store(qrow + k0 + offs, r.to(tl.int8), mask=inside)
    tl.store(s_ptr + row, s)


_quant = Kernel(_int8_quant_kernel)


def triton_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference `int8_quant`: x [..., K] -> (q [..., K] int8, s [..., 1] fp32)."""
    x = x.detach()
    k = x.size(-1)
    x2 = x.reshape(-1, k)
    if k and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.size(0)
    q = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:  # (an empty last dim is refused: the reference's amax of nothing raises)
        opts = {} if interpret_mode() else {"num_warps": 4}
        _quant[(rows,)](x2, q, s, k, x2.stride(0), q.stride(0), INT8_AMAX_FLOOR, float(INT8_MAX), BLOCK=BLOCK, **opts)
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def _can_run(x: torch.Tensor) -> str | None:
    reason = _vector_reason(x)
    if reason is None and x.size(-1) == 0:
        return "the last dim is empty (the reference raises: an amax of nothing)"
    return reason


register("int8_quant", "triton", triton_int8_quant, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_int8_quant"]
