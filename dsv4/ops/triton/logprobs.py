"""`token_logprobs` (backend "triton"): each row's log p(token) in one launch instead of about a dozen.

The reference (`dsv4.ops.reference.token_logprobs`) casts the logits to float64 and runs torch's logsumexp
(a max, its infinities masked, a subtraction, exp, a sum, log, an addition) and a gather: about a dozen
kernels over [N, V], each a launch in a speculative step's graph. Here one program per row reads its row
twice (the max, then the sum of exp(x - max)), in float64 as the reference, with its special values: a row
of -inf has logsumexp -inf, an infinite max is not subtracted, a NaN logit makes the row NaN (and a token
outside the vocabulary, which the reference refuses with an error, NaN: nothing is read). Only the
order of the sum differs, so a result is the reference's to float64 rounding (V terms: at most V + a few
units of 2^-53 of the log-sum relative, `tests/ops/test_triton_logprobs.py`). A row's number does not
depend on the other rows.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .. import register
from ._common import Kernel, device_reason

BLOCK = 1024  # columns per loop iteration
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _token_logprobs_kernel(out_ptr, x_ptr, tok_ptr, V, s_x, s_tok, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    NEG_INF: tl.constexpr = float("-inf")
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], NEG_INF, tl.float64)
    nan = tl.zeros([BLOCK], tl.int32)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(x_ptr + row * s_x + c, mask=c < V, other=NEG_INF).to(tl.float64)
        nan = nan | (x != x).to(tl.int32)
        m = tl.maximum(m, tl.where(x != x, NEG_INF, x))
    mx = tl.max(m, axis=0)
    shift = tl.where((mx == float("inf")) | (mx == NEG_INF), 0.0, mx)  # (torch masks an infinite max)
    s = tl.zeros([BLOCK], tl.float64)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(x_ptr + row * s_x + c, mask=c < V, other=NEG_INF).to(tl.float64)
        s += tl.where(c < V, tl.exp(x - shift), 0.0)
    lse = tl.log(tl.sum(s, axis=0)) + shift
    tok = tl.load(tok_ptr + row * s_tok + cols * 0)  # (as a block: masks stay blocks on every Triton)
    ok = (cols == 0) & (tok >= 0) & (tok < V)  # (a token outside the vocabulary reads nothing: NaN)
    xt = tl.load(x_ptr + row * s_x + tok, mask=ok, other=NEG_INF).to(tl.float64)
    xt = tl.max(tl.where(ok, xt, NEG_INF), axis=0)
    xt = tl.where(tl.max(ok.to(tl.int32), axis=0) > 0, xt, float("nan"))
    lp = xt - lse
    lp = tl.where(tl.max(nan, axis=0) > 0, float("nan"), lp)
    tl.store(out_ptr + row, lp)


_kernel = Kernel(_token_logprobs_kernel)


def triton_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """As the reference `token_logprobs`, one program per row."""
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.float64, device=logits.device)
    if N:
        _kernel[(N,)](out, logits, tokens, V, logits.stride(0), tokens.stride(0), BLOCK=BLOCK)
    return out


def _can_run(logits, tokens) -> str | None:
    reason = device_reason(logits, tokens)
    if reason:
        return reason
    if logits.dim() != 2 or logits.stride(1) != 1:
        return f"logits {tuple(logits.shape)} must be a [N, V] matrix with contiguous rows"
    if logits.dtype not in DTYPES:
        return f"logits dtype {logits.dtype} (need fp32, bf16, fp16 or fp64)"
    if tokens.dim() != 1 or tokens.size(0) != logits.size(0) or tokens.dtype != torch.int64:
        return f"tokens must be [{logits.size(0)}] int64, got {tuple(tokens.shape)} {tokens.dtype}"
    if not 1 <= logits.size(1) < 2**31:
        return f"vocabulary of {logits.size(1)} (need 1 .. 2^31 - 1)"
    return None


register("token_logprobs", "triton", triton_token_logprobs, can_run=_can_run, deterministic=True, priority=10)

__all__ = ["triton_token_logprobs"]
