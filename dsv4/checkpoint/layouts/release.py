"""The release layout: the Hugging Face repository of the release.

`*.safetensors` shards (+ an index json), official names (`model.` prefix, `self_attn`/`mlp`,
`weight_scale_inv`, `e_score_correction_bias` accepted as variants), FP8 E4M3 linears with E8M0 block
scales, MXFP4 experts, the first release's MTP block under `mtp.*`. It is what any sharded directory is
taken for when no more specific layout claims its names, and what `dsv4 convert --to bf16/fp8` writes.
"""

from __future__ import annotations

from pathlib import Path

from ...config import ModelConfig
from ..names import Spec
from ..storage import ShardedWriter, Value, encode
from .base import Layout, LayoutWriter, register


@register
class ReleaseLayout(Layout):
    name = "release"
    description = "release shards (official names, FP8 + E8M0 scales, MXFP4 experts)"

    def writer(
        self, root: Path, cfg: ModelConfig, mp: int, fmt: str, expert_dtype: str | None, shard_bytes: int
    ) -> LayoutWriter:
        return ReleaseWriter(root, fmt, expert_dtype, shard_bytes)


class ReleaseWriter(LayoutWriter):
    """Official tensors encoded to bf16 or fp8 storage, into shards of at most shard_bytes."""

    def __init__(self, root: Path, fmt: str, expert_dtype: str | None, shard_bytes: int) -> None:
        self.out = ShardedWriter(root, shard_bytes)
        self.fmt, self.expert_dtype = fmt, expert_dtype

    def add(self, name: str, spec: Spec, v: Value) -> None:
        for sname, t in encode(spec, name, v, self.fmt, self.expert_dtype).items():
            self.out.add(sname, t)

    def close(self) -> dict[str, dict[str, str]]:
        return self.out.close()
