"""MXFP4: E2M1 codes, two per byte, with one E8M0 scale per 32 consecutive elements of a row.

Code c (0..15): bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Packing: byte i of a row holds element 2i in its LOW nibble and element 2i+1 in its HIGH nibble, so the
bytes 0x21, 0x43 are the codes 1, 2, 3, 4. A weight [out, in] is stored as int8 [out, in/2] (or torch's
float4_e2m1fn_x2, same bytes) with scale [out, in/32] E8M0.
"""

from __future__ import annotations

import functools

import torch

from .e8m0 import HAS_E8M0, e8m0_decode, e8m0_encode, raw_bytes

HAS_FP4 = hasattr(torch, "float4_e2m1fn_x2")
FP4_BLOCK = 32
FP4_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes


def as_packed_bytes(t: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes (int8/uint8/float4_e2m1fn_x2) as uint8, copied as bits."""
    return raw_bytes(t, "float4_e2m1fn_x2", "packed FP4 must be int8, uint8 or float4_e2m1fn_x2, got {dtype}")


def packed_from_bytes(b: torch.Tensor, as_int8: bool = True) -> torch.Tensor:
    """uint8 bytes -> int8 (the release storage) or float4_e2m1fn_x2 (the inference converter's)."""
    b = as_packed_bytes(b)
    if as_int8 or not HAS_FP4:
        return b.view(torch.int8)
    return b.view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] packed -> [..., n] uint8 codes; element 2i = low nibble of byte i, 2i+1 = high nibble."""
    b = as_packed_bytes(packed)
    low = b & 0x0F
    high = b >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes 0..15 -> [..., n/2] int8 (low nibble first)."""
    if codes.size(-1) % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {codes.size(-1)}")
    c = codes.to(torch.uint8)
    if bool((c > 15).any()):
        raise ValueError("FP4 codes must be in 0..15")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


@functools.cache
def _byte_table_cpu() -> torch.Tensor:
    """[256, 2]: the two values of every byte, element 2i (low nibble) first."""
    b = torch.arange(256, dtype=torch.uint8)
    return e2m1_decode(torch.stack([b & 0x0F, b >> 4], dim=-1))


def _byte_table(device: torch.device) -> torch.Tensor:
    return _byte_table_cpu().to(device)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> codes (uint8): nearest magnitude, ties to the even code; sign from the sign bit."""
    xf = x.detach().float()
    if bool(torch.isnan(xf).any()) or bool((xf.abs() > FP4_MAX).any()):
        raise ValueError("E2M1 encoding needs finite values in [-6, 6]")
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=xf.device)
    a = xf.abs()
    mag = torch.searchsorted(mids, a)  # a == mids[k] -> k
    tie = (mag < len(_MIDPOINTS)) & (a == mids[mag.clamp(max=len(_MIDPOINTS) - 1)])
    mag = mag + (tie & (mag % 2 == 1)).long()  # ties go to the even code
    return (mag | (torch.signbit(xf).long() << 3)).to(torch.uint8)


def _check_scale(packed_shape: tuple[int, ...], scale: torch.Tensor, block: int) -> None:
    n = packed_shape[-1] * 2
    want = (*packed_shape[:-1], n // block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match packed weight "
            f"{tuple(packed_shape)}: expected {want} (one scale per {block} elements of a row)"
        )


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP4_BLOCK
) -> torch.Tensor:
    """packed [..., out, in/2] + scale [..., out, in/32] (E8M0) -> [..., out, in]."""
    _check_scale(tuple(packed.shape), scale, block)
    b = as_packed_bytes(packed)
    vals = _byte_table(b.device)[b.long()].flatten(-2)  # [..., out, in]
    s = e8m0_decode(scale).to(vals.device).unsqueeze(-1)  # [..., out, in/32, 1]
    return (vals.unflatten(-1, (-1, block)) * s).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (packed int8 [..., out, in/2], scale [..., out, in/32] E8M0).

    Scale = the power of two at or above amax/6 per block. Exact on values that are E2M1 codes times
    a power-of-two block scale. The scale is float8_e8m0fnu where torch has it, else uint8 bytes.
    """
    n = w.size(-1)
    if n % block:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {block}, got {n}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("cannot quantize a weight with non-finite values to MXFP4")
    blocks = wf.unflatten(-1, (n // block, block))  # [..., nb, 32]
    amax = blocks.abs().amax(-1)  # [..., nb]
    sbytes = e8m0_encode(amax / FP4_MAX, "ceil")
    svals = e8m0_decode(sbytes).unsqueeze(-1)
    codes = e2m1_encode((blocks / svals).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    scale = sbytes.view(torch.float8_e8m0fnu) if HAS_E8M0 else sbytes
    return pack_fp4(codes), scale
