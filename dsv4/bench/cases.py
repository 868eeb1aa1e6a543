"""Benchmark fixtures of `dsv4 bench ops --only elementwise`: per op, named cases at the model's shapes.

Each case is (case name, op, make(tokens) -> args of `dsv4.ops.<op>`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ModelConfig
from ..model.rope import Rope

Case = tuple[str, str, Callable[[int], tuple]]


def elementwise_cases(device: torch.device | str, batch: int = 4) -> list[Case]:
    """(case name, op, make(tokens) -> args) at the model's shapes, for `dsv4 bench ops --only elementwise`."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    return [
        ("kv 448 of 512", "fp8_round_trip", lambda s: (rnd(batch, s, 512)[..., :448], 64)),
        ("indexer q", "fp4_round_trip", lambda s: (rnd(batch, s, 64, 128), 32)),
        ("indexer q", "hadamard", lambda s: (rnd(batch, s, 64, 128),)),
        (
            "ratio 4, overlapping",
            "compress_pool",
            lambda s: (
                rnd(batch, max(1, s // 4), 8, 512, dtype=torch.float32),
                rnd(batch, max(1, s // 4), 8, 512, dtype=torch.float32),
            ),
        ),
        (
            "ratio 128",
            "compress_pool",
            lambda s: (
                rnd(batch, max(1, s // 128), 128, 512, dtype=torch.float32),
                rnd(batch, max(1, s // 128), 128, 512, dtype=torch.float32),
            ),
        ),
    ]


def norm_rope_cases(device: torch.device | str) -> list[Case]:
    """(case name, op, make(tokens) -> args) at the small preset's shapes (dim 1024, 16 heads of 512 with a
    64-dim rope tail), for `dsv4 bench ops --only elementwise`."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    cfg = ModelConfig.preset("small")
    freq = Rope(cfg, compressed=True)._freq_on(dev)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    def pos(s: int) -> torch.Tensor:
        return torch.arange(s, device=dev) + 1000

    w = torch.randn(cfg.dim, device=dev, generator=gen)
    return [
        (f"x [1, s, {cfg.dim}]", "rms_norm", lambda s: (rnd(1, s, cfg.dim), w, cfg.norm_eps)),
        (
            f"q [1, s, {cfg.n_heads}, {cfg.head_dim}] no weight",
            "rms_norm",
            lambda s: (rnd(1, s, cfg.n_heads, cfg.head_dim), None, cfg.norm_eps),
        ),
        (
            f"q [1, s, {cfg.n_heads}, {cfg.head_dim}]",
            "rope_tail",
            lambda s: (rnd(1, s, cfg.n_heads, cfg.head_dim), pos(s), freq),
        ),
        (f"kv [1, s, {cfg.head_dim}]", "rope_tail", lambda s: (rnd(1, s, cfg.head_dim), pos(s), freq)),
    ]
