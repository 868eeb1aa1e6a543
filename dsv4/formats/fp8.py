"""FP8 E4M3 (e4m3fn) weights with 128x128 block scales.

Byte layout: sign (1) | exponent (4, bias 7) | mantissa (3). No infinities; 0x7F/0xFF are NaN; the
largest finite value is 448. A weight [out, in] has a scale [ceil(out/128), ceil(in/128)]; element
(i, j) dequantizes to e4m3(q[i, j]) * scale[i // 128, j // 128]. The last block row/column may be
partial (ragged edges). Scales are E8M0 bytes (the release) or fp32 values.
"""

from __future__ import annotations

import functools

import torch

from .e8m0 import HAS_E8M0, as_e8m0_bytes, e8m0_decode, e8m0_encode, raw_bytes

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
FP8_MAX = 448.0
FP8_BLOCK = 128
_NAN_BYTE = 0x7F


def _use_native(native: bool | None) -> bool:
    if native is None:
        return HAS_FP8
    if native and not HAS_FP8:
        raise RuntimeError("this torch has no float8_e4m3fn dtype; use native=False")
    return native


@functools.cache
def _e4m3_table() -> torch.Tensor:
    """fp32 value of every byte 0..255, computed from the bit fields."""
    b = torch.arange(256, dtype=torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = (b & 0x7).double()
    mag = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.exp2((e - 7).double()))
    val = (sign * mag).float()
    val[(b & 0x7F) == _NAN_BYTE] = float("nan")
    return val


@functools.cache
def _e4m3_midpoints() -> tuple[torch.Tensor, torch.Tensor]:
    pos = _e4m3_table()[:_NAN_BYTE].double()  # 0 .. 448, increasing, codes 0..126
    return pos, (pos[1:] + pos[:-1]) / 2


def as_fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 E4M3 tensor (uint8/int8/float8_e4m3fn) as uint8."""
    return raw_bytes(t, "float8_e4m3fn", "an FP8 E4M3 tensor must be float8_e4m3fn or raw bytes, got {dtype}")


def fp8_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> a float8_e4m3fn view where torch has that dtype, else the bytes."""
    b = as_fp8_bytes(b)
    return b.view(torch.float8_e4m3fn) if HAS_FP8 else b


def e4m3_decode(t: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """E4M3 bytes (or float8_e4m3fn) -> fp32."""
    b = as_fp8_bytes(t)
    if _use_native(native):
        return b.view(torch.float8_e4m3fn).float()
    return _e4m3_table().to(b.device)[b.long()]


def e4m3_encode(x: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """fp32 -> E4M3 bytes (uint8): clamp to +-448 (+-inf included), then round to nearest, ties to even;
    NaN -> the NaN byte (sign kept).

    The clamp comes first, as in the official quantizers, so the bytes never depend on what a torch
    version's `float8_e4m3fn` cast does with values beyond 448 (some saturate, some give NaN): the native
    cast and the byte-level path below produce the same bytes on every torch.
    """
    xf = x.detach().float().clamp(-FP8_MAX, FP8_MAX)  # NaN stays NaN
    if _use_native(native):
        return xf.to(torch.float8_e4m3fn).view(torch.uint8)
    pos, mid = _e4m3_midpoints()
    pos, mid = pos.to(xf.device), mid.to(xf.device)
    a = xf.abs().double()
    code = torch.searchsorted(mid, a)  # a == mid[k] -> k (lower neighbour)
    tie = (code < mid.numel()) & (a == mid[code.clamp(max=mid.numel() - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ties go to the even code
    code = torch.where(torch.isnan(a), torch.full_like(code, _NAN_BYTE), code)
    sign = torch.signbit(xf).long() << 7
    return (code | sign).to(torch.uint8)


def fp8_scale_shape(out_features: int, in_features: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return (-(-out_features // block), -(-in_features // block))


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as fp32 values: E8M0 bytes are decoded bit-exactly, float scales used as they are."""
    if scale.dtype in (torch.uint8, torch.int8) or (HAS_E8M0 and scale.dtype == torch.float8_e8m0fnu):
        return e8m0_decode(scale)
    if scale.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return scale.float()
    raise TypeError(f"a block scale must be E8M0 bytes or a float tensor, got {scale.dtype}")


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[ceil(o/bo), ceil(i/bi)] -> [o, i] by repeating each entry over its block (ragged edges cut)."""
    o, i = shape
    return scale.repeat_interleave(block[0], 0)[:o].repeat_interleave(block[1], 1)[:, :i]


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: int = FP8_BLOCK,
    native: bool | None = None,
) -> torch.Tensor:
    """q [out, in] E4M3 + scale [ceil(out/128), ceil(in/128)] -> [out, in] in `dtype`."""
    if q.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D [out, in], got shape {tuple(q.shape)}")
    want = fp8_scale_shape(q.size(0), q.size(1), block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 block scale shape {tuple(scale.shape)} does not match weight "
            f"{tuple(q.shape)}: "
            f"expected {want} (one scale per {block}x{block} block)"
        )
    s = _scale_values(scale).to(q.device)
    v = e4m3_decode(q, native)
    o, i = q.shape
    if o % block == 0 and i % block == 0:  # broadcast per block
        return (v.view(o // block, block, i // block, block) * s[:, None, :, None]).view(o, i).to(dtype)
    return (v * expand_blocks(s, (o, i), (block, block))).to(dtype)  # ragged edges


def quantize_fp8(
    w: torch.Tensor, block: int = FP8_BLOCK, scale_fmt: str = "ue8m0", native: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q [out, in] E4M3, scale [ceil(out/128), ceil(in/128)]).

    scale_fmt "ue8m0": power-of-two scales as E8M0 (float8_e8m0fnu view where available, else uint8);
    "fp32": scale = amax / 448 in fp32. Exact on weights that are E4M3 values times a power-of-two
    block scale. q is float8_e4m3fn where available, else uint8 bytes.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 quantization needs a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32', got {scale_fmt!r}")
    o, i = w.shape
    so, si = fp8_scale_shape(o, i, block)
    wf = w.detach().float()
    padded = torch.zeros(so * block, si * block, dtype=torch.float32, device=w.device)
    padded[:o, :i] = wf
    amax = padded.view(so, block, si, block).abs().amax(dim=(1, 3))  # [so, si]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a weight with non-finite values to FP8")
    if scale_fmt == "ue8m0":
        sbytes = e8m0_encode(amax / FP8_MAX, "ceil")
        svals = e8m0_decode(sbytes)
        scale = sbytes.view(torch.float8_e8m0fnu) if HAS_E8M0 else sbytes
    else:
        svals = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale = svals
    s = expand_blocks(svals, (o, i), (block, block))
    q = e4m3_encode((wf / s).clamp(-FP8_MAX, FP8_MAX), native)
    return (q.view(torch.float8_e4m3fn) if HAS_FP8 else q), scale


__all__ = [
    "HAS_FP8",
    "FP8_MAX",
    "FP8_BLOCK",
    "as_fp8_bytes",
    "fp8_from_bytes",
    "e4m3_decode",
    "e4m3_encode",
    "fp8_scale_shape",
    "expand_blocks",
    "dequantize_fp8",
    "quantize_fp8",
    "as_e8m0_bytes",
]
