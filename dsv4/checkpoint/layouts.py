"""The three checkpoint layouts: detection from the files, and the inventory each must contain.

- "release": the Hugging Face repository of the release: `*.safetensors` shards (+ an index json),
  official names (`model.` prefix, `self_attn`/`mlp`, `weight_scale_inv`, `e_score_correction_bias`
  accepted as variants), FP8 E4M3 linears with E8M0 block scales, MXFP4 experts, MTP under `mtp.*`.
- "inference": the official converter's output `model{rank}-mp{N}.safetensors`: routed experts
  distributed over ranks by index, column-/row-parallel weights split, everything else replicated.
- "hf": a transformers `save_pretrained` directory of `DeepseekV4ForCausalLM` (module names such as
  `self_attn.q_a_proj`, fused `mlp.experts.gate_up_proj`, `attn_hc.fn`, `self_attn.sinks`, ...).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from ..config import ModelConfig
from ..safe_paths import contained, read_text, regular_file
from .names import EXPERT, F32, HF_MARKERS, INT, LINEAR, hf_name, official_tensors, scale_name
from .safetensors_io import CheckpointError

LAYOUTS = ("release", "inference", "hf")
_MP_RE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


def find_files(path: str | Path) -> tuple[str, list[Path], int]:
    """(layout guess by file names, safetensors files in load order, model-parallel size)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    mp_files = {}
    for p in root.iterdir():
        m = _MP_RE.match(p.name)
        if m:
            mp_files[int(m[1])] = (int(m[2]), _shard(root, p.name, root))
    if mp_files:
        sizes = {n for n, _ in mp_files.values()}
        if len(sizes) != 1:
            raise CheckpointError(f"{root}: model-parallel files disagree on the rank count: {sorted(sizes)}")
        n = sizes.pop()
        missing = [r for r in range(n) if r not in mp_files]
        if missing:
            raise CheckpointError(
                f"{root}: missing shard {root / f'model{missing[0]}-mp{n}.safetensors'} "
                f"({len(missing)} of {n} ranks absent)"
            )
        return "inference", [mp_files[r][1] for r in range(n)], n
    index = sorted(root.glob("*.safetensors.index.json"))
    if index:
        idx = _shard(root, index[0].name, root)
        try:
            weight_map = json.loads(read_text(idx))["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError("weight_map must be a non-empty object")
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{idx}: not a valid safetensors index ({str(e)[:200]})") from None
        for n in names:
            if not isinstance(n, str) or not n.endswith(".safetensors"):
                raise CheckpointError(f"{idx}: not a valid safetensors index (entry {str(n)[:80]!r} is not "
                                      "a .safetensors file name)")
        files = [_shard(root, n, idx) for n in names]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: missing shard (listed in {index[0].name})")
        return "sharded", files, 1
    files = [_shard(root, f.name, root) for f in sorted(root.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    return "sharded", files, 1


def _shard(root: Path, name: str, named_by: Path) -> Path:
    """root/name, contained in root and a regular file if it exists (see `paths`)."""
    path = contained(root, name, str(named_by))
    if os.path.lexists(path):
        regular_file(path)
    return path


def detect_layout(names: list[str], by_files: str) -> str:
    if by_files == "inference":
        return "inference"
    return "hf" if any(m in n for n in names for m in HF_MARKERS) else "release"


def load_config(path: str | Path, overrides: dict | None = None) -> ModelConfig:
    """The directory's config.json, with `overrides` (ModelConfig fields) applied before validation."""
    cfg_path = Path(path) / "config.json"
    if not os.path.lexists(cfg_path):
        raise CheckpointError(
            f"{cfg_path}: missing (a checkpoint directory needs its config.json; pass "
            "--config or a ModelConfig to use another)"
        )
    contained(path, "config.json", str(path))
    from ..config import ConfigError

    try:
        return ModelConfig.from_json(cfg_path, overrides)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None


# --------------------------------------------------------------------------- expected inventories
def _release_storage(cfg: ModelConfig, name: str, shape: tuple[int, ...], role: str) -> dict[str, tuple]:
    scale_dt = "F8_E8M0" if (cfg.scale_fmt or "ue8m0") == "ue8m0" else "F32"
    if role == EXPERT and cfg.expert_dtype == "fp4":
        o, i = shape
        return {name: ((o, i // 2), "I8"), scale_name(name): ((o, i // 32), "F8_E8M0")}
    if role in (LINEAR, EXPERT) and cfg.dtype == "fp8":
        o, i = shape
        return {name: (shape, "F8_E4M3"), scale_name(name): ((-(-o // 128), -(-i // 128)), scale_dt)}
    if role == F32:
        return {name: (shape, "F32")}
    if role == INT:
        return {name: (shape, "I32")}
    return {name: (shape, "BF16")}


def expected_tensors(cfg: ModelConfig, layout: str = "release", mtp: bool = True) -> dict[str, tuple]:
    """{stored name: (shape, safetensors dtype)} a layout must contain for cfg (inference: one rank, mp=1)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out: dict[str, tuple] = {}
    if layout == "hf":
        for name, spec in official_tensors(cfg, mtp=False).items():
            if spec.role == EXPERT:
                continue
            out[hf_name(name)] = (
                spec.shape,
                "F32" if spec.role == F32 else "I64" if spec.role == INT else "BF16",
            )
        for i in range(cfg.n_layers):
            e, inter, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ((e, 2 * inter, d), "BF16")
            out[f"model.layers.{i}.mlp.experts.down_proj"] = ((e, d, inter), "BF16")
        return out
    for name, spec in official_tensors(cfg, mtp=mtp).items():
        st = _release_storage(cfg, name, spec.shape, spec.role)
        if layout == "inference" and name.endswith("attn.wo_a.weight"):
            st = {name: (spec.shape, "BF16")}  # the official converter dequantizes wo_a
        out.update(st)
    return out


def logical_numel(shape: tuple[int, ...], dtype: str, name: str) -> int:
    """Parameters a stored tensor holds (packed I8 FP4 holds two per byte; scales hold none)."""
    if name.endswith((".scale", "weight_scale_inv")):
        return 0
    n = math.prod(shape)
    return 2 * n if dtype == "I8" and ".experts." in name else n


def parameter_totals(inventory: dict[str, tuple]) -> dict[str, int]:
    back = sum(logical_numel(s, d, n) for n, (s, d) in inventory.items() if not n.startswith("mtp."))
    mtp = sum(logical_numel(s, d, n) for n, (s, d) in inventory.items() if n.startswith("mtp."))
    return {"backbone": back, "mtp": mtp, "total": back + mtp}


__all__ = [
    "LAYOUTS",
    "CONFIG_FILES",
    "find_files",
    "detect_layout",
    "load_config",
    "expected_tensors",
    "parameter_totals",
]
