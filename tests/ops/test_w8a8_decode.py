"""The split-K W8A8 GEMMs for decode-sized calls (`triton_splitk` of fp8_gemm / fp4_gemm) vs the references.

On the CPU interpreter the block products are exact fp32 products, so kernel and reference differ only in
the fp32 summation order (the bound of test_w8a8_gemm.py). The split count follows the programs a GPU needs,
so the tests check that K really is split, and that the sums repeat bit for bit."""

from __future__ import annotations

import pytest
import torch

import dsv4.ops as ops
from dsv4 import formats
from dsv4.ops import reference as R

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from test_w8a8_gemm import abs_products, within_fp32_sum_bound  # noqa: E402
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)

import dsv4.ops.triton.w8a8_decode as wd  # noqa: E402


def recorded_splits(monkeypatch, sms: int, row_tile: int = 0, programs: int = 2) -> list[int]:
    """The split counts of the split-K launches (dense and grouped), recorded as they run, with `sms` SMs,
    MXFP4 row tiles of `row_tile` rows and the grouped split aiming at `programs` programs per SM."""
    monkeypatch.setattr(wd, "_sm_count", lambda device: sms)
    monkeypatch.setattr(wd, "FP4_ROW_TILE", row_tile)
    monkeypatch.setattr(wd, "GROUPED_PROGRAMS_PER_SM", programs)
    splits, launch = [], wd._launch
    split_axis = {wd._w8a8_splitk_kernel: 1, wd._w8a8_gmm_splitk_kernel: 2}  # (their grids' split dimension)

    def record(kernel, grid, *a, **kw):
        if kernel in split_axis:
            splits.append(grid[split_axis[kernel]])
        launch(kernel, grid, *a, **kw)

    monkeypatch.setattr(wd, "_launch", record)
    return splits


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_split_k_fp8_gemm_matches_reference(rows, scale_fmt, out_dtype):
    g = torch.Generator().manual_seed(rows)
    n, k = 72, 640  # five K blocks; N not a multiple of the column tile
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k)
    wq, ws = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    x = torch.randn(rows, k, generator=g) * torch.logspace(0, -2, k)
    q, s = R.act_quant(x, 128, pow2=scale_fmt == "ue8m0")
    splits, per = wd.splits_for(rows, n, k, 16, 32, wd._sm_count(q.device))
    assert splits > 1 and (splits - 1) * per < 5 <= splits * per  # K is split, no split empty
    got = ops.fp8_gemm(q, s, wq, ws, out_dtype, backend="triton_splitk")
    assert ops.last_backend("fp8_gemm") == "triton_splitk" and got.shape == (rows, n) and got.dtype == out_dtype
    want = R.fp8_gemm(q, s, wq, ws, out_dtype)
    assert within_fp32_sum_bound(got, want, abs_products(q, s, formats.dequantize_fp8(wq, ws)), k, out_dtype)
    assert torch.equal(got, ops.fp8_gemm(q, s, wq, ws, out_dtype, backend="triton_splitk"))  # repeats


def test_split_k_reads_each_block_scale_and_every_split():
    """Unit activations read the weight back: each element times its own block scale, whichever split
    holds its K block (a split skipped, summed twice or given another's scale would show)."""
    n, k = 64, 512
    codes = torch.randint(0, 126, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    wq = formats.fp8_from_bytes(codes)
    ws = formats.e8m0_from_bytes(torch.tensor([[120, 127, 131, 118]], dtype=torch.uint8))
    cols = [0, 127, 128, 200, 255, 256, 300, 383, 384, 400, 450, 511, 1, 130, 260, 390]  # every K block
    x = torch.zeros(len(cols), k)
    x[torch.arange(len(cols)), cols] = 1.0
    q, s = R.act_quant(x, 128, True)
    assert wd.splits_for(len(cols), n, k, 16, 32, wd._sm_count(q.device)) == (4, 1)  # a split per K block
    got = ops.fp8_gemm(q, s, wq, ws, torch.float32, backend="triton_splitk")
    assert torch.equal(got, R.fp8_gemm(q, s, wq, ws, torch.float32))  # one non-zero product each
    assert torch.equal(got, formats.dequantize_fp8(wq, ws)[:, cols].t())  # (a unit is 256 x 2^-8 exactly)


@pytest.mark.parametrize("rows", [1, 5])
def test_split_k_fp4_gemm_matches_reference(rows):
    g = torch.Generator().manual_seed(2)
    n, k = 96, 384
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)
    wp, ws = formats.quantize_mxfp4(w)
    q, s = R.act_quant(torch.randn(rows, k, generator=g), 128, True)
    got = ops.fp4_gemm(q, s, wp, ws, torch.float32, backend="triton_splitk")
    assert ops.last_backend("fp4_gemm") == "triton_splitk"
    want = R.fp4_gemm(q, s, wp, ws, torch.float32)
    assert within_fp32_sum_bound(got, want, abs_products(q, s, formats.dequantize_mxfp4(wp, ws)), k, torch.float32)


def test_each_e2m1_byte_becomes_the_e4m3_bytes_of_its_values_times_2_to_the_minus_6():
    """The split-K FP4 path's decode (`e2m1_pair_as_e4m3`, bit moves only) against the format's own
    values, for all 256 bytes: low nibble first, sign included, 0.5 on E4M3's subnormals."""
    import triton
    import triton.language as tl

    @triton.jit
    def pairs(p_ptr, lo_ptr, hi_ptr):
        i = tl.arange(0, 256)
        lo, hi = wd.e2m1_pair_as_e4m3(tl.load(p_ptr + i))
        tl.store(lo_ptr + i, lo)
        tl.store(hi_ptr + i, hi)

    p = torch.arange(256, dtype=torch.int32)
    lo, hi = torch.empty_like(p), torch.empty_like(p)
    pairs[(1,)](p, lo, hi)
    assert int(lo.min()) >= 0 and int(max(lo.max(), hi.max())) <= 255
    as_fp8 = lambda b: b.to(torch.uint8).view(torch.float8_e4m3fn).float()  # noqa: E731
    want_lo, want_hi = formats.e2m1_decode(p & 15) / 64, formats.e2m1_decode(p >> 4) / 64
    assert torch.equal(as_fp8(lo), want_lo) and torch.equal(as_fp8(hi), want_hi)
    assert torch.equal(as_fp8(lo).signbit(), (p & 8) > 0)  # -0 too: the sign moves with the bits


def test_split_k_fp4_expert_rows_do_not_depend_on_the_batch_under_exact_accumulation(monkeypatch):
    """Deterministic mode's promise for the MXFP4 experts' row tiles: a token's output is the same bits alone
    or in a step of 14 tokens. Outside exact accumulation the K split count follows the step's row tiles
    (so the sums' grouping may change with the batch); under it the split is the same for every batch."""
    from test_w8a8_gemm import _experts

    from dsv4.ops.precision import exact_accumulation

    splits = recorded_splits(monkeypatch, sms=64, row_tile=4)
    g = torch.Generator().manual_seed(21)
    t, k_top, d, inter = 14, 2, 256, 512
    ws = _experts("fp4", 5, inter, d, g)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(9, generator=g)[:k_top] for _ in range(t)])
    wts = torch.rand(t, k_top, generator=g) + 0.1
    rest = (*ws["w1"], *ws["w2"], *ws["w3"], 4.0, 2, "fp4", "ue8m0")

    def run(rows: slice) -> torch.Tensor:
        return ops.quantized_moe_experts(x[rows], wts[rows], idx[rows], *rest, backend="triton_splitk")

    run(slice(0, t)), run(slice(3, 4))
    assert splits[:3] != splits[3:]  # the batch changes the split outside exact accumulation
    splits.clear()
    with exact_accumulation():
        full, one = run(slice(0, t)), run(slice(3, 4))
    assert splits[:3] == splits[3:]
    assert torch.equal(full[3], one[0])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_split_k_dense_rows_do_not_depend_on_the_batch_under_exact_accumulation(fmt, monkeypatch):
    """The dense split-K GEMMs under exact accumulation: a row's result is the same bits alone or among 40
    rows (the K split no longer follows the batch; outside exact accumulation it does)."""
    from dsv4.ops.precision import exact_accumulation

    splits = recorded_splits(monkeypatch, sms=8)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 1024, generator=g)
    wq, ws = formats.quantize_fp8(w) if fmt == "fp8" else formats.quantize_mxfp4(w)
    q, s = R.act_quant(torch.randn(40, 1024, generator=g), 128, True)
    gemm = ops.fp8_gemm if fmt == "fp8" else ops.fp4_gemm

    def run(rows: slice) -> torch.Tensor:
        return gemm(q[rows], s[rows], wq, ws, torch.float32, backend="triton_splitk")

    run(slice(0, 40)), run(slice(7, 8))
    assert splits[0] != splits[1]
    splits.clear()
    with exact_accumulation():
        full, one = run(slice(0, 40)), run(slice(7, 8))
    assert splits[0] == splits[1] and torch.equal(full[7], one[0])


def test_split_k_is_the_default_for_deep_fp8_gemms_at_decode_sizes_only():
    """With no backend named, an FP8 GEMM runs the split-K kernel where it was measured faster (at most
    MAX_ROWS rows, K >= FP8_SPLITK_MIN_K, N >= FP8_SPLITK_MIN_N) and the dense kernel elsewhere, and
    everywhere under exact accumulation (a row's sums must not follow its step's size); MXFP4 GEMMs keep
    the dense kernel; more than MAX_ROWS rows are refused by name."""
    from dsv4.ops.precision import exact_accumulation

    g = torch.Generator().manual_seed(3)
    k, n = wd.FP8_SPLITK_MIN_K, wd.FP8_SPLITK_MIN_N
    deep = formats.quantize_fp8(torch.randn(n, k, generator=g))
    shallow = formats.quantize_fp8(torch.randn(n, k // 2, generator=g))
    narrow = formats.quantize_fp8(torch.randn(n // 2, k, generator=g))
    q, s = R.act_quant(torch.randn(wd.MAX_ROWS + 1, k, generator=g), 128, True)

    def chosen(rows: int, w, exact: bool = False) -> str:
        kk = w[0].size(1)
        with exact_accumulation(exact):
            return ops.resolve("fp8_gemm", None, q[:rows, :kk], s[:rows, : kk // 128], *w, torch.float32).name

    assert chosen(1, deep) == chosen(wd.MAX_ROWS, deep) == "triton_splitk"
    assert chosen(wd.MAX_ROWS + 1, deep) == "triton"
    assert chosen(1, shallow) == chosen(1, narrow) == "triton"
    assert chosen(1, deep, exact=True) == chosen(wd.MAX_ROWS, deep, exact=True) == "triton"
    with pytest.raises(ops.BackendUnavailable, match="decode-sized"):
        ops.fp8_gemm(q, s, *deep, torch.float32, backend="triton_splitk")
    w4 = formats.quantize_mxfp4(torch.randn(n, k, generator=g))
    assert ops.resolve("fp4_gemm", None, q[:1], s[:1], *w4, torch.float32).name == "triton"


@pytest.mark.parametrize(
    "fmt,t,row_tile", [("fp8", 1, 0), ("fp4", 5, 0), ("fp4", 5, 4), ("fp4", 14, 2), ("fp4", 14, 1)]
)
def test_split_k_grouped_experts_match_the_grouped_kernel_and_the_reference(fmt, t, row_tile, monkeypatch):
    """Decode-sized grouped W8A8 experts with K split in all three GEMMs (a GPU's SM count, so that the
    interpreter's shapes split): a rank holding experts 2..6 of 9 (foreign slots zero); the grouped
    kernel's bound against the reference, and repeats bit for bit. MXFP4 both ways: tensor-core tiles
    (row_tile 0) and row tiles on the CUDA cores (`_fp4_rows_sum`; at 14 tokens experts span several)."""
    from test_w8a8_gemm import _experts

    splits = recorded_splits(monkeypatch, sms=512, row_tile=row_tile)

    g = torch.Generator().manual_seed(10 + t)
    k_top, e, offset, d, inter = 2, 5, 2, 256, 256
    ws = _experts(fmt, e, inter, d, g)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(9, generator=g)[:k_top] for _ in range(t)])
    if t > 1:
        idx[0] = torch.tensor([0, 8])  # a token routed only to foreign experts
    wts = torch.rand(t, k_top, generator=g) + 0.1
    args = (x, wts, idx, *ws["w1"], *ws["w2"], *ws["w3"], 4.0, offset, fmt, "ue8m0")
    got = ops.quantized_moe_experts(*args, backend="triton_splitk")
    assert ops.last_backend("quantized_moe_experts") == "triton_splitk"
    assert len(splits) == 3 and min(splits) > 1  # gate, up, down: each split along K
    want = R.quantized_moe_experts(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, err
    if t > 1:
        assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(want[0], got[0])
    assert torch.equal(got, ops.quantized_moe_experts(*args, backend="triton_splitk"))
    big = torch.randn(wd.MAX_ROWS + 1, d, generator=g)
    bidx = torch.zeros(wd.MAX_ROWS + 1, k_top, dtype=torch.long)
    with pytest.raises(ops.BackendUnavailable, match="decode-sized"):
        ops.quantized_moe_experts(
            big, torch.ones_like(bidx, dtype=torch.float32), bidx, *args[3:], backend="triton_splitk"
        )


def test_mxfp4_experts_run_split_k_by_default_at_decode_sizes_only():
    """With no backend named, MXFP4 experts of at most MAX_ROWS tokens run the split-K kernel (the measured
    faster one); FP8 experts, MXFP4 experts of more tokens and any under exact accumulation (deterministic
    mode: a row's sums must not follow its step's size) the dense grouped kernel."""
    from test_w8a8_gemm import _experts

    from dsv4.ops.precision import exact_accumulation

    g = torch.Generator().manual_seed(3)
    k_top, e, d, inter = 2, 4, 256, 256
    for fmt, t, exact, want in [
        ("fp4", 1, False, "triton_splitk"),
        ("fp4", wd.MAX_ROWS, False, "triton_splitk"),
        ("fp4", wd.MAX_ROWS + 1, False, "triton"),
        ("fp8", 1, False, "triton"),
        ("fp4", 1, True, "triton"),
    ]:
        ws = _experts(fmt, e, inter, d, g)
        x = torch.randn(t, d, generator=g)
        idx = torch.stack([torch.randperm(e, generator=g)[:k_top] for _ in range(t)])
        args = (x, torch.rand(t, k_top, generator=g), idx, *ws["w1"], *ws["w2"], *ws["w3"], 4.0, 0, fmt, "ue8m0")
        with exact_accumulation(exact):
            assert ops.resolve("quantized_moe_experts", None, *args).name == want, (fmt, t, exact)
