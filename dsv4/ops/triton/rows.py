"""`write_rows` (backend "triton"): the paged cache's row writes in one launch per call.

torch's `index_copy_` is one launch per (destination, source) pair and takes a few microseconds each even
for a few hundred rows (H200: 61 copies per `small` decode step, 0.20 ms at 256 rows, 0.48 ms in a step of
1,200 prompt tokens; moving the rows as 8-byte words changed nothing), and a compressor's kept rows are
gathered first (`kv[keep_tok]`, one more launch per tensor). Here one program copies one column block of
one listed row for every pair of the call, reading the source row where it lies (`pick`): a compressor's
raw kv and score rows reach their ring in one launch. A copy moves bits: the result is the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import register
from ._common import Kernel, device_reason, interpret_mode

MAX_PAIRS = 2
BLOCK = 1024  # columns per program


def _write_rows_kernel(
    src0_ptr,
    dst0_ptr,
    src1_ptr,
    dst1_ptr,
    pick_ptr,
    index_ptr,
    W,
    s_src0,
    s_dst0,
    s_src1,
    s_dst1,
    PAIRS: tl.constexpr,
    PICK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    row = tl.load(index_ptr + i).to(tl.int64)
    src = i
    if PICK:
        src = tl.load(pick_ptr + i).to(tl.int64)
    tl.store(dst0_ptr + row * s_dst0 + cols, tl.load(src0_ptr + src * s_src0 + cols, mask=ok), mask=ok)
    if PAIRS == 2:
        tl.store(dst1_ptr + row * s_dst1 + cols, tl.load(src1_ptr + src * s_src1 + cols, mask=ok), mask=ok)


_write_rows = Kernel(_write_rows_kernel)


def triton_write_rows(
    srcs: tuple[torch.Tensor, ...], pick: torch.Tensor | None, dsts: tuple[torch.Tensor, ...], index: torch.Tensor
) -> None:
    """As the reference `write_rows`, one launch for every pair."""
    k, w = index.numel(), dsts[0].size(1)
    if k == 0 or w == 0:
        return
    pairs = len(srcs)
    s1, d1 = (srcs[1], dsts[1]) if pairs == 2 else (srcs[0], dsts[0])
    index = index if index.stride(0) == 1 else index.contiguous()
    pk = index if pick is None else (pick if pick.stride(0) == 1 else pick.contiguous())
    block = min(BLOCK, triton.next_power_of_2(w))
    _write_rows[(k, triton.cdiv(w, block))](
        srcs[0],
        dsts[0],
        s1,
        d1,
        pk,
        index,
        w,
        srcs[0].stride(0),
        dsts[0].stride(0),
        s1.stride(0),
        d1.stride(0),
        PAIRS=pairs,
        PICK=pick is not None,
        BLOCK=block,
        **({} if interpret_mode() else {"num_warps": 4}),
    )


def _can_run(
    srcs: tuple[torch.Tensor, ...], pick: torch.Tensor | None, dsts: tuple[torch.Tensor, ...], index: torch.Tensor
) -> str | None:
    if not 1 <= len(srcs) <= MAX_PAIRS or len(dsts) != len(srcs):
        return f"{len(srcs)} sources and {len(dsts)} destinations (need 1..{MAX_PAIRS} pairs)"
    idx = (index,) if pick is None else (index, pick)
    reason = device_reason(*srcs, *dsts, *idx)
    if reason:
        return reason
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*srcs, *dsts)):
        return "forward only: autograd records this call (write_rows is the paged cache's inference path)"
    if any(t.dim() != 2 or t.stride(1) != 1 for t in (*srcs, *dsts)):
        return "sources and destinations must be [rows, W] with unit column stride"
    w, dt = dsts[0].size(1), dsts[0].dtype
    if any(t.size(1) != w or t.dtype != dt for t in (*srcs, *dsts)):
        kinds = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in (*srcs, *dsts))
        return f"every source and destination must have one width and dtype (got {kinds})"
    if any(t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) for t in idx):
        return "index and pick must be 1-D int32 or int64"
    if pick is None and any(s.size(0) != index.numel() for s in srcs):
        return f"without pick each source needs one row per index entry ({index.numel()})"
    if pick is not None and pick.numel() != index.numel():
        return f"pick has {pick.numel()} entries, index {index.numel()}"
    return None


register("write_rows", "triton", triton_write_rows, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_write_rows"]
