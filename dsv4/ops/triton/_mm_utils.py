"""Triton helpers shared by the MoE, mHC and quantized-GEMM kernels.

Under the CPU interpreter (TRITON_INTERPRET=1) a bf16 `tl.dot` is wrong and an fp32 -> bf16 cast
truncates; with `UPCAST` (set only there) the kernels compute what the GPU computes: fp32 products of the
same bf16 values and round-to-nearest-even casts. Triton fixes compiled vs interpreted when a kernel is
decorated, so `INTERPRET` records the mode this module (and the kernels importing it) were built in.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import _interpretable_lang

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs); under the interpreter with triton.language made interpretable."""
    if INTERPRET:
        with _interpretable_lang():
            kernel[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def device_reason(t: torch.Tensor) -> str | None:
    """None when kernels built in this mode can take `t`, else why not."""
    now = os.environ.get("TRITON_INTERPRET") == "1"
    if t.device.type == "cuda":
        return None if not INTERPRET else "kernels were built for the CPU interpreter (TRITON_INTERPRET=1)"
    if t.device.type == "cpu" and INTERPRET and now:
        return None
    return (
        f"tensors are on {t.device.type}; the triton backend needs CUDA (or CPU with TRITON_INTERPRET=1 "
        f"set before dsv4 is imported)"
    )


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


@triton.jit
def grouped_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(row tile, column tile) of this program in grouped order: GROUP row tiles share each weight column
    tile while it is in L2."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(n_m - first_m, GROUP)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def round_to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 -> dtype, round to nearest even."""
    if UPCAST and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def split3(x, UPCAST: tl.constexpr):
    """fp32 -> three bf16 parts (hi, mid, lo), hi + mid + lo == x exactly for normal fp32 values: part i
    carries about 2^(-8 i) of x, so tensor-core products of the parts are exact in fp32."""
    hi = round_to(x, tl.bfloat16, UPCAST)
    r = x - hi.to(tl.float32)  # exact in fp32
    mid = round_to(r, tl.bfloat16, UPCAST)
    lo = round_to(r - mid.to(tl.float32), tl.bfloat16, UPCAST)
    return hi, mid, lo
