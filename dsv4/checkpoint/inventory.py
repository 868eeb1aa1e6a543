"""What a validated checkpoint is made of: its stored pieces, the official tensors they form, and the
plan the reader streams from. Below the layouts, which name these in their signatures, and the reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import ModelConfig
from .names import Spec
from .safetensors_io import CheckpointError, TensorInfo


def without_mtp(cfg: ModelConfig) -> ModelConfig:
    """cfg with no MTP block and no DSpark draft (the compress ratios of the main layers kept)."""
    if not cfg.n_mtp_layers and not cfg.dspark_block_size:
        return cfg
    return cfg.replace(
        n_mtp_layers=0,
        compress_ratios=cfg.compress_ratios[: cfg.n_layers],
        dspark_block_size=0,
        dspark_noise_token_id=0,
        dspark_target_layer_ids=(),
    )


@dataclass
class Piece:
    info: TensorInfo
    rank: int = 0

    def where(self) -> str:
        return f"'{self.info.name}' in {self.info.file}"


@dataclass
class Entry:
    """One official weight (or one fused HF expert tensor) and where its bytes are."""

    name: str
    spec: Spec
    fmt: str  # "float" | "int" | "fp8" | "fp4"
    weight: list[Piece]
    scale: list[Piece] = field(default_factory=list)
    split: int | None = None  # inference layout: pieces concatenated on this dim
    parts: tuple[str, ...] = ()  # fused HF experts: ("w1", "w3") or ("w2",)

    @property
    def nbytes(self) -> int:
        return sum(p.info.nbytes for p in self.weight + self.scale)


@dataclass
class Plan:
    root: Path
    layout: str
    cfg: ModelConfig
    files: list[Path]
    mp: int
    entries: dict[str, Entry]
    ignored: list[TensorInfo]
    headers: dict[Path, dict[str, TensorInfo]]
    warnings: list[str]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def without_mtp(self) -> Plan:
        """This plan without the MTP tensors, for a model built without the MTP block."""
        if not any(n.startswith("mtp.") for n in self.entries) and not self.cfg.n_mtp_layers:
            return self
        entries = {n: e for n, e in self.entries.items() if not n.startswith("mtp.")}
        return replace(self, cfg=without_mtp(self.cfg), entries=entries, warnings=list(self.warnings))


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, msg: str) -> None:
        self.items.append(msg)

    def raise_if_any(self) -> None:
        if self.items:
            more = f" (and {len(self.items) - 1} more problems)" if len(self.items) > 1 else ""
            err = CheckpointError(self.items[0] + more)
            err.problems = list(self.items)
            raise err


__all__ = ["Piece", "Entry", "Plan", "Problems", "without_mtp"]
