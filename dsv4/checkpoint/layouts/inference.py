"""The inference layout: the official converter's output, `model{rank}-mp{N}.safetensors`.

Routed experts are distributed over the ranks by index (rank r holds experts [r*E/N, (r+1)*E/N)),
column-parallel weights (and the vocab-parallel embedding and head) are split on dim 0, row-parallel
ones on dim 1 (`names.split_dim`), everything else is replicated in every rank file. Stored formats are
kept as the release has them, except `wo_a`, which the converter dequantizes to BF16, and MXFP4
experts, stored as float4_e2m1fn_x2. Reading reassembles the split pieces (`split_dim`, `gather`);
writing splits them again (`InferenceWriter`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ... import formats as fm
from ...config import ModelConfig
from ..names import Spec, expert_index, official_tensors
from ..names import split_dim as official_split_dim
from ..safetensors_io import CheckpointError
from ..storage import RankWriter, Value, inference_dtype, keep_format
from .base import Layout, LayoutWriter, register, release_storage

if TYPE_CHECKING:
    from ..inventory import Piece, Problems


@register
class InferenceLayout(Layout):
    name = "inference"
    description = "official converter output, one model{rank}-mp{N}.safetensors per model-parallel rank"
    rank_files = True

    def expected(self, cfg: ModelConfig, mtp: bool = True) -> dict[str, tuple]:
        """One rank's files for mp=1: the release storage, with wo_a dequantized to BF16."""
        out: dict[str, tuple] = {}
        for name, spec in official_tensors(cfg, mtp=mtp).items():
            if name.endswith("attn.wo_a.weight"):
                out[name] = (spec.shape, "BF16")
            else:
                out.update(release_storage(cfg, name, spec.shape, spec.role))
        return out

    def piece_rank(self, file_index: int) -> int:
        return file_index

    def split_dim(self, official: str) -> int | None:
        return official_split_dim(official)

    def replicated(self, official: str) -> bool:
        return official_split_dim(official) is None and expert_index(official) is None

    def gather(
        self, name: str, spec: Spec, pieces: list[Piece], scales: list[Piece], mp: int, probs: Problems
    ) -> tuple[list[Piece], list[Piece]]:
        split = self.split_dim(name)
        ranks = sorted(p.rank for p in pieces)
        if expert_index(name) is not None:
            if len(pieces) > 1:
                probs.add(f"tensor {pieces[1].where()} is stored twice (also {pieces[0].where()})")
        elif len(set(ranks)) != len(ranks):
            probs.add(f"tensor {pieces[0].where()} is stored twice in one rank file")
        elif ranks != list(range(mp)):
            lost = sorted(set(range(mp)) - set(ranks))
            probs.add(
                f"tensor '{name}' is missing from rank file(s) {lost} (model-parallel files must each "
                "hold their part of every non-expert tensor)"
            )
        if split is not None and spec.shape[split] % mp:
            probs.add(f"tensor '{name}' {list(spec.shape)} cannot be split into {mp} ranks on dim {split}")
        pieces = sorted(pieces, key=lambda p: p.rank)
        scales = sorted(scales, key=lambda p: p.rank)
        if split is None and not self.replicated(name):
            scales = scales[:1]
        return pieces, scales

    def check_write(self, cfg: ModelConfig, mp: int) -> None:
        if mp < 1:
            raise CheckpointError("--mp applies to --to inference only, and must be >= 1")
        if cfg.n_routed_experts % mp:
            raise CheckpointError(f"--mp {mp} does not divide the {cfg.n_routed_experts} routed experts")

    def writer(
        self, root: Path, cfg: ModelConfig, mp: int, fmt: str, expert_dtype: str | None, shard_bytes: int
    ) -> LayoutWriter:
        return InferenceWriter(root, cfg, mp)

    def output_config(self, cfg: ModelConfig, fmt: str, expert_dtype: str | None) -> dict:
        return cfg.to_inference_json()


class InferenceWriter(LayoutWriter):
    """Stored formats kept; experts to their rank, split tensors cut in mp pieces, the rest copied."""

    def __init__(self, root: Path, cfg: ModelConfig, mp: int) -> None:
        self.out = RankWriter(root, mp)
        self.mp, self.n_local = mp, cfg.n_routed_experts // mp

    def add(self, name: str, spec: Spec, v: Value) -> None:
        mp = self.mp
        for sname, t in keep_format(spec, name, v).items():
            j = expert_index(name)
            if j is not None:
                self.out.add(j // self.n_local, sname, inference_dtype(t))
                continue
            dim = official_split_dim(sname)
            for r in range(mp):
                if dim is None:
                    self.out.add(r, sname, t)
                    continue
                if t.size(dim) % mp or (
                    sname.endswith(".weight")
                    and t.element_size() == 1
                    and mp > 1
                    and (t.size(dim) // mp) % fm.FP8_BLOCK
                ):
                    raise CheckpointError(
                        f"tensor '{sname}' {list(t.shape)} cannot be split into {mp} ranks on dim {dim}"
                    )
                self.out.add(r, sname, t.chunk(mp, dim)[r].contiguous())

    def close(self) -> dict[str, dict[str, str]]:
        return self.out.close()
