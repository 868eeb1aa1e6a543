"""`speculative_accept` (backend "triton"): a verify step's acceptance in four small launches instead of ~60.

The reference (`dsv4.ops.reference.speculative_accept`) builds float64 distributions over [B, K + 1, V]
and [B, K, V] (softmax of the logits over T, or one-hots for greedy rows), gathers, hashes, compares and
draws with some sixty small kernels (0.34-0.58 ms replayed from a CUDA graph at the shipped model's
vocabulary on an H100). Here one kernel, launched in four phases (`PHASE`, a compile-time constant), does
the rule in float64 with the work spread over many programs:

0. (B, 2K + 1) programs, one per row and distribution: the max of the target's logits at position i (an
   exact reduction; the argmax too, NaN first and lowest index as torch.argmax) and sum(exp(x / T - max)),
   or the same of the draft's logits at position i. Positions a row cannot reach (past its own drafts) and
   the draft's distributions of greedy rows are skipped.
1. (B, C) programs, one per row and chunk of the vocabulary: the row's decisions from phase 0's numbers (for
   each draft while the row keeps accepting, p(d) = exp(x_d / T - max) / sum and q(d) likewise, the test u *
   q(d) <= p(d) with the reference's counter-hash uniform of (seed, counter + i, STREAM_ACCEPT)), then the
   chunk's part of the residual's mass, sum(max(p - q, 0)) at the first rejected position (q = 0 after the
   last draft).
2. The same programs: the decisions again, the mass (the chunks' parts added in chunk order), and the
   chunk's candidate of the next token by Gumbel-max: over log(max(p - q, 0) / mass) (log p when the
   residual has no mass) plus the noise of (seed, counter + accepted, STREAM_SAMPLE); a greedy row's
   argmax; a row without drafts draws as `gumbel_argmax` does (x / T + noise of (seed, counter)).
3. B programs: the chunks' candidates combined (the first NaN, else the largest, lowest index on ties).

Every element is the reference's operation on the reference's operands (libdevice `exp` and `log`, which
torch's CUDA kernels call too; IEEE division), so the maxima and each exp(x / T - max) are the reference's
bits; the sums add in another order, so a probability may differ from the reference's in its last float64
bits, and a decision differs only where the reference's own margin is that small (a uniform within ~1e-15
of p/q, two Gumbel candidates within ~1e-15): with float64 uniforms, never in practice. A row's numbers do
not depend on the other rows, nor on the chunking (the chunk size depends on V alone).

Why phases: with one program per row (before), a batch of 4 rows kept 4 streaming multiprocessors busy
with a dozen float64 passes over the vocabulary each, one after another (0.060 ms of a 1.3 ms verify step
at the shipped model's K = 2, batch 4, on an H100); phase 0 runs those passes side by side, and phases 1
and 2 split the two passes of the draw by chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import register
from ..reference import _GOLDEN, _MASK32, _MIX, STREAM_ACCEPT, STREAM_SAMPLE
from ._common import Kernel, device_reason, interpret_mode

BLOCK = 4096  # phase 0: vocabulary columns per loop iteration (one block reduction per BLOCK columns)
CHUNK = 512  # phases 1-2: the least columns per program (more where that would make over MAX_CHUNKS chunks)
MAX_CHUNKS = 256
NUM_WARPS = 4
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _spec_accept_kernel(
    x_ptr,
    q_ptr,
    qrow_ptr,
    d_ptr,
    n_ptr,
    temp_ptr,
    greedy_ptr,
    seed_ptr,
    counter_ptr,
    acc_ptr,
    tok_ptr,
    f_ptr,
    i_ptr,
    V,
    sx_b,
    sx_i,
    sq_b,
    sq_i,
    sd_b,
    s_n,
    s_t,
    s_g,
    s_s,
    s_c,
    s_qr,
    K: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    CH: tl.constexpr,
    NC: tl.constexpr,
    NCP: tl.constexpr,
    PHASE: tl.constexpr,
    MIX: tl.constexpr,
    MASK: tl.constexpr,
    GOLDEN: tl.constexpr,
    S_ACCEPT: tl.constexpr,
    S_SAMPLE: tl.constexpr,
    INTERP: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    # scratch, per row: floats [2K + 1 distributions x (max / T, sum)] then [C mass parts] then [C candidate
    # values]; ints [K + 1 argmaxes] then [C candidate columns] then [C first NaN columns]
    FR: tl.constexpr = 2 * (2 * K + 1) + 2 * NC
    IR: tl.constexpr = K + 1 + 2 * NC
    row = tl.program_id(0).to(tl.int64)
    job = tl.program_id(1).to(tl.int64)  # phase 0: the distribution; phases 1-2: the chunk
    n = tl.load(n_ptr + row * s_n).to(tl.int64)
    temp = tl.load(temp_ptr + row * s_t).to(tl.float64)
    greedy = tl.load(greedy_ptr + row * s_g) != 0
    sampled = ~greedy
    seed = tl.load(seed_ptr + row * s_s).to(tl.int64)
    counter = tl.load(counter_ptr + row * s_c).to(tl.int64)
    if HAS_ROWS:  # the draft logits' row in a store (`draft_rows`), else the row itself
        qrow = tl.load(qrow_ptr + row * s_qr).to(tl.int64)
    else:
        qrow = row
    fr = f_ptr + row * FR
    ir = i_ptr + row * IR
    NEG_INF: tl.constexpr = float("-inf")
    BIG: tl.constexpr = 2**62
    zero = tl.full((), 0.0, tl.float64)
    one = tl.full((), 1.0, tl.float64)

    if PHASE == 0:
        offs = tl.arange(0, BLOCK)
        if job <= K:
            # -- the target's logits at position i = job (reached only if i <= n): argmax and max, then the sum
            if job <= n:
                xp = x_ptr + row * sx_b + job * sx_i
                best_v = tl.full((), NEG_INF, tl.float64)
                best_i = tl.full((), -1, tl.int64)
                nan_i = tl.full((), -1, tl.int64)
                for b in range(NB):
                    cols = (b * BLOCK + offs).to(tl.int64)
                    inside = cols < V
                    v = tl.load(xp + cols, mask=inside, other=NEG_INF).to(tl.float64)
                    is_nan = (v != v) & inside
                    first_nan = tl.min(tl.where(is_nan, cols, BIG), axis=0)
                    if (nan_i < 0) & (first_nan < BIG):
                        nan_i = first_nan
                    clean = tl.where(is_nan | ~inside, NEG_INF, v)
                    vmax = tl.max(clean, axis=0)
                    vidx = tl.min(tl.where(inside & (clean == vmax), cols, BIG), axis=0)
                    if (best_i < 0) | (vmax > best_v):
                        best_v = vmax
                        best_i = vidx
                mp = best_v / temp  # max(x / T) = max(x) / T: the same division of the same element
                sp = one
                if sampled:
                    sp = zero
                    for b in range(NB):
                        cols = (b * BLOCK + offs).to(tl.int64)
                        inside = cols < V
                        v = tl.load(xp + cols, mask=inside, other=NEG_INF).to(tl.float64) / temp
                        if INTERP:
                            e = tl.exp(v - mp)
                        else:
                            e = libdevice.exp(v - mp)
                        sp += tl.sum(tl.where(inside, e, zero), axis=0)
                tl.store(ir + job, tl.where(nan_i >= 0, nan_i, best_i))
                tl.store(fr + 2 * job, mp)
                tl.store(fr + 2 * job + 1, sp)
        else:
            # -- the draft's logits at position i = job - K - 1 (read only for a sampled row's own drafts)
            i = job - K - 1
            if sampled & (i < n):
                qp = q_ptr + qrow * sq_b + i * sq_i
                qmax = tl.full((), NEG_INF, tl.float64)
                for b in range(NB):
                    cols = (b * BLOCK + offs).to(tl.int64)
                    inside = cols < V
                    w = tl.load(qp + cols, mask=inside, other=NEG_INF).to(tl.float64)
                    qmax = tl.maximum(qmax, tl.max(tl.where(w != w, NEG_INF, w), axis=0))
                mq = qmax / temp
                sq = zero
                for b in range(NB):
                    cols = (b * BLOCK + offs).to(tl.int64)
                    inside = cols < V
                    w = tl.load(qp + cols, mask=inside, other=NEG_INF).to(tl.float64) / temp
                    if INTERP:
                        e = tl.exp(w - mq)
                    else:
                        e = libdevice.exp(w - mq)
                    sq += tl.sum(tl.where(inside, e, zero), axis=0)
                tl.store(fr + 2 * job, mq)
                tl.store(fr + 2 * job + 1, sq)

    if (PHASE == 1) | (PHASE == 2):
        # -- the row's decisions from phase 0's numbers (every program of the row makes the same ones)
        acc = tl.full((), 0, tl.int64)  # drafts accepted so far
        going = n >= 0  # (true) the row has not stopped yet
        # at the position where it stops (a = acc): max and sum of x / T, and of q where q is used
        mp_a, sp_a = zero, one
        mq_a, sq_a = zero, one
        use_q = n < 0  # (false)
        for i in tl.static_range(K + 1):
            if going:
                mp = tl.load(fr + 2 * i)
                sp = tl.load(fr + 2 * i + 1)
                ok = n < 0  # (false)
                tested = n < 0
                mq, sq = zero, one
                if i < K:
                    tested = i < n
                    if tested:
                        am = tl.load(ir + i)
                        d = tl.load(d_ptr + row * sd_b + i).to(tl.int64)
                        d = tl.minimum(tl.maximum(d, 0), V - 1)
                        p_d = tl.where(am == d, one, zero)
                        q_d = one
                        if sampled:
                            xd = tl.load(x_ptr + row * sx_b + i * sx_i + d).to(tl.float64) / temp
                            mq = tl.load(fr + 2 * (K + 1 + i))
                            sq = tl.load(fr + 2 * (K + 1 + i) + 1)
                            qd = tl.load(q_ptr + qrow * sq_b + i * sq_i + d).to(tl.float64) / temp
                            if INTERP:
                                p_d = tl.exp(xd - mp) / sp
                                q_d = tl.exp(qd - mq) / sq
                            else:
                                p_d = libdevice.exp(xd - mp) / sp
                                q_d = libdevice.exp(qd - mq) / sq
                        # the uniform of (seed, counter + i, STREAM_ACCEPT), column 0
                        c = counter + i
                        key = (seed & MASK) ^ S_ACCEPT
                        for j in tl.static_range(3):
                            for _ in tl.static_range(2):
                                key = ((key ^ (key >> 16)) * MIX) & MASK
                            key = key ^ (key >> 16)
                            if j == 0:
                                key = key ^ ((seed >> 32) & MASK)
                            if j == 1:
                                key = key ^ (c & MASK)
                        h = (key & MASK).to(tl.uint32)
                        for _ in tl.static_range(2):
                            h = (h ^ (h >> 16)) * MIX
                        h = h ^ (h >> 16)
                        u = (h.to(tl.float64) + 0.5) / 4294967296.0
                        ok = u * q_d <= p_d
                if ok:
                    acc += 1
                else:
                    going = n < 0  # (false): the row stops here
                    mp_a, sp_a = mp, sp
                    mq_a, sq_a = mq, sq
                    use_q = tested

        # -- the next token at position a = acc, over this program's chunk of the vocabulary
        a = acc
        xp = x_ptr + row * sx_b + a * sx_i
        qp = q_ptr + qrow * sq_b + tl.minimum(a, K - 1).to(tl.int64) * sq_i
        residual = (n > 0) & sampled
        Vq = tl.where(use_q, V, 0)  # the columns of q that are read (none after the last draft)
        cols = job * CH + tl.arange(0, CH).to(tl.int64)
        inside = cols < V
        x = tl.load(xp + cols, mask=inside, other=NEG_INF).to(tl.float64)
        p = tl.zeros([CH], dtype=tl.float64)
        r = tl.zeros([CH], dtype=tl.float64)
        if residual:
            w = tl.load(qp + cols, mask=cols < Vq, other=NEG_INF).to(tl.float64) / temp
            if INTERP:
                p = tl.exp(x / temp - mp_a) / sp_a
                q = tl.where(use_q, tl.exp(w - mq_a) / sq_a, zero)
            else:
                p = libdevice.exp(x / temp - mp_a) / sp_a
                q = tl.where(use_q, libdevice.exp(w - mq_a) / sq_a, zero)
            r = p - q
            r = tl.where(r < 0, zero, r)  # clamp_min(0), NaN kept
        if PHASE == 1:
            part = zero
            if residual:
                part = tl.sum(tl.where(inside, r, zero), axis=0)
            tl.store(fr + 2 * (2 * K + 1) + job, part)
        else:
            mass = zero
            if residual:
                for c2 in range(NC):  # the chunks' parts in chunk order
                    mass += tl.load(fr + 2 * (2 * K + 1) + c2)
            key = (seed & MASK) ^ S_SAMPLE
            ca = counter + a
            for j in tl.static_range(3):
                for _ in tl.static_range(2):
                    key = ((key ^ (key >> 16)) * MIX) & MASK
                key = key ^ (key >> 16)
                if j == 0:
                    key = key ^ ((seed >> 32) & MASK)
                if j == 1:
                    key = key ^ (ca & MASK)
            h = ((key + cols * GOLDEN) & MASK).to(tl.uint32)
            for _ in tl.static_range(2):
                h = (h ^ (h >> 16)) * MIX
            h = h ^ (h >> 16)
            u = (h.to(tl.float64) + 0.5) / 4294967296.0
            if INTERP:
                noise = -tl.log(-tl.log(u))
            else:
                noise = -libdevice.log(-libdevice.log(u))
            val = tl.where(greedy, x, x / temp + noise)  # a plain draw, or a greedy row's argmax
            if residual:
                rr = tl.where(mass > 0, r / tl.maximum(mass, 1e-300), p)
                if INTERP:
                    val = tl.log(rr) / 1.0 + noise
                else:
                    val = libdevice.log(rr) / 1.0 + noise
            is_nan = (val != val) & inside
            first_nan = tl.min(tl.where(is_nan, cols, BIG), axis=0)
            clean = tl.where(is_nan | ~inside, NEG_INF, val)
            vmax = tl.max(clean, axis=0)
            vidx = tl.min(tl.where(inside & (clean == vmax), cols, BIG), axis=0)
            tl.store(fr + 2 * (2 * K + 1) + NC + job, vmax)
            tl.store(ir + K + 1 + job, vidx)
            tl.store(ir + K + 1 + NC + job, tl.where(first_nan < BIG, first_nan, -1))
            if job == 0:
                tl.store(acc_ptr + row, acc)

    if PHASE == 3:
        # -- the chunks' candidates: the first NaN, else the largest value, the lowest column on ties
        ch = tl.arange(0, NCP)
        real = ch < NC
        vals = tl.load(fr + 2 * (2 * K + 1) + NC + ch, mask=real, other=NEG_INF)
        idx = tl.load(ir + K + 1 + ch, mask=real, other=BIG)
        nans = tl.load(ir + K + 1 + NC + ch, mask=real, other=-1)
        first_nan = tl.min(tl.where(nans >= 0, nans, BIG), axis=0)
        vmax = tl.max(vals, axis=0)
        best = tl.min(tl.where(real & (vals == vmax), idx, BIG), axis=0)
        tl.store(tok_ptr + row, tl.where(first_nan < BIG, first_nan, best))


_kernel = Kernel(_spec_accept_kernel)


def chunking(V: int) -> tuple[int, int]:
    """(columns per program, programs per row) of phases 1-2: CHUNK columns (fewer for a smaller vocabulary),
    doubled until at most MAX_CHUNKS programs cover V."""
    ch = min(CHUNK, triton.next_power_of_2(V))
    while triton.cdiv(V, ch) > MAX_CHUNKS:
        ch *= 2
    return ch, triton.cdiv(V, ch)


def triton_speculative_accept(
    logits: torch.Tensor,
    draft_logits: torch.Tensor,
    drafts: torch.Tensor,
    n_drafts: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    draft_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference `speculative_accept`, in four phases (the module's docstring); with draft_rows each
    row's draft logits are read in place from their row of the store."""
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    accepted = torch.empty(B, dtype=torch.int64, device=dev)
    token = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return accepted, token
    block = min(BLOCK, triton.next_power_of_2(V))
    ch, nc = chunking(V)
    floats = torch.empty(B, 2 * (2 * K + 1) + 2 * nc, dtype=torch.float64, device=dev)
    ints = torch.empty(B, K + 1 + 2 * nc, dtype=torch.int64, device=dev)
    q = draft_logits if K and draft_logits.numel() else logits  # (K = 0: never read)
    rows = draft_rows if draft_rows is not None and q is draft_logits else None
    qr = rows if rows is not None else n_drafts  # (without rows: never read)
    d = drafts if drafts.numel() else n_drafts
    g = greedy.view(torch.uint8)
    args = (
        logits,
        q,
        qr,
        d,
        n_drafts,
        temperature,
        g,
        seeds,
        counters,
        accepted,
        token,
        floats,
        ints,
        V,
        logits.stride(0),
        logits.stride(1),
        q.stride(0),
        q.stride(1) if q.dim() == 3 else 0,
        d.stride(0),
        n_drafts.stride(0),
        temperature.stride(0),
        g.stride(0),
        seeds.stride(0),
        counters.stride(0),
        qr.stride(0),
    )
    consts = {
        "K": K,
        "NB": triton.cdiv(V, block),
        "BLOCK": block,
        "CH": ch,
        "NC": nc,
        "NCP": triton.next_power_of_2(nc),
        "MIX": _MIX,
        "MASK": _MASK32,
        "GOLDEN": _GOLDEN,
        "S_ACCEPT": STREAM_ACCEPT,
        "S_SAMPLE": STREAM_SAMPLE,
        "INTERP": interpret_mode(),
        "HAS_ROWS": rows is not None,
    }
    interp = interpret_mode()
    wide = {} if interp else {"num_warps": NUM_WARPS if block < 2048 else 8}
    narrow = {} if interp else {"num_warps": NUM_WARPS}
    _kernel[(B, 2 * K + 1)](*args, PHASE=0, **consts, **wide)
    _kernel[(B, nc)](*args, PHASE=1, **consts, **narrow)
    _kernel[(B, nc)](*args, PHASE=2, **consts, **narrow)
    _kernel[(B, 1)](*args, PHASE=3, **consts, **narrow)
    return accepted, token


def _can_run(
    logits, draft_logits, drafts, n_drafts, temperature, greedy, seeds, counters, draft_rows=None
) -> str | None:
    tensors = (logits, draft_logits, drafts, n_drafts, temperature, greedy, seeds, counters)
    reason = device_reason(*tensors, *(() if draft_rows is None else (draft_rows,)))
    if reason:
        return reason
    if logits.dim() != 3 or logits.stride(2) != 1 or logits.dtype not in LOGIT_DTYPES:
        return f"logits must be [B, K + 1, V] float with contiguous rows, got {tuple(logits.shape)} {logits.dtype}"
    B, K1, V = logits.shape
    K = K1 - 1
    if draft_rows is not None:
        if tuple(draft_rows.shape) != (B,) or draft_rows.dtype != torch.int64:
            return f"draft_rows must be [{B}] int64, got {tuple(draft_rows.shape)} {draft_rows.dtype}"
        ok = draft_logits.dim() == 3 and draft_logits.size(1) >= K and draft_logits.size(2) == V
        if not ok or draft_logits.dtype not in LOGIT_DTYPES:
            return (
                f"draft_logits with draft_rows must be a store [R, >= {K}, {V}] float, got "
                f"{tuple(draft_logits.shape)} {draft_logits.dtype}"
            )
    elif tuple(draft_logits.shape) != (B, K, V) or draft_logits.dtype not in LOGIT_DTYPES:
        return f"draft_logits must be [{B}, {K}, {V}] float, got {tuple(draft_logits.shape)} {draft_logits.dtype}"
    if K and draft_logits.stride(2) != 1:
        return "draft_logits rows must be contiguous"
    if tuple(drafts.shape) != (B, K) or drafts.dtype != torch.int64 or (K and drafts.stride(1) != 1):
        return f"drafts must be [{B}, {K}] int64 with contiguous rows, got {tuple(drafts.shape)} {drafts.dtype}"
    for name, t, dtype in (
        ("n_drafts", n_drafts, torch.int64),
        ("temperature", temperature, torch.float64),
        ("greedy", greedy, torch.bool),
        ("seeds", seeds, torch.int64),
        ("counters", counters, torch.int64),
    ):
        if tuple(t.shape) != (B,) or t.dtype != dtype:
            return f"{name} must be [{B}] {dtype}, got {tuple(t.shape)} {t.dtype}"
    if not 1 <= V < 2**31:
        return f"vocabulary of {V} (need 1 .. 2^31 - 1)"
    return None


# Timed in its phased form on one H100 (2026-12-07, `scripts/bench_step_kernels.py --only accept`, medians of
# 3 x 200 graph replays): 21-30 us for 1 to 64 rows at V = 4,096 against the reference's 379-577 us; at V4's
# 129,280 columns 185 us for 4 rows (K = 2) against 917 us and 892 us for 64 rows (K = 3) against 6.52 ms.
# Faster at every shape timed, so it is preferred wherever it can run (its one-program-per-row form lost at
# V4's vocabulary under 32 rows and was kept to small vocabularies or many rows).


register(
    "speculative_accept",
    "triton",
    triton_speculative_accept,
    can_run=_can_run,
    deterministic=True,
    priority=10,
)

__all__ = ["triton_speculative_accept"]
