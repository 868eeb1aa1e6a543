"""`write_carry`, `read_carry` and `spec_advance` (backend "triton"): the fixed-shape speculative step's
integers, each in one launch instead of ~14, ~9 and ~8.

After a fixed-shape step, each row leaves in `carry[table row]` the integers the host would give its next
step (`dsv4.ops.reference.write_carry`): some fourteen small integer kernels in the reference (adds, a
minimum and a clamp, two concatenations, a masked fill, an indexed write), here one program per row. The
next step reads them back (`read_carry`: the carry's gather, the fed rows' selections, a concatenation, the
page tables' gathers and the padding rows' state, about nine kernels), also one program per row. Between
the acceptance and the draft, `spec_advance` makes the tokens the MTP block catches up on, the rows its
head reads, and the next drafts' positions and draw indices (a concatenation, a comparison, a selection and
a handful of adds in the reference), one program per row. Every value is the reference's integers, moved,
added or compared, so each is the reference's exactly.
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


def _read_carry_kernel(
    base_ptr,
    gen_ptr,
    cap_ptr,
    wt_ptr,
    ct_ptr,
    state_ptr,
    ints_ptr,
    carry_ptr,
    tw_ptr,
    tc_ptr,
    pad_row,
    P,
    s_i0,
    s_i1,
    s_carry,
    s_tw,
    s_tc,
    W: tl.constexpr,
    NB: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ints = ints_ptr + row * s_i0
    trow = tl.load(ints + (W + 3) * s_i1).to(tl.int64)
    j = tl.arange(0, BC).to(tl.int64)
    # the row's flag as a block (a scalar comparison joined with a block mask is not portable across Triton's
    # versions and its interpreter): fed columns are the first W + 3 of a fed row
    flag = tl.load(ints + NB * s_i1 + j * 0)
    take = (flag > 0) & (j < W + 3)
    # (every table row names a row of the carry and of the tables, padding rows too: read unconditionally)
    gen = tl.where(
        flag > 0, tl.load(carry_ptr + trow * s_carry + W + 3 + j * 0), tl.load(ints + (NB + 1) * s_i1 + j * 0)
    )
    own = tl.load(ints + j * s_i1, mask=j < NB, other=0)
    carried = tl.load(carry_ptr + trow * s_carry + j, mask=j < W + 3, other=0)
    val = tl.where(take, carried, own)
    val = tl.where(j == W + 5, gen, val)  # (a sampled step's generated count; beyond NB otherwise)
    tl.store(base_ptr + row * NB + j, val, mask=j < NB)
    tl.store(gen_ptr + row + j * 0, gen, mask=j == 0)
    tl.store(cap_ptr + row, tl.load(ints + (NB + 2) * s_i1))
    tl.store(state_ptr + row, tl.where(trow == pad_row, 0, trow))
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        m = p < P
        tl.store(wt_ptr + row * P + p, tl.load(tw_ptr + trow * s_tw + p, mask=m), mask=m)
        tl.store(ct_ptr + row * P + p, tl.load(tc_ptr + trow * s_tc + p, mask=m), mask=m)


_read_kernel = Kernel(_read_carry_kernel)


def triton_read_carry(
    ints: torch.Tensor, carry: torch.Tensor, tables_w: torch.Tensor, tables_c: torch.Tensor, pad_row: int
) -> tuple[torch.Tensor, ...]:
    """As the reference `read_carry`, one program per row."""
    B, C = ints.shape
    w, P = carry.size(1) - 4, tables_w.size(1)
    nb = C - 3
    dev = ints.device
    base = torch.empty(B, nb, dtype=torch.int64, device=dev)
    gen, cap, state = (torch.empty(B, dtype=torch.int64, device=dev) for _ in range(3))
    wt = torch.empty(B, P, dtype=torch.int64, device=dev)
    ct = torch.empty(B, P, dtype=torch.int64, device=dev)
    if B:
        _read_kernel[(B,)](
            base,
            gen,
            cap,
            wt,
            ct,
            state,
            ints,
            carry,
            tables_w,
            tables_c,
            int(pad_row),
            P,
            ints.stride(0),
            ints.stride(1),
            carry.stride(0),
            tables_w.stride(0),
            tables_c.stride(0),
            W=w,
            NB=nb,
            BC=triton.next_power_of_2(nb),
            BP=min(1024, triton.next_power_of_2(max(P, 1))),
        )
    return base, gen, cap, wt, ct, state


def _can_run_read(ints, carry, tables_w, tables_c, pad_row) -> str | None:
    reason = device_reason(ints, carry, tables_w, tables_c)
    if reason:
        return reason
    for name, t in (("ints", ints), ("carry", carry), ("tables_w", tables_w), ("tables_c", tables_c)):
        if t.dtype != torch.int64:
            return f"{name} must be int64, got {t.dtype}"
        if t.dim() != 2:
            return f"{name} must be 2-D, got {tuple(t.shape)}"
    w = carry.size(1) - 4
    if w < 0 or carry.stride(1) != 1:
        return f"carry must be [R, w + 4] with contiguous rows, got {tuple(carry.shape)}"
    if ints.size(1) not in (w + 7, w + 11):
        return f"ints must be [B, {w + 7}] or [B, {w + 11}] for a carry of width {w + 4}, got {tuple(ints.shape)}"
    if tables_w.shape != tables_c.shape or tables_w.stride(1) != 1 or tables_c.stride(1) != 1:
        return (
            f"tables_w and tables_c must be one shape with contiguous rows, got {tuple(tables_w.shape)} and "
            f"{tuple(tables_c.shape)}"
        )
    if not -(2**63) <= int(pad_row) < 2**63:
        return f"pad_row {pad_row} outside int64"
    return None


register("read_carry", "triton", triton_read_carry, can_run=_can_run_read, deterministic=True, priority=10)


def _spec_advance_kernel(
    nxt_ptr,
    out_ptr,
    pos_ptr,
    idx_ptr,
    acc_ptr,
    bonus_ptr,
    drafts_ptr,
    start_ptr,
    cnt_ptr,
    B,
    s_acc,
    s_bonus,
    s_d0,
    s_d1,
    s_start,
    s_cnt,
    W: tl.constexpr,
    BW: tl.constexpr,
    COUNTERS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BW).to(tl.int64)
    live = j <= W
    a = tl.load(acc_ptr + row * s_acc + j * 0).to(tl.int64)  # (as blocks: see `_read_carry_kernel`)
    bonus = tl.load(bonus_ptr + row * s_bonus + j * 0).to(tl.int64)
    d = tl.load(drafts_ptr + row * s_d0 + j * s_d1, mask=j < W, other=0).to(tl.int64)
    tl.store(nxt_ptr + row * (W + 1) + j, tl.where(j < a, d, bonus), mask=live)
    tl.store(out_ptr + row + j * 0, row * (W + 1) + a, mask=j == 0)
    first = tl.load(start_ptr + row * s_start + j * 0).to(tl.int64) + a + 1
    tl.store(pos_ptr + j * B + row, first + j, mask=live)
    if COUNTERS:
        c = tl.load(cnt_ptr + row * s_cnt + j * 0).to(tl.int64) + a + 1
        tl.store(idx_ptr + j * B + row, c + j, mask=j < W)


_advance_kernel = Kernel(_spec_advance_kernel)


def triton_spec_advance(
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    start: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As the reference `spec_advance`, one program per row."""
    B, w = drafts.shape
    dev = drafts.device
    nxt = torch.empty(B, w + 1, dtype=torch.int64, device=dev)
    out = torch.empty(B, dtype=torch.int64, device=dev)
    pos = torch.empty(w + 1, B, dtype=torch.int64, device=dev)
    idx = None if counters is None else torch.empty(w, B, dtype=torch.int64, device=dev)
    if B:
        cnt = start if counters is None else counters  # (not read without counters)
        _advance_kernel[(B,)](
            nxt,
            out,
            pos,
            pos if idx is None else idx,
            accepted,
            bonus,
            drafts,
            start,
            cnt,
            B,
            accepted.stride(0),
            bonus.stride(0),
            drafts.stride(0),
            drafts.stride(1),
            start.stride(0),
            cnt.stride(0),
            W=w,
            BW=triton.next_power_of_2(w + 1),
            COUNTERS=counters is not None,
        )
    return nxt, out, pos, idx


def _can_run_advance(accepted, bonus, drafts, start, counters=None) -> str | None:
    named = [("accepted", accepted), ("bonus", bonus), ("drafts", drafts), ("start", start)]
    if counters is not None:
        named.append(("counters", counters))
    reason = device_reason(*(t for _, t in named))
    if reason:
        return reason
    if drafts.dim() != 2:
        return f"drafts must be [B, w], got {tuple(drafts.shape)}"
    B = drafts.size(0)
    for name, t in named:
        if t.dtype != torch.int64:
            return f"{name} must be int64, got {t.dtype}"
        if name != "drafts" and tuple(t.shape) != (B,):
            return f"{name} must be [{B}], got {tuple(t.shape)}"
    return None


register("spec_advance", "triton", triton_spec_advance, can_run=_can_run_advance, deterministic=True, priority=10)


__all__ = ["triton_read_carry", "triton_spec_advance", "triton_write_carry"]
