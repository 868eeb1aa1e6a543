"""Rotary position embedding with YaRN, on interleaved pairs (dims 2i, 2i+1 form one complex number).

Window-only layers: theta = rope_theta, no YaRN. Compressed layers: theta = compress_rope_theta with
YaRN frequency interpolation (no mscale on cos/sin). Angles are computed from absolute positions on the
fly, so there is no table and no maximum length.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import ops
from ..config import ModelConfig


@functools.lru_cache(maxsize=16)
def inv_frequencies(
    dim: int, theta: float, factor: float, original_seq_len: int, beta_fast: int, beta_slow: int
) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies; YaRN-interpolated when original_seq_len > 0."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if original_seq_len > 0 and factor != 1:

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        # ramp = 0: keep the original frequency (fast dims); ramp = 1: interpolate by `factor`
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


class Rope:
    """cos/sin for a layer kind; `apply(x, positions)` rotates the last dim of x (its rope dims)."""

    def __init__(self, cfg: ModelConfig, compressed: bool):
        self.dim = cfg.rope_head_dim
        if compressed:
            self.inv_freq = inv_frequencies(
                self.dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow
            )
        else:
            self.inv_freq = inv_frequencies(self.dim, cfg.rope_theta, 1.0, 0, cfg.beta_fast, cfg.beta_slow)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def _freq_on(self, device: torch.device) -> torch.Tensor:
        # one copy per device, made once: no host-to-device copy per call (CUDA-graph capturable)
        cached = self._by_device.get(device)
        if cached is None:
            cached = self._by_device[device] = self.inv_freq.to(device)
        return cached

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [b, s, (h,) dim] rotated at positions [s]; inverse=True undoes the rotation (`ops.rope_tail`
        with no unrotated part)."""
        return ops.rope_tail(x, positions, self._freq_on(positions.device), inverse)


def in_place_ok() -> bool:
    """Whether a block may rewrite a tensor it has just made in place: at inference (grad off), and not
    while torch.compile traces it (inductor rewrites in-place ops as copies anyway, and its CPU backend
    fails on a slice written in place in some fusions: pytorch/pytorch#196570, seen with torch 2.11)."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def apply_rope_tail(x: torch.Tensor, rope: Rope, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate only the last `rope.dim` dims of x (the RoPE dims of a V4 head), leave the rest. At inference
    (`in_place_ok`) x - a tensor the caller has just made and owns - is rotated in place: the kernel then
    reads and writes its tail only, not the whole head."""
    return ops.rope_tail(x, positions, rope._freq_on(positions.device), inverse, inplace=in_place_ok())
