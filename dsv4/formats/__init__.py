"""Low-precision storage formats of DeepSeek-V4 checkpoints, bit-exact.

- E8M0 (UE8M0): one byte b is the power of two 2^(b-127); 255 is NaN. Used for block scales.
- FP8 E4M3 weights: [out, in] with one scale per 128x128 block, scale [ceil(out/128), ceil(in/128)].
- MXFP4 (E2M1) weights: two 4-bit codes per byte (low nibble = element 2i), stored as int8 [out, in/2],
  one E8M0 scale per 32 consecutive elements of a row, scale [out, in/32].

Scale bytes are always moved as bits (`.view(torch.uint8)`), never converted by value. Every function
works on plain uint8/int8 bytes, so it runs where torch lacks the float8/float4 dtypes; where they exist
(`float8_e4m3fn`, `float8_e8m0fnu`, `float4_e2m1fn_x2`) they are accepted and produced as views.
"""

from .e8m0 import (
    E8M0_NAN,
    HAS_E8M0,
    as_e8m0_bytes,
    e8m0_decode,
    e8m0_encode,
    e8m0_from_bytes,
)
from .fp4 import (
    FP4_BLOCK,
    FP4_VALUES,
    HAS_FP4,
    as_packed_bytes,
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    pack_fp4,
    packed_from_bytes,
    quantize_mxfp4,
    unpack_fp4,
)
from .fp8 import (
    FP8_BLOCK,
    FP8_MAX,
    HAS_FP8,
    as_fp8_bytes,
    dequantize_fp8,
    e4m3_decode,
    e4m3_encode,
    fp8_from_bytes,
    fp8_scale_shape,
    quantize_fp8,
)

__all__ = [
    "E8M0_NAN",
    "HAS_E8M0",
    "as_e8m0_bytes",
    "e8m0_decode",
    "e8m0_encode",
    "e8m0_from_bytes",
    "FP4_BLOCK",
    "FP4_VALUES",
    "HAS_FP4",
    "as_packed_bytes",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "pack_fp4",
    "packed_from_bytes",
    "quantize_mxfp4",
    "unpack_fp4",
    "FP8_BLOCK",
    "FP8_MAX",
    "HAS_FP8",
    "as_fp8_bytes",
    "dequantize_fp8",
    "e4m3_decode",
    "e4m3_encode",
    "fp8_from_bytes",
    "fp8_scale_shape",
    "quantize_fp8",
]
