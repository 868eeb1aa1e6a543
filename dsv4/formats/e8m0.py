"""E8M0 (UE8M0): an unsigned 8-bit exponent. Byte b means 2^(b - 127); byte 255 is NaN.

Decoding builds the fp32 bit pattern directly (exponent field = b), so it is exact for every byte,
including b = 0 (2^-127, an fp32 subnormal). Never decode with `.to(torch.float32)` on a uint8 tensor:
that reads the byte as the integer b (the bug docs/bugzoo.md Z02 describes).
"""

from __future__ import annotations

import torch

HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")
E8M0_NAN = 255
_RAW = (torch.uint8, torch.int8)


def raw_bytes(t: torch.Tensor, native: str, refusal: str) -> torch.Tensor:
    """t's bytes as uint8, viewed as bits: t is uint8, int8 or torch's dtype named `native` (where this torch
    has it); any other dtype raises TypeError(refusal with {dtype} filled in)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or t.dtype == getattr(torch, native, None):
        return t.view(torch.uint8)
    raise TypeError(refusal.format(dtype=t.dtype))


def as_e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an E8M0 tensor (uint8/int8/float8_e8m0fnu) as uint8, copied as bits."""
    return raw_bytes(
        t,
        "float8_e8m0fnu",
        "an E8M0 scale must be raw bytes (uint8, int8 or float8_e8m0fnu), got "
        "{dtype}; converting float values to E8M0 goes through e8m0_encode",
    )


def e8m0_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> a float8_e8m0fnu view where torch has that dtype, else the uint8 bytes."""
    b = as_e8m0_bytes(b)
    return b.view(torch.float8_e8m0fnu) if HAS_E8M0 else b


def e8m0_decode(t: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 values 2^(b-127) (NaN for 255), bit-exact."""
    b = as_e8m0_bytes(t).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)  # 2^-127 is subnormal in fp32
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_encode(x: torch.Tensor, rounding: str = "exact") -> torch.Tensor:
    """fp32 values -> E8M0 bytes (uint8).

    rounding="exact": every value must be a power of two in [2^-127, 2^127] (NaN -> 255), else ValueError.
    rounding="ceil": positive values round up to the next power of two (zero -> 2^-127); the UE8M0 scale
    rule. Values above 2^127 (and inf/NaN) raise.
    """
    if rounding not in ("exact", "ceil"):
        raise ValueError(f"rounding must be 'exact' or 'ceil', got {rounding!r}")
    xf = x.detach().float().contiguous()
    bits = xf.view(torch.int32)
    sign = bits < 0
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    nan = torch.isnan(xf)
    if rounding == "exact":
        normal_pow2 = (exp > 0) & (exp < 255) & (man == 0)
        sub_min = (exp == 0) & (man == (1 << 22))  # 2^-127
        ok = (~sign & (normal_pow2 | sub_min)) | nan
        if not bool(ok.all()):
            bad = xf[~ok].flatten()[:4].tolist()
            raise ValueError(f"E8M0 can only hold positive powers of two in [2^-127, 2^127]; got {bad}")
        out = torch.where(sub_min, torch.zeros_like(exp), exp)
    else:
        bad = (sign & (xf != 0)) | nan | (exp == 255)
        if bool(bad.any()):
            got = xf[bad].flatten()[:4].tolist()
            raise ValueError(f"E8M0 ceil rounding needs finite values >= 0; got {got}")
        # normal: exponent + 1 if any mantissa bit; subnormal/zero: 2^-127 (byte 0) or 2^-126 (byte 1)
        normal = exp + (man != 0).to(exp.dtype)
        sub = ((exp == 0) & (man > (1 << 22))).to(exp.dtype)
        out = torch.where(exp > 0, normal, sub)
        if bool((out >= 255).any()):
            raise ValueError("E8M0 ceil rounding overflow: a value exceeds 2^127")
    out = torch.where(nan, torch.full_like(out, E8M0_NAN), out)
    return out.to(torch.uint8)
