"""The DSpark layout: a release checkpoint (Flash-0731) whose `mtp.*` tensors are a DSpark draft, not
the first release's single MTP block.

The backbone is the release layout's. Under `mtp.{k}` (k = 0 .. stages-1) each stage is a decoder block
without the compressed branch (window-only attention with its sink, the MoE with its routed and shared
experts, the two mHC mixers: no compressor, no indexer). The draft's entry and exit heads appear once:
`mtp.0.main_proj` [dim, dim * len(target layers)] (FP8 + block scale in the release; it projects the main
model's hidden states taken at the target layers) and `mtp.0.main_norm` [dim]; on the last stage
`norm` [dim], `hc_head_{fn,base,scale}`, `markov_head.markov_w1` / `markov_w2` [vocab, markov rank] and
`confidence_head.proj` [1, dim + markov rank]. The draft shares the main model's embedding and head
(`names.dspark_tensors`). config.json names the draft with the official inference code's `dspark_*` keys
(block size, noise token, target layers, Markov rank), which `ModelConfig` reads.

The number of stages is the checkpoint's: Flash-0731's config.json says `num_nextn_predict_layers: 1`
while its tensors hold three stages, so the stage count comes from the `mtp.{k}` names when they
disagree (with a warning). dsv4 runs the draft (`dsv4.model.dspark`); `mtp=False` (`--no-mtp`) loads the
main model without it. Writing: the release writer (shards, FP8 / MXFP4 or BF16) with the `dspark_*`
keys in config.json: `dsv4 convert --to bf16 / fp8` of a DSpark checkpoint keeps its draft.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import ConfigError, ModelConfig
from ..names import canonical, dspark_tensors, official_tensors
from ..safetensors_io import CheckpointError
from .base import Layout, LayoutWriter, register

if TYPE_CHECKING:
    from ..inventory import Plan

# names only a DSpark draft has (with or without the release's `model.` prefix)
_DRAFT_HEADS = re.compile(r"(?:^|\.)mtp\.\d+\.(?:main_proj|main_norm|markov_head|confidence_head)\.")
_STAGE = re.compile(r"^mtp\.(\d+)\.")


def stages_found(stored_names: list[str]) -> list[int]:
    """The stage indices k of the `mtp.{k}.*` tensors of a checkpoint, sorted."""
    return sorted({int(m[1]) for n in stored_names if (m := _STAGE.search(canonical(n).name))})


def with_stages(cfg: ModelConfig, stages: int) -> ModelConfig:
    """cfg with `stages` window-only draft stages after the main layers."""
    return cfg.replace(n_mtp_layers=stages, compress_ratios=tuple(cfg.compress_ratios[: cfg.n_layers]) + (0,) * stages)


@register
class DSparkLayout(Layout):
    name = "dspark"
    description = "release shards whose mtp.* is a DSpark draft (Flash-0731)"
    priority = 20

    def claims(self, stored_names: list[str]) -> bool:
        return any(_DRAFT_HEADS.search(n) for n in stored_names)

    def configure(self, cfg: ModelConfig, stored_names: list[str], root: Path) -> tuple[ModelConfig, list[str]]:
        found = stages_found(stored_names)
        if not cfg.dspark_block_size:
            raise CheckpointError(
                f"{root}: the tensors are a DSpark draft ({len(found)} stages under mtp.*) "
                "but config.json has no dspark_block_size (and the other dspark_* keys)"
            )
        if found and found == list(range(len(found))) and len(found) != cfg.n_mtp_layers:
            try:
                fixed = with_stages(cfg, len(found))
            except ConfigError as e:
                raise CheckpointError(f"{root}: {e}") from None
            return fixed, [
                f"{root}: config.json describes {cfg.n_mtp_layers} MTP layer(s), the checkpoint "
                f"holds {len(found)} DSpark stages: using {len(found)}"
            ]
        return cfg, []

    def tensors(self, cfg: ModelConfig, root: Path | None = None) -> dict:
        return official_tensors(cfg)

    def writer(
        self, root: Path, cfg: ModelConfig, mp: int, fmt: str, expert_dtype: str | None, shard_bytes: int
    ) -> LayoutWriter:
        from .release import ReleaseWriter

        return ReleaseWriter(root, fmt, expert_dtype, shard_bytes)

    def details(self, root: Path, stored_names: list[str], cfg: ModelConfig | None) -> dict[str, Any]:
        draft: dict[str, Any] = {"kind": "DSpark", "stages_found": stages_found(stored_names)}
        if cfg is not None and cfg.dspark:
            specs = dspark_tensors(cfg)
            draft.update(
                stages=cfg.n_mtp_layers,
                block_size=cfg.dspark_block_size,
                noise_token_id=cfg.dspark_noise_token_id,
                target_layers=list(cfg.dspark_target_layer_ids),
                markov_rank=cfg.dspark_markov_rank,
                tensors=len(specs),
                parameters=sum(math.prod(s.shape) for s in specs.values()),
            )
        return {"draft": draft}

    def prepare_load(self, p: Plan, mtp: bool = True) -> Plan:
        return p if mtp else p.without_mtp()


__all__ = ["DSparkLayout", "stages_found", "with_stages"]
