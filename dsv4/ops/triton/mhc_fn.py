"""The mHC mix weight `fn` as the exact bf16 parts that `hc_pre` / `hc_head`'s kernels multiply.

`fn` [mix, hc * D] is fp32; the kernels run the mix projection on bf16 tensor cores, so `fn` is split into
three bf16 parts (hi + mid + lo == fn exactly) laid out [3, K, columns]: the pre | post columns
zero-padded to `pp_width(hc)`, and the hc x hc comb columns. The split is one launch over the weight. For a
weight that `ops.keep_splits` marked (a serving engine's, a graphed decoder's: fixed while they run) it
is made once and kept (`torch_native.kept_derived`: again after an in-place write, never inside a capture,
never for a weight autograd tracks); otherwise it is made at every call, so a CUDA graph that captured it
replays it against the parameter's current values (training).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_native import kept_derived
from ._mm_utils import INTERPRET as _INTERPRET
from ._mm_utils import launch as _launch
from ._mm_utils import split3


def pp_width(hc: int) -> int:
    """Columns of the pre | post part (2 hc, at least 16: a tensor-core tile's width)."""
    return max(16, triton.next_power_of_2(2 * hc))


@triton.jit
def _split_parts_store(w, out_ptr, K, ks, cols, mask, NC: tl.constexpr, UPCAST: tl.constexpr):
    """Stores w [BK, NC] fp32 as three exact bf16 parts at out[part, k, col] (out: [3, K, NC])."""
    hi, mid, lo = split3(w, UPCAST)
    offs = ks[:, None].to(tl.int64) * NC + cols[None, :]
    tl.store(out_ptr + offs, hi, mask=mask)
    tl.store(out_ptr + K * NC + offs, mid, mask=mask)
    tl.store(out_ptr + 2 * K * NC + offs, lo, mask=mask)


@triton.jit
def _split_fn_kernel(
    fn_ptr,
    fpp_ptr,
    fcb_ptr,
    K,
    N_PP: tl.constexpr,
    P1: tl.constexpr,
    P2: tl.constexpr,
    HEAD: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """fn [mix, K] fp32 -> fpp [3, K, P1] (pre | post columns, zero-padded), fcb [3, K, P2] (comb columns)."""
    ks = tl.program_id(0) * BK + tl.arange(0, BK)
    kmask = ks < K
    c1 = tl.arange(0, P1)
    w = tl.load(
        fn_ptr + c1[None, :].to(tl.int64) * K + ks[:, None], mask=kmask[:, None] & (c1[None, :] < N_PP), other=0.0
    )
    _split_parts_store(w, fpp_ptr, K, ks, c1, kmask[:, None], P1, UPCAST)
    if not HEAD:
        c2 = tl.arange(0, P2)
        w2 = tl.load(fn_ptr + (N_PP + c2[None, :]).to(tl.int64) * K + ks[:, None], mask=kmask[:, None], other=0.0)
        _split_parts_store(w2, fcb_ptr, K, ks, c2, kmask[:, None], P2, UPCAST)


def make_split(fn: torch.Tensor, hc: int, head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fn [mix, hc*D] -> (pre|post columns [3, K, P1], comb columns [3, K, hc*hc]; for the head, whose fn has
    only the pre columns, the first part twice), made now: one launch."""
    k = fn.size(1)
    p1 = pp_width(hc)
    fn = fn.detach().float().contiguous()
    fpp = torch.empty(3, k, p1, dtype=torch.bfloat16, device=fn.device)
    fcb = torch.empty(3, k, hc * hc, dtype=torch.bfloat16, device=fn.device) if not head else fpp
    bk = 64
    _launch(
        _split_fn_kernel,
        (triton.cdiv(k, bk),),
        fn,
        fpp,
        fcb,
        k,
        N_PP=hc if head else 2 * hc,
        P1=p1,
        P2=hc * hc,
        HEAD=head,
        BK=bk,
        UPCAST=_INTERPRET,
        num_warps=4,
    )
    return fpp, fcb


def split_fn(fn: torch.Tensor, hc: int, head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_split`'s parts: kept for a marked, untracked weight (call it outside autograd's forward, where
    autograd still says whether it tracks fn), else made now."""
    return kept_derived(fn, f"hc_split:{hc}:{int(head)}", lambda w: make_split(w, hc, head))
