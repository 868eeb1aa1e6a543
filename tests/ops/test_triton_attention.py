"""Triton sparse attention and Lightning Indexer vs the plain-torch reference, forward and backward.

On a machine without CUDA the kernels run on the Triton CPU interpreter: the `_interpret` fixture sets
`TRITON_INTERPRET=1` only while these tests run (dsv4's kernel launcher reads it at launch, so import order
does not matter and other test modules are unaffected). With CUDA the same tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")

import dsv4.ops as ops  # noqa: E402
import dsv4.ops.triton.indexer as ix  # noqa: E402  (a missing kernel module is an error, not a skip)
import dsv4.ops.triton.sparse_attention as sa  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops.reset_calls()
    ops.set_deterministic(False)
    yield
    ops.set_deterministic(False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> tuple[float, float]:
    """(forward, gradient) relative-L2 tolerances."""
    return (1e-2, 2e-2) if dtype != torch.float32 else (1e-5, 1e-4)


def rope(x: torch.Tensor, pos: torch.Tensor, rd: int) -> torch.Tensor:
    """Interleaved RoPE on the last `rd` dims of x [b, t, d] at positions pos [t] (theta 10000)."""
    inv = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float32) / rd)  # [rd/2]
    ang = pos.float().unsqueeze(-1) * inv  # [t, rd/2]
    cos, sin = ang.cos(), ang.sin()
    xr = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    a, b = xr[..., 0], xr[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    return torch.cat([x[..., :-rd].float(), out], -1)


# ----------------------------------------------------------------------------- sparse attention inputs
def attn_inputs(b, s, h, d, n, k, dtype, kind="random", seed=0):
    g = torch.Generator().manual_seed(seed)
    sink = torch.randn(h, generator=g)
    if kind in ("random", "padding", "big_sink"):
        q = torch.randn(b, s, h, d, generator=g)
        kv = torch.randn(b, n, d, generator=g)
        idx = torch.randint(0, n, (b, s, k), generator=g)
        idx = torch.where(torch.rand(b, s, k, generator=g) < 0.2, -1, idx)  # scattered padding
        if kind == "padding":
            idx[:, ::2] = -1  # all-padding rows
        if kind == "big_sink":
            sink = torch.tensor([8.0, -8.0, 30.0, -30.0] * h)[:h]
    elif kind in ("peaked", "window_only"):
        # RoPE'd, RMS-normalized q/kv like a real layer; q close to one key -> a peaked softmax
        pos = torch.arange(n)
        x = torch.randn(b, n, d, generator=g)
        kv = rope(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6), pos, min(64, d // 2))
        tq = torch.arange(s) + (n - s)  # last s positions
        if kind == "window_only":
            # no compressed keys: each query sees the causal window of its last k positions only
            win = tq.view(s, 1) - torch.arange(k).view(1, k)
            idx = torch.where(win >= 0, win, -1).expand(b, s, k).clone()
        else:
            idx = torch.randint(0, n, (b, s, k), generator=g)
            idx[..., 0] = tq.view(1, s)  # own key first
        own = kv[:, tq].unsqueeze(2)  # [b, s, 1, d]
        # logit gap ~ 0.6 * sqrt(d): the own key takes most of the mass (max p ~ 0.9-0.999), yet the
        # softmax is not saturated to where every gradient is rounding noise (in the reference too)
        q = 0.6 * own + 0.3 * torch.randn(b, s, h, d, generator=g)
        sink = sink * 3
    else:
        raise ValueError(kind)
    return q.to(dtype), kv.to(dtype), sink, idx


def run_both(q, kv, sink, idx, scale, grad_seed=1):
    """(triton outputs and grads, reference outputs and grads) for loss = sum(o * g)."""
    res = []
    g = None
    for backend in ("triton", "reference"):
        qq, kk, ss = (x.detach().clone().to(DEV).requires_grad_() for x in (q, kv, sink))
        o, lse = ops.sparse_attention(qq, kk, ss, idx.to(DEV), scale, backend=backend)
        if backend == "triton":
            assert ops.last_backend("sparse_attention") == "triton"
        if g is None:
            g = torch.randn(o.shape, generator=torch.Generator().manual_seed(grad_seed)).to(DEV, o.dtype)
        (o.float() * g.float()).sum().backward()
        res.append((o.detach(), lse, qq.grad, kk.grad, ss.grad))
    return res


ATTN_CASES = [
    # b, s, h, d, n, k, dtype, kind
    (1, 3, 1, 32, 9, 1, torch.float32, "random"),  # one head, one key
    (2, 5, 3, 48, 20, 13, torch.float32, "random"),  # d and k not multiples of the blocks
    (2, 4, 8, 64, 40, 37, torch.bfloat16, "random"),
    (1, 2, 4, 32, 400, 300, torch.bfloat16, "random"),  # many keys per query
    (2, 4, 20, 32, 30, 17, torch.float32, "padding"),  # several head blocks, all-padding rows
    (1, 4, 4, 32, 24, 9, torch.float32, "big_sink"),  # sinks dominate or vanish
    (2, 5, 4, 128, 64, 24, torch.bfloat16, "peaked"),  # RoPE'd, peaked softmax
    (1, 6, 4, 128, 40, 8, torch.bfloat16, "window_only"),  # docs/bugzoo.md Z13: no compressed keys
    (1, 6, 4, 128, 40, 8, torch.float32, "window_only"),
]


@pytest.mark.parametrize("b,s,h,d,n,k,dtype,kind", ATTN_CASES)
def test_sparse_attention_matches_reference(b, s, h, d, n, k, dtype, kind):
    q, kv, sink, idx = attn_inputs(b, s, h, d, n, k, dtype, kind)
    (o, lse, dq, dkv, dsink), (ro, rl, rdq, rdkv, rdsink) = run_both(q, kv, sink, idx, d**-0.5)
    ftol, gtol = tol(dtype)
    for t in (o, lse, dq, dkv, dsink):
        assert torch.isfinite(t).all()
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and not lse.requires_grad
    assert rel(o, ro) < ftol
    assert (lse - rl).abs().max() < 1e-4
    assert rel(dq, rdq) < gtol
    assert rel(dkv, rdkv) < gtol
    assert rel(dsink, rdsink) < gtol
    if kind == "padding":  # a query with no key: o = 0 and lse = sink exactly, no gradient to q
        assert (o[:, ::2] == 0).all()
        assert torch.equal(lse[:, ::2], sink.to(DEV).expand_as(lse[:, ::2]))
        assert (dq[:, ::2] == 0).all()


@pytest.mark.parametrize("kind,dtype", [("padding", torch.float32), ("peaked", torch.bfloat16)])
def test_fused_backward_matches_reference(kind, dtype, monkeypatch):
    """The single-kernel backward (used above 64 heads) against the reference."""
    monkeypatch.setitem(sa.BWD_CONFIG, "mode", "fused")
    q, kv, sink, idx = attn_inputs(2, 4, 20, 64, 30, 17, dtype, kind)
    (o, lse, dq, dkv, dsink), (ro, rl, rdq, rdkv, rdsink) = run_both(q, kv, sink, idx, 64**-0.5)
    gtol = tol(dtype)[1]
    assert rel(dq, rdq) < gtol and rel(dkv, rdkv) < gtol and rel(dsink, rdsink) < gtol


@pytest.mark.parametrize("mode", ["two_pass", "fused"])
def test_unreferenced_kv_rows_get_no_gradient(mode, monkeypatch):
    """Padding slots (-1) must not scatter into any row (e.g. row 0 or the previous batch's last row)."""
    monkeypatch.setitem(sa.BWD_CONFIG, "mode", mode)
    q, kv, sink, idx = attn_inputs(2, 4, 4, 32, 16, 6, torch.float32, "random", seed=3)
    idx = torch.where(idx < 8, -1, idx)  # rows 0..7 of each batch: never referenced
    for det in (False, True):
        ops.set_deterministic(det)
        (_, _, _, dkv, _), (_, _, _, rdkv, _) = run_both(q, kv, sink, idx, 32**-0.5)
        assert (dkv[:, :8] == 0).all()
        assert rel(dkv, rdkv) < 1e-4


@pytest.mark.parametrize("d_split", [1, 2])
def test_forward_column_split_matches_reference(d_split, monkeypatch):
    """D_SPLIT programs per (query, head block), each owning a slice of the output columns."""
    for cfg in (sa.FWD_CONFIG, sa.FWD_CONFIG_NARROW):  # (6 heads: the narrow plan)
        monkeypatch.setitem(cfg, "D_SPLIT", d_split)
    q, kv, sink, idx = attn_inputs(2, 3, 6, 48, 30, 17, torch.bfloat16, "padding")
    (o, lse, dq, dkv, dsink), (ro, rl, rdq, rdkv, rdsink) = run_both(q, kv, sink, idx, 48**-0.5)
    assert rel(o, ro) < 1e-2 and (lse - rl).abs().max() < 1e-4
    assert rel(dq, rdq) < 2e-2 and rel(dkv, rdkv) < 2e-2
    for splits in (3,):
        o2, l2 = sa.sparse_attention_fwd(q.to(DEV), kv.to(DEV), sink.to(DEV), idx.to(DEV), 48**-0.5, splits=splits)
        assert rel(o2, ro) < 1e-2 and (l2 - rl).abs().max() < 1e-4


@pytest.mark.parametrize("splits", [2, 3, None])
def test_decode_split_matches_reference(splits):
    q, kv, sink, idx = attn_inputs(3, 1, 4, 64, 90, 70, torch.bfloat16, "random", seed=5)
    idx[1] = -1  # one sequence with no key at all
    q, kv, sink, idx = (x.to(DEV) for x in (q, kv, sink, idx))
    o, lse = sa.sparse_attention_fwd(q, kv, sink, idx, 0.125, splits=splits)
    ro, rl = ref.sparse_attention(q, kv, sink, idx, 0.125)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert rel(o, ro) < 1e-2
    assert (lse - rl).abs().max() < 1e-4
    assert (o[1] == 0).all()


@pytest.mark.parametrize("splits", [1, 3])
def test_outputs_do_not_write_outside_their_buffers(splits):
    """Canary (docs/bugzoo.md Z12): outputs are views into NaN-filled buffers; the surroundings stay NaN."""
    b, s, h, d, k = 2, 3, 4, 32, 40
    q, kv, sink, idx = (x.to(DEV) for x in attn_inputs(b, s, h, d, 50, k, torch.float32, "padding"))
    pad = 37
    obuf = torch.full((q.numel() + 2 * pad,), float("nan"), device=DEV)
    lbuf = torch.full((b * s * h + 2 * pad,), float("nan"), device=DEV)
    o_view = obuf[pad : pad + q.numel()].view(q.shape)
    l_view = lbuf[pad : pad + b * s * h].view(b, s, h)
    sa.sparse_attention_fwd(q, kv, sink, idx, d**-0.5, splits=splits, out=(o_view, l_view))
    assert obuf[:pad].isnan().all() and obuf[-pad:].isnan().all()
    assert lbuf[:pad].isnan().all() and lbuf[-pad:].isnan().all()
    assert torch.isfinite(o_view).all() and torch.isfinite(l_view).all()
    ro, rl = ref.sparse_attention(q, kv, sink, idx, d**-0.5)
    assert rel(o_view, ro) < 1e-5


@pytest.mark.parametrize("mode", ["two_pass", "fused"])
def test_deterministic_mode_repeats_bit_identically(mode, monkeypatch):
    monkeypatch.setitem(sa.BWD_CONFIG, "mode", mode)
    q, kv, sink, idx = attn_inputs(2, 3, 4, 32, 8, 20, torch.bfloat16, "random", seed=7)  # many collisions
    ops.set_deterministic(True)
    runs = [run_both(q, kv, sink, idx, 0.125)[0] for _ in range(2)]
    for a, c in zip(runs[0], runs[1]):
        assert torch.equal(a, c)
    assert ops.calls().get(("sparse_attention", "triton")) == 2


def test_lse_gradient_is_ignored():
    """docs/bugzoo.md Z14/Z15: lse is returned non-differentiable; a loss through it changes no gradient."""
    q, kv, sink, idx = (x.to(DEV) for x in attn_inputs(1, 3, 2, 32, 10, 5, torch.float32, "random"))
    grads = []
    for with_lse in (False, True):
        qq = q.clone().requires_grad_()
        o, lse = ops.sparse_attention(qq, kv, sink, idx, 0.2, backend="triton")
        assert not lse.requires_grad
        loss = o.sum() + (lse.sum() if with_lse else 0)
        loss.backward()
        grads.append(qq.grad)
    assert torch.equal(grads[0], grads[1])


def test_explicit_triton_request_that_cannot_run_raises(monkeypatch):
    q, kv, sink, idx = (x.to(DEV) for x in attn_inputs(1, 2, 2, 32, 8, 3, torch.float32, "random"))
    reason = sa.can_run(q, kv, sink, idx.float(), 0.1)
    assert reason and "idx" in reason
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        assert "CUDA" in sa.can_run(q, kv, sink, idx, 0.1)
        with pytest.raises(ops.BackendUnavailable):
            ops.sparse_attention(q, kv, sink, idx, 0.1, backend="triton")
        ops.sparse_attention(q, kv, sink, idx, 0.1)  # default: the reference runs instead
        assert ops.last_backend("sparse_attention") == "reference"


# ----------------------------------------------------------------------------- indexer
def indexer_inputs(b, s, h, d, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, n, d, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g) * (h * d) ** -0.5
    return q, k, w


INDEX_CASES = [
    # b, s, h, d, n, ratio, first position, dtype
    (1, 9, 1, 32, 5, 1, 0, torch.float32),
    (2, 21, 3, 32, 9, 2, 0, torch.float32),  # causal, lengths off the block sizes
    (2, 17, 4, 64, 12, 4, 30, torch.bfloat16),
    (1, 19, 8, 64, 37, 4, 0, torch.bfloat16),  # early rows see nothing (all -inf)
    (1, 6, 2, 32, 20, 4, 1000, torch.float32),  # everything visible
]


@pytest.mark.parametrize("b,s,h,d,n,ratio,p0,dtype", INDEX_CASES)
def test_indexer_scores_match_reference(b, s, h, d, n, ratio, p0, dtype):
    q, k, w = indexer_inputs(b, s, h, d, n, dtype)
    pos = (torch.arange(s) + p0).to(DEV)
    outs = []
    for backend in ("triton", "reference"):
        qq, kk, ww = (x.detach().clone().to(DEV).requires_grad_() for x in (q, k, w))
        sc = ops.indexer_scores(qq, kk, ww, pos, ratio, backend=backend)
        if backend == "triton":
            assert ops.last_backend("indexer_scores") == "triton"
        fin = torch.isfinite(sc)
        g = torch.randn(sc.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
        sc.masked_fill(~fin, 0).mul(g).sum().backward()
        outs.append((sc.detach(), qq.grad, kk.grad, ww.grad))
    (sc, dq, dk, dw), (rs, rdq, rdk, rdw) = outs
    fin = torch.isfinite(rs)
    assert torch.equal(fin, torch.isfinite(sc))
    assert (sc[~fin] == float("-inf")).all()
    ftol, gtol = tol(dtype)
    assert rel(sc[fin], rs[fin]) < ftol
    for a, r in ((dq, rdq), (dk, rdk), (dw, rdw)):
        assert torch.isfinite(a).all()
        assert rel(a, r) < gtol


@pytest.mark.parametrize("topk", [1, 4, 50])
def test_indexer_topk_matches_reference(topk, monkeypatch):
    monkeypatch.setattr(ix, "MAX_CHUNK_ENTRIES", 2 * 3 * 40)  # force several chunks, a ragged last one
    b, s, h, d, n, ratio = 2, 23, 4, 32, 40, 2
    q, k, w = (x.to(DEV) for x in indexer_inputs(b, s, h, d, n, torch.float32, seed=4))
    pos = torch.arange(s, device=DEV) + 40
    got = ops.indexer_topk(q, k, w, pos, ratio, topk, backend="triton")
    assert ops.last_backend("indexer_topk") == "triton"
    want = ref.indexer_topk(q, k, w, pos, ratio, topk)
    assert got.shape == want.shape == (b, s, min(topk, n)) and got.dtype == torch.int64
    assert torch.equal(got, want)
    vis = (pos + 1) // ratio  # padding exactly where nothing is left
    assert torch.equal((got >= 0).sum(-1), vis.clamp(max=min(topk, n)).expand(b, s))


def test_indexer_topk_per_row_positions_matches_reference():
    """Positions [b, s] (the serving engine's decode and verify groups: each row its own sequence, -1 rows
    are padding and see nothing) give the reference's picks, row by row."""
    b, s, h, d, n, ratio = 3, 4, 2, 32, 30, 4
    q, k, w = (x.to(DEV) for x in indexer_inputs(b, s, h, d, n, torch.float32, seed=5))
    pos = torch.tensor([[3, 4, 5, 6], [40, 41, 42, 43], [-1, -1, 0, 9]], device=DEV)
    got = ops.indexer_topk(q, k, w, pos, ratio, 5, backend="triton")
    assert ops.last_backend("indexer_topk") == "triton"
    want = ref.indexer_topk(q, k, w, pos, ratio, 5)
    assert torch.equal(got, want)
    rows = [ref.indexer_topk(q[i : i + 1], k[i : i + 1], w[i : i + 1], pos[i], ratio, 5) for i in range(b)]
    assert torch.equal(want, torch.cat(rows))  # [b, s] positions = each row on its own
    assert (want[2, :2] == -1).all()  # padding rows pick nothing
    with pytest.raises(ops.BackendUnavailable, match="top-k only"):
        ops.indexer_scores(q, k, w, pos, ratio, backend="triton")


@pytest.mark.parametrize("per_row", [False, True])
def test_indexer_topk_reads_a_paged_pool_through_its_candidates(per_row, monkeypatch):
    """The serving engine's form: keys in a pool [rows, d], row b's candidates cand[b] (pool rows; a page
    that does not exist points at the trash row 0). The kernel reads the pool through cand - no gathered
    copy - and must pick exactly what the reference picks from the gathered keys, bit for bit, also
    across several query tiles and chunks."""
    monkeypatch.setattr(ix, "MAX_CHUNK_ENTRIES", 3 * 5 * 64)  # several chunks
    b, s, h, d, n, ratio, pool = 3, 9, 4, 32, 64, 4, 500
    g = torch.Generator().manual_seed(6)
    q, k, w = (x.to(DEV) for x in indexer_inputs(b, s, h, d, pool, torch.float32, seed=6))
    keys = k[0]  # [pool, d]
    cand = torch.randint(0, pool, (b, n), generator=g)
    cand[1, 40:] = 0  # a row whose later pages do not exist yet
    cand = cand.to(DEV)
    if per_row:
        pos = torch.tensor([list(range(60, 60 + s)), list(range(100, 100 + s)), [-1] * 3 + list(range(6))])
    else:
        pos = torch.arange(s) + 200
    pos = pos.to(DEV)
    got = ops.indexer_topk(q, keys, w, pos, ratio, 16, cand, backend="triton")
    assert ops.last_backend("indexer_topk") == "triton"
    want = ref.indexer_topk(q, keys[cand], w, pos, ratio, 16)
    assert torch.equal(got, want)
    assert torch.equal(ref.indexer_topk(q, keys, w, pos, ratio, 16, cand), want)  # the reference's paged form
    assert "cand" in ops.refusal("indexer_topk", "triton", q, keys, w, pos, ratio, 16, cand.int())
    assert "shape" in ops.refusal("indexer_topk", "triton", q, keys[:, :16], w, pos, ratio, 16, cand)


def test_score_tiles_follow_the_rows_there_are():
    """The scoring kernel's query tile: the full tile for long prompts, at least 16 rows, a power of two, no
    more rows than needed (a decode group's one row per sequence takes 16), smaller while the grid is under
    one program per SM; under exact accumulation always the full tile (a plan that does not follow the call)."""
    full = ix.SCORE_CONFIG
    assert ix.score_config(1, 4096, 1024, 132) == full  # a long prompt: 256 programs
    assert ix.score_config(256, 1, 64, 132)["BLOCK_M"] == 16  # decode rows
    assert ix.score_config(3, 64, 64, 132)["BLOCK_M"] == 16  # three chunk slots against few entries
    assert ix.score_config(8, 128, 2048, 132)["BLOCK_M"] == 64  # 128 programs at 128 rows, 256 at 64
    for b, rows, n in ((1, 1, 1), (7, 33, 300), (2, 1000, 9), (64, 1, 2048)):
        bm = ix.score_config(b, rows, n, 132)["BLOCK_M"]
        assert 16 <= bm <= full["BLOCK_M"] and bm & (bm - 1) == 0
        assert bm == 16 or bm < 2 * rows
    from dsv4.ops.precision import exact_accumulation

    with exact_accumulation(True):
        assert ix.score_config(256, 1, 64, 132) == full


@pytest.mark.parametrize("bm", [16, 32, 64, 128])
def test_indexer_scores_match_reference_at_every_query_tile(bm, monkeypatch):
    """Whatever query tile the rule picks, the scores are the reference's and the top-k the same picks."""
    monkeypatch.setattr(ix, "score_config", lambda *a: {**ix.SCORE_CONFIG, "BLOCK_M": bm, "num_warps": 4})
    b, s, h, d, n, ratio = 2, 37, 3, 32, 23, 2
    q, k, w = (x.to(DEV) for x in indexer_inputs(b, s, h, d, n, torch.float32, seed=6))
    pos = torch.arange(s, device=DEV) + 5
    sc = ops.indexer_scores(q, k, w, pos, ratio, backend="triton")
    want = ref.indexer_scores(q, k, w, pos, ratio)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(sc)) and rel(sc[fin], want[fin]) < tol(torch.float32)[0]
    assert torch.equal(
        ops.indexer_topk(q, k, w, pos, ratio, 7, backend="triton"), ref.indexer_topk(q, k, w, pos, ratio, 7)
    )


def test_indexer_scores_canary():
    """Scores written into a view of a NaN-filled buffer leave the surroundings untouched (docs/bugzoo.md Z12)."""
    b, s, h, d, n = 2, 11, 2, 32, 19
    q, k, w = (x.to(DEV) for x in indexer_inputs(b, s, h, d, n, torch.float32))
    pos = torch.arange(s, device=DEV) * 3
    buf = torch.full((b, s + 5, n), float("nan"), device=DEV)
    view = buf[:, 2 : 2 + s]
    ix._scores_rows(q, k, w, pos, 4, 0, s, out=view)
    assert buf[:, :2].isnan().all() and buf[:, 2 + s :].isnan().all()
    assert not view.isnan().any()
    want = ref.indexer_scores(q, k, w, pos, 4)
    assert torch.equal(torch.isfinite(view), torch.isfinite(want))


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_forward_trims_invalid_key_blocks_exactly(splits, monkeypatch):
    """TRIM runs only the key blocks from the first to the last holding a valid key: a block of -1 keys
    changes no running value, so the outputs equal the untrimmed kernel's bit for bit, and the reference's
    within the bf16 bound. Valid keys at the end (a window's early positions), at the start (unselected
    compressed keys), in one middle block only, and none at all."""
    b, s, h, d, n, k = 1, 4, 16, 64, 40, 96
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, s, h, d, generator=g).to(DEV, torch.bfloat16)
    kv = torch.randn(b, n, d, generator=g).to(DEV, torch.bfloat16)
    sink = torch.randn(h, generator=g).to(DEV)
    idx = torch.full((b, s, k), -1, dtype=torch.int64)
    idx[0, 0, 70:] = torch.arange(26)  # the last blocks only
    idx[0, 1, :20] = torch.arange(5, 25)  # the first block only
    idx[0, 2, 40:45] = torch.tensor([1, 3, 5, 7, 9])  # one block in the middle
    idx = idx.to(DEV)  # query 3: no key at all (o = 0, lse = sink)
    scale = d**-0.5
    outs = {}
    for trim in (False, True):
        for cfg in (sa.FWD_CONFIG, sa.FWD_CONFIG_NARROW, sa.DECODE_CONFIG, sa.DECODE_CONFIG_NARROW):
            monkeypatch.setitem(cfg, "TRIM", trim)
        outs[trim] = sa.sparse_attention_fwd(q, kv, sink, idx, scale, splits)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    o_ref, lse_ref = ref.sparse_attention(q.float(), kv.float(), sink, idx, scale)
    assert rel(outs[True][0][:, :3], o_ref[:, :3]) < tol(torch.bfloat16)[0]
    assert torch.equal(outs[True][0][0, 3].float(), torch.zeros(h, d, device=DEV))
    assert torch.equal(outs[True][1][0, 3], sink.float())
    # lse: each score is an fp32 sum of d exact bf16 products on both sides (each off by <= d u sum|q k|,
    # u = 2^-24), then a sum of <= k + 1 exponentials and its log (<= (k + 2) 2u more) and the fp32 exp /
    # log functions (a few ulps of |lse|)
    u = 2.0**-24
    keys = kv.float()[0][idx[0].clamp_min(0)]  # [s, k, d]
    dots = torch.einsum("shd,skd->shk", q.float()[0].abs(), keys.abs()) * scale  # [s, h, k]
    dots = dots.masked_fill((idx[0] < 0).unsqueeze(1), 0).amax(-1)  # [s, h]
    bound = 2 * d * u * dots + (k + 2) * 2 * u + 8 * u * lse_ref[0].abs()
    assert ((outs[True][1][0, :3] - lse_ref[0, :3]).abs() <= bound[:3]).all()
