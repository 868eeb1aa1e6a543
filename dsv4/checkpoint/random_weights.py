"""Checkpoints of random weights: any preset or config, with the draft of either release, in the release
layout (`dsv4 init` writes these; tests use them as real checkpoints)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from .writer import model_values, save


def write_random(
    dst: str | Path,
    cfg: ModelConfig | str,
    *,
    draft: str | None = None,
    target: str = "bf16",
    expert_dtype: str | None = None,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write a random-weight checkpoint of cfg (a ModelConfig or a preset name) to the new directory dst.

    draft: None keeps cfg's own draft; "none", "mtp" (the first release's MTP block) or "dspark"
    (Flash-0731's DSpark draft: `ModelConfig.with_draft`) replaces it. target: "bf16" or "fp8" (FP8
    linears with E8M0 block scales; expert_dtype "fp4" for MXFP4 experts), the release layout either way
    (a DSpark draft makes it the DSpark layout: release shards whose mtp.* is the draft). The weights are
    `DeepSeekV4.from_config(cfg, seed)`'s: the same seed gives the same checkpoint. Written atomically and
    verified by reading it back (`dsv4.checkpoint.save`); an existing dst is refused."""
    from ..model import DeepSeekV4

    if isinstance(cfg, str):
        cfg = ModelConfig.preset(cfg)
    if draft is not None:
        cfg = cfg.with_draft(draft)
    if target not in ("bf16", "fp8"):
        raise ValueError(f"target must be 'bf16' or 'fp8', got {target!r}")
    model = DeepSeekV4.from_config(cfg, seed=seed, dtype=torch.float32, device="cpu")
    return save(model_values(model), cfg, dst, target=target, expert_dtype=expert_dtype, shard_bytes=shard_bytes)


__all__ = ["write_random"]
