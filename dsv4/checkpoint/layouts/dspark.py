"""The DSpark layout: a release checkpoint (Flash-0731) whose `mtp.*` tensors are a 3-stage DSpark draft,
not the first release's single MTP block.

The backbone is the release layout's. Under `mtp.{k}` (k = 0 .. stages-1) each stage is a decoder block
without the compressed branch (window-only attention with its sink, the MoE with its routed and shared
experts, the two mHC mixers: no compressor, no indexer). The draft's entry and exit heads appear once:
`mtp.0.main_proj` [dim, dim * len(target layers)] (FP8 + block scale in the release; it projects the main
model's hidden states taken at the target layers) and `mtp.0.main_norm` [dim]; on the last stage
`norm` [dim], `hc_head_{fn,base,scale}`, `markov_head.markov_w1` / `markov_w2` [vocab, markov rank] and
`confidence_head.proj` [1, dim + markov rank]. The draft shares the main model's embedding and head.
config.json names the draft with `dspark_*` keys (block size, noise token, target layers, Markov rank);
they describe the draft only and are not part of `ModelConfig`.

dsv4 validates this inventory (`dsv4 inspect` reports the draft, its stages and every missing, extra or
misshapen tensor) but does not run the draft: loading refuses it in one line (`Unsupported`), and
`mtp=False` (`--no-mtp`) loads the main model without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import ModelConfig
from ...errors import Unsupported
from ..names import DENSE, F32, LINEAR, Spec, block_tensors, canonical, official_tensors
from ..safetensors_io import CheckpointError
from .base import Layout, raw_config, register

if TYPE_CHECKING:
    from ..inventory import Plan

# names only a DSpark draft has (with or without the release's `model.` prefix)
_DRAFT_HEADS = re.compile(r"(?:^|\.)mtp\.\d+\.(?:main_proj|main_norm|markov_head|confidence_head)\.")
_STAGE = re.compile(r"^mtp\.(\d+)\.")
_KEY_PREFIX = "dspark_"


@dataclass(frozen=True)
class DraftParams:
    """The draft's shape parameters; the defaults are Flash-0731's (see the project SPEC)."""

    stages: int = 3
    block_size: int = 5
    noise_token_id: int = 128799
    target_layers: tuple[int, ...] = (40, 41, 42)
    markov_rank: int = 256

    @classmethod
    def from_config(cls, raw: dict[str, Any], cfg: ModelConfig) -> DraftParams:
        """From config.json's `dspark_*` keys; the stage count falls back to the config's MTP depth (to
        Flash-0731's 3 without a config.json), the target layers to the last three main layers."""
        d = cls()
        stages = raw.get("dspark_num_stages", (cfg.n_mtp_layers or d.stages) if raw else d.stages)
        targets = raw.get("dspark_target_layer_ids", [max(0, cfg.n_layers - 3 + i) for i in range(3)])
        p = cls(
            stages=stages,
            block_size=raw.get("dspark_block_size", d.block_size),
            noise_token_id=raw.get("dspark_noise_token_id", d.noise_token_id),
            target_layers=tuple(targets) if isinstance(targets, list) else targets,
            markov_rank=raw.get("dspark_markov_rank", d.markov_rank),
        )
        p.check(cfg)
        return p

    def check(self, cfg: ModelConfig) -> None:
        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        bad = [k for k in ("stages", "block_size", "markov_rank") if not count(getattr(self, k))]
        if bad:
            raise CheckpointError(f"DSpark config: {', '.join(bad)} must be positive integers")
        t = self.target_layers
        if not isinstance(t, tuple) or not t or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.n_layers for i in t
        ):
            raise CheckpointError(
                f"DSpark config: dspark_target_layer_ids must be a non-empty list of layer indices "
                f"below {cfg.n_layers}, got {t!r}"
            )
        if not isinstance(self.noise_token_id, int) or not 0 <= self.noise_token_id < cfg.vocab_size:
            raise CheckpointError(
                f"DSpark config: dspark_noise_token_id must be a token id below {cfg.vocab_size}, "
                f"got {self.noise_token_id!r}"
            )


def draft_tensors(cfg: ModelConfig, p: DraftParams) -> dict[str, Spec]:
    """{official name: Spec} of the draft's tensors under `mtp.*`."""
    d, hc, last = cfg.dim, cfg.hc_mult, p.stages - 1
    window_only = cfg.replace(
        n_mtp_layers=p.stages, compress_ratios=tuple(cfg.compress_ratios[: cfg.n_layers]) + (0,) * p.stages
    )
    out: dict[str, Spec] = {}
    for k in range(p.stages):
        for name, spec in block_tensors(window_only, cfg.n_layers + k).items():
            out[f"mtp.{k}.{name}"] = spec
    out["mtp.0.main_proj.weight"] = Spec((d, d * len(p.target_layers)), LINEAR)
    out["mtp.0.main_norm.weight"] = Spec((d,), DENSE)
    out[f"mtp.{last}.norm.weight"] = Spec((d,), DENSE)
    out[f"mtp.{last}.hc_head_fn"] = Spec((hc, hc * d), F32)
    out[f"mtp.{last}.hc_head_base"] = Spec((hc,), F32)
    out[f"mtp.{last}.hc_head_scale"] = Spec((1,), F32)
    out[f"mtp.{last}.markov_head.markov_w1.weight"] = Spec((cfg.vocab_size, p.markov_rank), DENSE)
    out[f"mtp.{last}.markov_head.markov_w2.weight"] = Spec((cfg.vocab_size, p.markov_rank), DENSE)
    out[f"mtp.{last}.confidence_head.proj.weight"] = Spec((1, d + p.markov_rank), DENSE)
    return out


@register
class DSparkLayout(Layout):
    name = "dspark"
    description = "release shards whose mtp.* is Flash-0731's DSpark draft (validated, not run)"
    priority = 20
    writable = False

    def claims(self, stored_names: list[str]) -> bool:
        return any(_DRAFT_HEADS.search(n) for n in stored_names)

    def config_keys(self, raw: dict[str, Any]) -> set[str]:
        return {k for k in raw if k.startswith(_KEY_PREFIX)}

    def params(self, cfg: ModelConfig, root: Path | None = None) -> DraftParams:
        return DraftParams.from_config(raw_config(Path(root) / "config.json") if root else {}, cfg)

    def tensors(self, cfg: ModelConfig, root: Path | None = None) -> dict[str, Spec]:
        return {**official_tensors(cfg, mtp=False), **draft_tensors(cfg, self.params(cfg, root))}

    def prepare_load(self, p: Plan, mtp: bool = True) -> Plan:
        d = self.params(p.cfg, p.root)
        if mtp:
            raise Unsupported(
                f"{p.root}: the DSpark draft of this checkpoint ({d.stages} stages under mtp.*) is not "
                "implemented (dsv4 runs the first release's single MTP block only); load the main model "
                "without it: --no-mtp on the command line, load_pretrained(..., mtp=False) in Python"
            )
        q = p.without_mtp()
        q.warnings.append(f"{p.root}: DSpark draft ({d.stages} stages) not loaded; the main model runs without MTP")
        return q

    def details(self, root: Path, stored_names: list[str], cfg: ModelConfig | None) -> dict[str, Any]:
        found = sorted({int(m[1]) for n in stored_names if (m := _STAGE.search(canonical(n).name))})
        draft: dict[str, Any] = {"kind": "DSpark", "stages_found": found}
        if cfg is not None:
            try:
                d = self.params(cfg, root)
            except CheckpointError as e:
                draft["config_problem"] = str(e)
            else:
                specs = draft_tensors(cfg, d)
                draft.update(asdict(d), target_layers=list(d.target_layers), tensors=len(specs),
                             parameters=sum(math.prod(s.shape) for s in specs.values()))
        return {"draft": draft}


__all__ = ["DSparkLayout", "DraftParams", "draft_tensors"]
