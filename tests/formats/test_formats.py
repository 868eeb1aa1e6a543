"""Bit-exact tests of the checkpoint storage formats (E8M0, FP8 E4M3 block-scaled, MXFP4)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import formats as fm
from dsv4.formats import fp4, fp8

HAS_DTYPES = fm.HAS_E8M0 and fm.HAS_FP8 and fm.HAS_FP4


# ------------------------------------------------------------------------------------------- E8M0
def e8m0_decoder_ok(decode) -> bool:
    """Known bytes -> known values; the check a value-casting decoder (docs/bugzoo.md Z02) fails."""
    b = torch.tensor([127, 0, 1, 128, 254, 120], dtype=torch.uint8)
    want = torch.tensor([1.0, 2.0**-127, 2.0**-126, 2.0, 2.0**127, 2.0**-7], dtype=torch.float32)
    got = decode(b).float()
    nan = decode(torch.tensor([255], dtype=torch.uint8)).float()
    return torch.equal(got, want) and bool(torch.isnan(nan).all())


def test_e8m0_known_bytes():
    assert e8m0_decoder_ok(fm.e8m0_decode)
    assert fm.e8m0_decode(torch.tensor([127], dtype=torch.uint8)).item() == 1.0
    assert fm.e8m0_decode(torch.tensor([0], dtype=torch.uint8)).item() == math.ldexp(1.0, -127)


def test_e8m0_all_bytes_round_trip():
    b = torch.arange(255, dtype=torch.uint8)
    v = fm.e8m0_decode(b)
    assert torch.equal(v, torch.exp2(b.double() - 127).float())
    assert torch.equal(fm.e8m0_encode(v), b)
    assert fm.e8m0_encode(torch.tensor([float("nan")])).item() == 255


@pytest.mark.skipif(not fm.HAS_E8M0, reason="torch has no float8_e8m0fnu")
def test_e8m0_torch_dtype_is_a_bit_view():
    b = torch.arange(256, dtype=torch.uint8)
    t = fm.e8m0_from_bytes(b)
    assert t.dtype == torch.float8_e8m0fnu
    assert torch.equal(fm.as_e8m0_bytes(t), b)
    finite = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(fm.e8m0_decode(finite.view(torch.float8_e8m0fnu)), fm.e8m0_decode(finite))


def test_e8m0_value_cast_mutant_is_caught():
    # docs/bugzoo.md Z02: the scale bytes converted by *value* (uint8 -> float) instead of copied as bits
    assert not e8m0_decoder_ok(lambda b: b.float())
    if fm.HAS_E8M0:
        assert not e8m0_decoder_ok(lambda b: b.to(torch.float8_e8m0fnu).float())
    with pytest.raises(TypeError):
        fm.as_e8m0_bytes(torch.ones(3))  # a float tensor is never reinterpreted


def test_e8m0_encode_rules():
    x = torch.tensor([0.75, 1.0, 1.0001, 0.0, 3e-39])
    assert fm.e8m0_encode(x, "ceil").tolist() == [127, 127, 128, 0, 0]
    with pytest.raises(ValueError):
        fm.e8m0_encode(torch.tensor([3.0]))  # not a power of two
    with pytest.raises(ValueError):
        fm.e8m0_encode(torch.tensor([-2.0]), "ceil")


# ------------------------------------------------------------------------------------------- FP8
def test_e4m3_decode_byte_level_matches_known_values():
    d = fm.e4m3_decode(torch.tensor([0x00, 0x01, 0x08, 0x38, 0x7E, 0xFE, 0x7F, 0x80], dtype=torch.uint8), native=False)
    assert d[:6].tolist() == [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0]
    assert math.isnan(d[6].item()) and d[7].item() == 0.0 and math.copysign(1, d[7].item()) < 0


@pytest.mark.skipif(not fm.HAS_FP8, reason="torch has no float8_e4m3fn")
def test_e4m3_byte_level_equals_torch_dtype():
    b = torch.arange(256, dtype=torch.uint8)
    n, s = fm.e4m3_decode(b, native=True), fm.e4m3_decode(b, native=False)
    assert torch.equal(n.isnan(), s.isnan()) and torch.equal(n[~n.isnan()], s[~s.isnan()])
    vals = s[~s.isnan()].unique()
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties: round half to even
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 10, (20000,), generator=g).float())
    # past 448 (464 is where an unclamped cast would round up to a code that does not exist; torch versions
    # differ there: saturation or NaN): the encoder clamps first, so both paths give +-448 on every torch
    over = torch.tensor([449.0, 463.9, 464.0, 465.0, 500.0, 1e6, 3e38, float("inf")])
    x = torch.cat([vals, mids, rand, over, -over, torch.tensor([float("nan")])])
    assert torch.equal(fm.e4m3_encode(x, native=True), fm.e4m3_encode(x, native=False))
    assert fm.e4m3_decode(fm.e4m3_encode(over), native=False).tolist() == [448.0] * len(over)
    assert fm.e4m3_decode(fm.e4m3_encode(-over), native=False).tolist() == [-448.0] * len(over)


def representable_fp8(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    """E4M3 values times one power of two per 128x128 block (ragged edges)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out, inn), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    v = fm.e4m3_decode(codes, native=False)
    so, si = fm.fp8_scale_shape(out, inn)
    s = torch.exp2(torch.randint(-20, 5, (so, si), generator=g).float())
    return v * fp8.expand_blocks(s, (out, inn), (128, 128))


@pytest.mark.parametrize("native", [False] + ([True] if fm.HAS_FP8 else []))
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_round_trip_exact_with_ragged_blocks(native, scale_fmt):
    w = representable_fp8(200, 300)
    q, s = fm.quantize_fp8(w, scale_fmt=scale_fmt, native=native)
    assert tuple(s.shape) == (2, 3) and tuple(q.shape) == (200, 300)
    assert torch.equal(fm.dequantize_fp8(q, s, native=native), w)
    if scale_fmt == "ue8m0":  # bytes survive a second quantization unchanged
        q2, s2 = fm.quantize_fp8(fm.dequantize_fp8(q, s), native=native)
        assert torch.equal(fm.as_fp8_bytes(q2), fm.as_fp8_bytes(q))
        assert torch.equal(fm.as_e8m0_bytes(s2), fm.as_e8m0_bytes(s))


def test_fp8_quantization_error_is_bounded():
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(1))
    q, s = fm.quantize_fp8(w)
    err = (fm.dequantize_fp8(q, s) - w).abs().max().item()
    assert err <= w.abs().max().item() * 2.0**-3


def test_fp8_transposed_scale_is_rejected():
    # docs/bugzoo.md Z03: a block scale stored transposed (or with a singleton leading dim)
    w = representable_fp8(256, 384)
    q, s = fm.quantize_fp8(w)
    for bad in (s.view(torch.uint8).t().contiguous(), s.view(torch.uint8).reshape(1, -1)):
        with pytest.raises(ValueError, match="expected"):
            fm.dequantize_fp8(q, bad)


# ------------------------------------------------------------------------------------------- MXFP4
def fp4_unpacker_ok(unpack) -> bool:
    """Known bytes 0x21, 0x43 -> codes 1, 2, 3, 4 (the check docs/bugzoo.md Z01 fails)."""
    b = torch.tensor([[0x21, 0x43], [0x0F, 0xF0]], dtype=torch.uint8).view(torch.int8)
    return unpack(b).tolist() == [[1, 2, 3, 4], [15, 0, 0, 15]]


def test_fp4_known_bytes():
    assert fp4_unpacker_ok(fm.unpack_fp4)
    codes = fm.unpack_fp4(torch.tensor([0x21, 0x43], dtype=torch.uint8).view(torch.int8))
    assert fm.e2m1_decode(codes).tolist() == [0.5, 1.0, 1.5, 2.0]
    assert fm.e2m1_decode(torch.arange(16)).tolist() == list(fm.FP4_VALUES)
    assert fm.pack_fp4(torch.tensor([1, 2, 3, 4])).view(torch.uint8).tolist() == [0x21, 0x43]
    one = fm.e8m0_from_bytes(torch.tensor([[127]], dtype=torch.uint8))
    packed = torch.tensor([[0x21, 0x43] + [0x9F] * 14], dtype=torch.uint8).view(torch.int8)
    assert fm.dequantize_mxfp4(packed, one)[0, :6].tolist() == [0.5, 1.0, 1.5, 2.0, -6.0, -0.5]


def test_fp4_dequantize_agrees_with_unpack_for_every_byte():
    b = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scale = fm.e8m0_from_bytes(torch.full((8, 2), 127, dtype=torch.uint8))
    assert torch.equal(fm.dequantize_mxfp4(b, scale), fm.e2m1_decode(fm.unpack_fp4(b)))


def test_fp4_planar_unpack_mutant_is_caught():
    # docs/bugzoo.md Z01: all low nibbles first, then all high nibbles, instead of interleaved per byte
    def planar(p):
        b = p.view(torch.uint8)
        return torch.cat([b & 0x0F, b >> 4], dim=-1)

    assert not fp4_unpacker_ok(planar)
    w = fm.e2m1_decode(torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0)))
    packed, scale = fm.quantize_mxfp4(w)
    mutant = fm.e2m1_decode(planar(packed)) * fm.e8m0_decode(scale).repeat_interleave(32, -1)
    assert not torch.equal(mutant, w)
    assert torch.equal(fm.dequantize_mxfp4(packed, scale), w)


def test_fp4_pack_unpack_inverse_all_bytes():
    b = torch.arange(256, dtype=torch.uint8).view(1, 256)
    assert torch.equal(fm.pack_fp4(fm.unpack_fp4(b)).view(torch.uint8), b)


def test_e2m1_encode_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.0, 6.0])
    assert fm.e2m1_decode(fm.e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.0, 6.0]


def test_mxfp4_round_trip_exact_on_representable_values():
    g = torch.Generator().manual_seed(3)
    vals = fm.e2m1_decode(torch.randint(0, 16, (3, 48, 128), generator=g))  # stacked experts
    scale = torch.exp2(torch.randint(-30, 8, (3, 48, 4), generator=g).float())
    w = vals * scale.repeat_interleave(32, -1)
    packed, s = fm.quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (3, 48, 64) and tuple(s.shape) == (3, 48, 4)
    assert torch.equal(fm.dequantize_mxfp4(packed, s), w)
    with pytest.raises(ValueError, match="expected"):
        fm.dequantize_mxfp4(packed, s.view(torch.uint8).transpose(-1, -2))


@pytest.mark.skipif(not fm.HAS_FP4, reason="torch has no float4_e2m1fn_x2")
def test_fp4_torch_dtype_is_the_same_bytes():
    packed, s = fm.quantize_mxfp4(torch.randn(8, 64))
    f4 = fm.packed_from_bytes(packed, as_int8=False)
    assert f4.dtype == torch.float4_e2m1fn_x2
    assert torch.equal(fm.dequantize_mxfp4(f4, s), fm.dequantize_mxfp4(packed, s))
    assert torch.equal(fm.as_packed_bytes(f4), packed.view(torch.uint8))


def test_formats_run_on_plain_bytes():
    # the byte-level paths need no float8/float4 dtypes: only uint8/int8 in, fp32 out
    w = representable_fp8(130, 140)
    q, s = fp8.quantize_fp8(w, native=False)
    qb, sb = fm.as_fp8_bytes(q).clone(), fm.as_e8m0_bytes(s).clone()
    assert qb.dtype == sb.dtype == torch.uint8
    assert torch.equal(fp8.dequantize_fp8(qb, sb, native=False), w)
    packed, s4 = fp4.quantize_mxfp4(torch.randn(4, 64))
    assert torch.equal(
        fm.dequantize_mxfp4(packed.view(torch.uint8), fm.as_e8m0_bytes(s4)), fm.dequantize_mxfp4(packed, s4)
    )
