"""`write_carry` (backend "triton"): the fixed-shape speculative step's carry in one launch instead of ~14.

After a fixed-shape step, each row leaves in `carry[table row]` the integers the host would give its next
step (`dsv4.ops.reference.write_carry`): some fourteen small integer kernels in the reference (adds, a
minimum and a clamp, two concatenations, a masked fill, an indexed write), here one program per row. Every
value is the reference's integer arithmetic, so the rows written are the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ._common import Kernel, device_reason


def _write_carry_kernel(
    carry_ptr,
    ints_ptr,
    gen_ptr,
    cap_ptr,
    acc_ptr,
    bonus_ptr,
    drafts_ptr,
    last,
    s_carry,
    s_i0,
    s_i1,
    s_gen,
    s_cap,
    s_acc,
    s_bonus,
    s_d0,
    s_d1,
    W: tl.constexpr,
    BW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    a = tl.load(acc_ptr + row * s_acc).to(tl.int64)
    start = tl.load(ints_ptr + row * s_i0 + (W + 2) * s_i1).to(tl.int64) + a + 1
    gen = tl.load(gen_ptr + row * s_gen).to(tl.int64) + a + 1
    cap = tl.load(cap_ptr + row * s_cap).to(tl.int64)
    n = tl.minimum(last - start, cap - gen)
    n = tl.minimum(tl.maximum(n, 0), W)
    trow = tl.load(ints_ptr + row * s_i0 + (W + 3) * s_i1).to(tl.int64)
    j = tl.arange(0, BW).to(tl.int64)
    bonus = tl.load(bonus_ptr + row * s_bonus).to(tl.int64)
    d = tl.load(drafts_ptr + row * s_d0 + (j - 1) * s_d1, mask=(j >= 1) & (j <= W), other=0).to(tl.int64)
    tok = tl.where(j == 0, bonus, d)
    tok = tl.where(j > n, 0, tok)  # (the bonus is never past n >= 0)
    val = tl.where(j <= W, tok, tl.where(j == W + 1, n, tl.where(j == W + 2, start, gen)))
    tl.store(carry_ptr + trow * s_carry + j, val, mask=j < W + 4)


_kernel = Kernel(_write_carry_kernel)


def triton_write_carry(
    carry: torch.Tensor,
    ints: torch.Tensor,
    generated: torch.Tensor,
    cap: torch.Tensor,
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    last_position: int,
) -> None:
    """As the reference `write_carry`, one program per row."""
    B, w = drafts.shape
    if B == 0:
        return
    _kernel[(B,)](
        carry,
        ints,
        generated,
        cap,
        accepted,
        bonus,
        drafts,
        int(last_position),
        carry.stride(0),
        ints.stride(0),
        ints.stride(1),
        generated.stride(0),
        cap.stride(0),
        accepted.stride(0),
        bonus.stride(0),
        drafts.stride(0),
        drafts.stride(1),
        W=w,
        BW=triton.next_power_of_2(w + 4),
    )


def _can_run(carry, ints, generated, cap, accepted, bonus, drafts, last_position) -> str | None:
    reason = device_reason(carry, ints, generated, cap, accepted, bonus, drafts)
    if reason:
        return reason
    if drafts.dim() != 2:
        return f"drafts must be [B, w], got {tuple(drafts.shape)}"
    B, w = drafts.shape
    if carry.dim() != 2 or carry.size(1) != w + 4 or carry.stride(1) != 1:
        return f"carry must be [R, {w + 4}] with contiguous rows, got {tuple(carry.shape)}"
    if ints.dim() != 2 or ints.size(0) != B or ints.size(1) < w + 4:
        return f"ints must be [{B}, >= {w + 4}], got {tuple(ints.shape)}"
    for name, t in (("generated", generated), ("cap", cap), ("accepted", accepted), ("bonus", bonus)):
        if tuple(t.shape) != (B,):
            return f"{name} must be [{B}], got {tuple(t.shape)}"
    named = (("carry", carry), ("ints", ints), ("generated", generated), ("cap", cap))
    for name, t in (*named, ("accepted", accepted), ("bonus", bonus), ("drafts", drafts)):
        if t.dtype != torch.int64:
            return f"{name} must be int64, got {t.dtype}"
    if not -(2**31) <= int(last_position) < 2**31:
        return f"last_position {last_position} outside int32"
    return None


register("write_carry", "triton", triton_write_carry, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_write_carry"]
