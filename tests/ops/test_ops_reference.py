"""Each primitive against hand-computed or independently derived expectations."""

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4 import ops
from dsv4.config import ModelConfig
from dsv4.model.attention import Attention, Compressor
from dsv4.model.moe import Gate
from dsv4.model.rope import Rope, apply_rope_tail
from dsv4.ops import reference as ref


def test_dispatch_records_and_refuses_unknown_backend():
    ops.reset_calls()
    ops.hadamard(torch.randn(2, 8))
    assert ops.calls()[("hadamard", "reference")] == 1 and ops.last_backend("hadamard") == "reference"
    with pytest.raises(ops.BackendUnavailable, match="no backend 'nope'"):
        ops.hadamard(torch.randn(2, 8), backend="nope")
    with ops.use_backend({"hadamard": "nope"}), pytest.raises(ops.BackendUnavailable):
        ops.hadamard(torch.randn(2, 8))


def test_window_visibility():
    attn = Attention(ModelConfig.preset("tiny"), 0)
    idx = attn._window_idx(300, "cpu")
    for t in (0, 5, 127, 128, 200, 299):
        assert set(idx[t][idx[t] >= 0].tolist()) == set(range(max(0, t - 127), t + 1))
    assert attn._window_idx(10, "cpu").shape == (10, 10)


def test_compressed_entry_visibility():
    vis = ref.compressed_visible(torch.arange(12), 3, 4)
    for t in range(12):
        for j in range(3):
            assert bool(vis[t, j]) == (j < (t + 1) // 4)
    assert not vis[2].any() and vis[3, 0] and not vis[3, 1]


def test_overlap_pooling_by_hand():
    cfg = ModelConfig.preset("tiny")
    comp = Compressor(cfg, 4, 8, Rope(cfg, True), rotate=False)
    g, r, c = 3, 4, 8
    kv, score = torch.randn(1, g, r, 2 * c), torch.randn(1, g, r, 2 * c)
    out = comp.pool(kv, score)
    for gi in range(g):
        for ch in range(c):
            vals = [kv[0, gi, s, c + ch] for s in range(r)]
            scs = [score[0, gi, s, c + ch] for s in range(r)]
            if gi > 0:  # previous group's first-half channels join as r more slots
                vals = [kv[0, gi - 1, s, ch] for s in range(r)] + vals
                scs = [score[0, gi - 1, s, ch] for s in range(r)] + scs
            w = torch.softmax(torch.stack(scs), 0)
            assert torch.allclose(out[0, gi, ch], (w * torch.stack(vals)).sum(), atol=1e-6)


def test_non_overlap_pooling_is_group_softmax():
    kv, score = torch.randn(2, 3, 128, 16), torch.randn(2, 3, 128, 16)
    expected = (kv * torch.softmax(score, dim=2)).sum(2)
    assert torch.allclose(ops.compress_pool(kv, score), expected, atol=1e-6)


def pool_group_inputs(T=7, R=9, G=5, r=4, coff=2, c=6, seed=0):
    """Random rows and indices for `pool_groups`: slots from this step's rows, from the ring, and ring row 1
    holding an empty slot (kv 0, score -inf) as the paged cache keeps it."""
    g = torch.Generator().manual_seed(seed)
    W, n = coff * c, coff * r
    kv, score = torch.randn(T, W, generator=g), torch.randn(T, W, generator=g) * 2
    ring_kv, ring_score = torch.randn(R, W, generator=g), torch.randn(R, W, generator=g) * 2
    ring_kv[1], ring_score[1] = 0.0, float("-inf")
    new = torch.randint(0, T, (G, n), generator=g)
    new[torch.rand(G, n, generator=g) < 0.4] = -1
    new[0] = -1  # a group wholly from the ring
    new[1] = torch.arange(n) % T  # wholly from this step
    ring = torch.randint(1, R, (G, n), generator=g)
    ring[0, : r if coff == 2 else 1] = 1  # empty slots (coff 2: the "group before the first one")
    live = torch.rand(G, generator=g) < 0.6
    live[:2] = True
    return kv, score, ring_kv, ring_score, new, ring, live


@pytest.mark.parametrize("coff,r,c", [(2, 4, 6), (1, 8, 5)])
def test_pool_groups_gathers_each_slot_by_hand(coff, r, c):
    """Slot i of group g is row new[g, i] of this step's rows or, where that is -1, ring row ring[g, i],
    at channel block i // r; the group is compress_pool of those slots, and 0 where it is not live."""
    kv, score, ring_kv, ring_score, new, ring, live = pool_group_inputs(r=r, coff=coff, c=c)
    G, n = new.shape
    got = ops.pool_groups(kv, score, ring_kv, ring_score, new, ring, live, coff)
    assert got.shape == (G, c) and ops.last_backend("pool_groups") == "reference"
    for gi in range(G):
        rows_kv, rows_sc = [], []
        for i in range(n):
            src_kv, src_sc, row = (kv, score, new[gi, i]) if new[gi, i] >= 0 else (ring_kv, ring_score, ring[gi, i])
            blk = i // r
            rows_kv.append(src_kv[row, blk * c : (blk + 1) * c])
            rows_sc.append(src_sc[row, blk * c : (blk + 1) * c])
        want = ref.compress_pool(torch.stack(rows_kv), torch.stack(rows_sc)) if live[gi] else torch.zeros(c)
        assert torch.equal(got[gi], want), gi
    assert not got.isnan().any()


def test_sink_joins_denominator_only():
    b, s, h, d, n = 2, 5, 3, 16, 9
    q, kv = torch.randn(b, s, h, d), torch.randn(b, n, d)
    sink = torch.tensor([0.5, -1.0, 3.0])
    idx = torch.randint(0, n, (b, s, 4))
    idx[0, 0] = -1  # a query with no key at all
    idx[1, 2, :2] = -1
    o, lse = ops.sparse_attention(q, kv, sink, idx, 0.25)
    for bi in range(b):
        for si in range(s):
            keys = [int(i) for i in idx[bi, si] if i >= 0]
            for hi in range(h):
                if not keys:
                    assert torch.all(o[bi, si, hi] == 0) and torch.isclose(lse[bi, si, hi], sink[hi])
                    continue
                sc = torch.stack([q[bi, si, hi] @ kv[bi, k] * 0.25 for k in keys])
                no_sink = torch.softmax(sc, 0) @ kv[bi, keys]
                lse_ns = torch.logsumexp(sc, 0)
                assert torch.allclose(o[bi, si, hi], no_sink * torch.sigmoid(lse_ns - sink[hi]), atol=1e-5)
                assert torch.isclose(lse[bi, si, hi], torch.logaddexp(lse_ns, sink[hi]), atol=1e-5)
    assert not lse.requires_grad


def test_sinkhorn_doubly_stochastic_after_20_iterations():
    hc = 4
    mixes = torch.randn(256, (2 + hc) * hc) * 0.5  # moderate spread of the comb logits
    pre, post, comb = ops.hc_split_sinkhorn(mixes, torch.ones(3), torch.randn(24) * 0.5, hc, 20, 1e-6)
    assert (comb.sum(-1) - 1).abs().max() < 1e-5 and (comb.sum(-2) - 1).abs().max() < 1e-5
    assert ((post > 0) & (post < 2)).all() and (pre > 0).all()


def test_hc_pre_post_by_hand():
    b, s, hc, d = 1, 2, 4, 8
    x, f = torch.randn(b, s, hc, d), torch.randn(b, s, d)
    fn, base, scale = torch.randn(24, hc * d), torch.randn(24), torch.rand(3)
    y, post, comb = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    flat = x.flatten(2)
    mixes = flat @ fn.T / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mixes[..., :4] * scale[0] + base[:4]) + 1e-6
    assert torch.allclose(y, (pre.unsqueeze(-1) * x).sum(2), atol=1e-5)
    out = ops.hc_post(f, x, post, comb)
    for j in range(hc):
        want = post[..., j : j + 1] * f + sum(comb[..., i, j : j + 1] * x[:, :, i] for i in range(hc))
        assert torch.allclose(out[:, :, j], want, atol=1e-5)


def _gate(layer_id: int, **cfg_changes) -> Gate:
    cfg = ModelConfig.preset("tiny").replace(**cfg_changes)
    gate = Gate(cfg, layer_id)
    torch.nn.init.normal_(gate.weight)
    if gate.hash:
        gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, gate.tid2eid.shape))
    return gate


def test_hash_routing_uses_tid2eid():
    gate = _gate(0)
    assert gate.hash
    x, tokens = torch.randn(16, 128), torch.randint(0, 1024, (16,))
    weights, indices, scores = gate(x, tokens)
    assert torch.equal(indices, gate.tid2eid[tokens].long())
    w = scores.gather(1, indices)
    assert torch.allclose(weights, w / w.sum(-1, keepdim=True) * 1.5)


def test_route_scale_applied_once_and_bias_selects_only():
    gate = _gate(1)
    assert not gate.hash
    x = torch.randn(32, 128)
    weights, indices, scores = gate(x, torch.zeros(32, dtype=torch.long))
    assert torch.allclose(weights.sum(-1), torch.full((32,), 1.5))
    gate.bias[3] = 100.0  # expert 3 always selected, weights unbiased
    weights, indices, scores = gate(x, torch.zeros(32, dtype=torch.long))
    assert (indices == 3).any(-1).all()
    w = scores.gather(1, indices)
    assert torch.allclose(weights, w / w.sum(-1, keepdim=True) * 1.5)
    softmax_gate = _gate(1, score_func="softmax")
    weights, _, scores = softmax_gate(x, torch.zeros(32, dtype=torch.long))
    assert torch.allclose(weights, scores.gather(1, scores.topk(2).indices) * 1.5)  # not renormalized


def test_swiglu_clamp_beyond_limit():
    d, inter = 4, 3
    w1, w3, w2 = torch.eye(inter, d), torch.eye(inter, d), torch.eye(d, inter)
    x = torch.tensor([[30.0, -30.0, 2.0, 0.0]])
    out = ref.expert_ffn(x, w1, w2, w3, 10.0)
    gate = torch.tensor([10.0, -30.0, 2.0])  # clamped from above only
    up = torch.tensor([10.0, -10.0, 2.0])  # clamped both ways
    assert torch.allclose(out[0, :3], F.silu(gate) * up, atol=1e-5)
    unclamped = ref.expert_ffn(x, w1, w2, w3, 0.0)
    assert unclamped[0, 0] > 29 * 29


def test_moe_experts_equals_dense_sum():
    t, d, inter, e, k = 10, 8, 6, 5, 2
    x = torch.randn(t, d)
    w1, w3, w2 = torch.randn(e, inter, d), torch.randn(e, inter, d), torch.randn(e, d, inter)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    wts = torch.rand(t, k)
    y = ops.moe_experts(x, wts, idx, w1, w2, w3, 10.0)
    for ti in range(t):
        want = sum(ref.expert_ffn(x[ti : ti + 1], w1[j], w2[j], w3[j], 10.0, wts[ti, s]) for s, j in enumerate(idx[ti]))
        assert torch.allclose(y[ti], want[0], atol=1e-4)
    # expert parallel view: only the experts held locally contribute
    part = ops.moe_experts(x, wts, idx, w1[2:4], w2[2:4], w3[2:4], 10.0, expert_offset=2)
    for ti in range(t):
        want = sum(
            ref.expert_ffn(x[ti : ti + 1], w1[j], w2[j], w3[j], 10.0, wts[ti, s])
            for s, j in enumerate(idx[ti])
            if 2 <= j < 4
        )
        assert torch.allclose(part[ti], want[0] if torch.is_tensor(want) else torch.zeros(d), atol=1e-4)


def test_interleaved_rope_and_inverse():
    cfg = ModelConfig.preset("tiny")
    for compressed in (False, True):
        rope = Rope(cfg, compressed)
        x = torch.randn(2, 7, 3, 64)
        pos = torch.arange(100, 107)
        y = rope.apply(x, pos)
        z = torch.view_as_complex(x.unflatten(-1, (32, 2)))
        ang = pos.float()[:, None] * rope.inv_freq
        want = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)
        assert torch.allclose(y, want, atol=1e-4)
        assert torch.allclose(rope.apply(y, pos, inverse=True), x, atol=1e-4)
        full = torch.randn(2, 7, 3, 128)
        out = apply_rope_tail(full, rope, pos)
        assert torch.equal(out[..., :64], full[..., :64])


def test_yarn_frequencies():
    cfg = ModelConfig.preset("flash")
    plain, yarn = Rope(cfg, False).inv_freq, Rope(cfg, True).inv_freq
    base = 1 / (10000 ** (torch.arange(0, 64, 2) / 64))
    assert torch.allclose(plain, base)
    raw = 1 / (160000 ** (torch.arange(0, 64, 2) / 64))
    assert torch.isclose(yarn[0], raw[0])  # fastest dims untouched
    assert torch.isclose(yarn[-1], raw[-1] / 16)  # slowest dims interpolated by the factor


def test_fp8_round_trip_exact_on_representable_values():
    vals = torch.tensor([1.0, -2.0, 0.5, 448.0 / 4, 1.125, 0.0] + [0.25] * 58)
    assert torch.equal(ops.fp8_round_trip(vals, 64), vals)
    x = torch.randn(4, 128)
    y = ops.fp8_round_trip(x, 64)
    assert ((y - x).abs() <= x.abs() * 2**-4 + 1e-6).all() and not torch.equal(x, y)
    x.requires_grad_(True)
    ops.fp8_round_trip(x, 64).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight-through


def test_fp4_rounding_grid_and_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, 6.0, 2.9])
    assert ref.round_to_e2m1(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, 6.0, 3.0]
    block = torch.tensor([6.0, 4.0, -3.0, 0.5] * 8)  # representable with scale 1
    assert torch.equal(ops.fp4_round_trip(block, 32), block)


def _nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """The rule by its definition: the grid value at the smallest distance, the even code among two."""
    grid = torch.tensor(ref.FP4_E2M1_GRID, dtype=torch.float64)
    dist = (v.double().abs().unsqueeze(-1) - grid).abs()  # exact in float64
    tied = dist == dist.amin(-1, keepdim=True)
    code = torch.where(tied, torch.arange(8) % 2, 2).argmin(-1)  # the lowest even code among the nearest
    return torch.copysign(grid[code].float(), v)


def test_fp4_rounding_is_the_nearest_grid_value_at_and_beside_every_tie():
    grid = torch.tensor(ref.FP4_E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, mids])
    beside = torch.cat([torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)]).clamp(0, 6)
    rand = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 6
    tiny = torch.tensor([1e-30, 1e-40, 2.0**-126, 0.0])  # subnormal and the smallest normal round to 0
    v = torch.cat([points, beside, rand, tiny])
    v = torch.cat([v, -v])
    got = ref.round_to_e2m1(v)
    assert torch.equal(got.view(torch.int32), _nearest_e2m1(v).view(torch.int32))  # bit for bit, signed zeros too


def test_hadamard_is_orthonormal():
    x = torch.eye(128)
    h = ops.hadamard(x)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-5)
    assert torch.allclose(h[0], torch.full((128,), 128**-0.5))


def test_indexer_scores_topk_padding_and_ties():
    b, s, h, d, n, ratio = 1, 12, 2, 8, 3, 4
    q, k = torch.randn(b, s, h, d), torch.randn(b, n, d)
    w = torch.randn(b, s, h)
    pos = torch.arange(s)
    sc = ops.indexer_scores(q, k, w, pos, ratio)
    want = torch.einsum("bshd,bnd->bshn", q, k).relu().mul(w.unsqueeze(-1)).sum(2)
    vis = ref.compressed_visible(pos, n, ratio)
    assert torch.allclose(sc[0][vis], want[0][vis], atol=1e-5) and torch.isinf(sc[0][~vis]).all()
    top = ops.indexer_topk(q, k, w, pos, ratio, topk=2)
    assert top.shape == (1, 12, 2)
    assert (top[0, :3] == -1).all()  # nothing visible before token 3
    assert top[0, 3].tolist() == [0, -1]  # one visible entry, one padding slot
    tied = ref.select_topk(torch.tensor([[0.0, 1.0, 0.0, 0.0, float("-inf")]]), 3)
    assert tied.tolist() == [[1, 0, 2]]  # ties go to the lower index


def test_reference_is_differentiable_where_trained():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    kv = torch.randn(1, 5, 8, requires_grad=True)
    sink = torch.zeros(2, requires_grad=True)
    o, _ = ops.sparse_attention(q, kv, sink, torch.tensor([[[0, 1], [2, -1], [3, 4]]]), 1 / math.sqrt(8))
    o.sum().backward()
    assert q.grad.abs().sum() > 0 and kv.grad[0, :5].abs().sum() > 0 and sink.grad.abs().sum() > 0


def _wide_fp32(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())


@pytest.mark.parametrize("n, k", [(50, 96), (300, 40)])  # the input gradient as one GEMM / as six (N >= 2K)
def test_linear_fp32_bf16x3_matches_fp32_forward_and_backward(n, k):
    """bf16 activations times an fp32 weight through the three-way bf16 split: the same products as the
    fp32 matmul (every part exact), so the result agrees to fp32 rounding; so does the split backward."""
    from dsv4.ops.torch_native import CONCAT_MAX_N_PER_K, split_bf16x3

    assert (n < CONCAT_MAX_N_PER_K * k) == (n == 50)  # each of the backward's two forms
    w = _wide_fp32((n, k), 0)
    parts = split_bf16x3(w).float()  # [n, 3k]
    assert torch.equal(parts[:, :k] + parts[:, k : 2 * k] + parts[:, 2 * k :], w)  # the split is exact
    x = _wide_fp32((3, 37, k), 1).to(torch.bfloat16)
    g = _wide_fp32((3, 37, n), 2)  # not bf16-exact: split too
    outs = {}
    for be in ("reference", "bf16x3"):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.linear_fp32(xl, wl, backend=be)
        y.backward(g)
        outs[be] = (y.detach(), xl.grad, wl.grad)
        assert ops.last_backend("linear_fp32") == be
    (y0, gx0, gw0), (y1, gx1, gw1) = outs["reference"], outs["bf16x3"]
    assert y1.dtype == torch.float32 and y1.shape == (3, 37, n)
    # each output is a sum of k exact products: only the summation order differs
    bound = k * 2.0**-24 * (x.float().abs() @ w.abs().t())
    assert ((y1 - y0).abs() <= bound).all()
    # backward: sums of n (dx) and 111 (dw) products, three of nine split terms left out (< 2^-24 each)
    ga = g.abs().reshape(-1, n)
    # dx is bf16: two fp32 sums that close may round to neighbouring bf16 values, one ulp apart (up to 2^-7
    # of the value: 7 stored bits), whatever the summation order
    bound_x = (n + 4) * 2.0**-24 * (ga @ w.abs()).view(gx0.shape) + 2.0**-7 * gx0.float().abs()
    assert ((gx1.float() - gx0.float()).abs() <= bound_x).all()
    bound_w = (111 + 4) * 2.0**-24 * (ga.t() @ x.float().abs().reshape(-1, k))
    assert ((gw1 - gw0).abs() <= bound_w).all()


def test_linear_fp32_bf16x3_refuses_and_is_default_only_on_gpus():
    from dsv4.ops import BackendUnavailable

    w = torch.randn(8, 16)
    with pytest.raises(BackendUnavailable, match="exact only for bf16"):
        ops.linear_fp32(torch.randn(4, 16), w, backend="bf16x3")
    with pytest.raises(BackendUnavailable, match="fp32 matrix"):
        ops.linear_fp32(torch.randn(4, 16, dtype=torch.bfloat16), w.bfloat16(), backend="bf16x3")
    ops.linear_fp32(torch.randn(128, 16, dtype=torch.bfloat16), w)  # CPU: the reference stays default
    assert ops.last_backend("linear_fp32") == "reference"


def test_the_bf16x3_split_is_the_gpu_default_where_it_was_measured_faster():
    """The selection rule (`torch_native.prefers_split`) at the crossovers of `scripts/bench_linear_fp32.py`
    on an H200: a one-row GEMV stays fp32 (it reads fewer bytes); from two rows the split wins for weights
    up to 4096 x 4096; a vocabulary head's weight stays fp32 below 8 rows."""
    from dsv4.ops.torch_native import prefers_split

    head, compressor = 129280 * 4096, 1024 * 4096
    assert not any(prefers_split(1, n) for n in (256 * 256, compressor, head))
    assert all(prefers_split(m, n) for m in (2, 4, 16) for n in (256 * 256, compressor, 4096 * 4096))
    assert not prefers_split(4, head) and all(prefers_split(m, head) for m in (8, 64, 128))
