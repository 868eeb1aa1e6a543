"""Write checkpoints in any layout, streaming, atomically, verified by reading them back.

Values flow as (official name, Value) pairs, from a model (`model_values`) or from another checkpoint
(`plan_values`). `encode` turns each into the stored tensors of the target format; `save` writes them:
into a temporary directory next to the destination, shard by shard through `StreamingFile`s (bounded
memory: payloads go straight to disk, the header is written at the end), with an index json, the
config and tokenizer files; then it re-reads every header through the loader's validation, re-reads
every payload and compares its digest with what was written, and only then renames the directory into
place. On any error the temporary directory is removed: nothing half-written is left. An existing
destination, or one that appears while the writer runs, is never replaced (see `atomic`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..config import ModelConfig
from ..safe_paths import contained, open_regular, regular_file
from . import layouts
from .atomic import atomic_directory
from .layouts import CONFIG_FILES
from .names import INT, official_tensors, to_official
from .reader import Plan, for_loading, plan, stream
from .safetensors_io import CheckpointError
from .storage import Value, encode

TARGETS = ("bf16", "fp8", "hf", "inference")
# `dsv4 convert --to`: target -> (layout, storage format: bf16, fp8, or "keep" the source's)
_TARGET_LAYOUTS = {
    "bf16": ("release", "bf16"),
    "fp8": ("release", "fp8"),
    "hf": ("hf", "bf16"),
    "inference": ("inference", "keep"),
}


# ------------------------------------------------------------------------------------------ sources
def model_values(model: torch.nn.Module) -> Iterator[tuple[str, Value]]:
    """A model's tensors as official (name, Value) pairs; stacked experts come out one per expert."""
    specs = official_tensors(model.cfg)
    sd = model.state_dict()
    for mname, t in sd.items():
        t = t.detach().cpu()
        if mname.endswith(("experts.w1", "experts.w2", "experts.w3")) and t.dim() == 3:
            for j in range(t.size(0)):
                yield to_official(mname, j), Value("float", t[j])
            continue
        if mname not in specs:
            raise CheckpointError(f"model tensor '{mname}' has no official checkpoint name")
        yield mname, Value("int" if specs[mname].role == INT else "float", t)


def plan_values(p: Plan, progress: bool | None = None) -> Iterator[tuple[str, Value]]:
    """A checkpoint's tensors as official (name, Value) pairs (fused HF experts split per expert)."""
    for e, v in stream(p, progress):
        if e.parts:
            prefix = e.name.rsplit(".", 1)[0]
            chunks = v.data.chunk(len(e.parts), dim=1)
            for j in range(v.data.size(0)):
                for w, c in zip(e.parts, chunks):
                    yield f"{prefix}.{j}.{w}.weight", Value("float", c[j])
        else:
            yield e.name, v


# ------------------------------------------------------------------------------------------ save
def target_layout(target: str) -> tuple[layouts.Layout, str]:
    """(layout, storage format) of a `--to` target."""
    if target not in TARGETS:
        raise CheckpointError(f"unknown target '{target}'; choose one of {TARGETS}")
    name, fmt = _TARGET_LAYOUTS[target]
    return layouts.get(name), fmt


def output_config(cfg: ModelConfig, target: str, expert_dtype: str | None) -> dict:
    lay, fmt = target_layout(target)
    return lay.output_config(cfg, fmt, expert_dtype)


def save(
    values: Iterable[tuple[str, Value]],
    cfg: ModelConfig,
    dst: str | Path,
    target: str = "bf16",
    mp: int = 1,
    expert_dtype: str | None = None,
    shard_bytes: int = 4 << 30,
    copy_from: str | Path | None = None,
    verify: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write (official name, Value) pairs as a checkpoint directory in the target layout/format.

    target: "bf16" / "fp8" (release layout), "hf" (transformers names, fused experts, BF16, no MTP),
    "inference" (official converter layout, mp rank files; formats kept, wo_a dequantized to BF16,
    MXFP4 experts as float4_e2m1fn_x2).
    """
    lay, fmt = target_layout(target)
    dst = Path(dst)
    if os.path.lexists(dst) and not (overwrite and dst.is_dir() and not dst.is_symlink()):
        raise CheckpointError(f"{dst}: already exists; choose a new destination (nothing was written)")
    lay.check_write(cfg, mp)
    extra_files = _extra_files(copy_from) if copy_from is not None else []
    with atomic_directory(dst, replace=overwrite) as tmp:
        specs = lay.write_tensors(cfg)
        out = lay.writer(tmp, cfg, mp, fmt, expert_dtype, shard_bytes)
        seen: set[str] = set()
        for name, v in values:
            if name not in specs:
                if lay.skips(name):
                    continue
                raise CheckpointError(f"tensor '{name}' is not part of the config's checkpoint")
            seen.add(name)
            out.add(name, specs[name], v)
        missing = [n for n in specs if n not in seen]
        if missing:
            raise CheckpointError(f"source is missing tensor '{missing[0]}'")
        digests = out.close()
        cfg_json = lay.output_config(cfg, fmt, expert_dtype)
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
        for src in extra_files:
            with open_regular(src) as f_in, open(tmp / src.name, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 16 << 20)
        if verify:
            verify_checkpoint(tmp, digests, lay.verify_config(cfg))
    return dst


def _extra_files(src: str | Path) -> list[Path]:
    """The tokenizer / generation files of a source directory to copy along: regular files inside it."""
    out = []
    for name in CONFIG_FILES:
        if name != "config.json" and os.path.lexists(Path(src) / name):
            path = contained(src, name, str(src))
            regular_file(path)
            out.append(path)
    return out


def verify_checkpoint(root: Path, digests: dict[str, dict[str, str]], cfg: ModelConfig | None) -> None:
    """Re-validate the written headers and compare every payload's digest with what was written."""
    p = plan(root, cfg)
    from .safetensors_io import iter_file, read_header

    for fname, want in digests.items():
        infos, _ = read_header(root / fname)
        if set(infos) != set(want):
            raise CheckpointError(f"{root / fname}: verification failed: tensor names differ after writing")
        for info, t in iter_file(infos):
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            if hashlib.blake2b(memoryview(raw.numpy()), digest_size=16).hexdigest() != want[info.name]:
                raise CheckpointError(
                    f"{root / fname}: verification failed: tensor '{info.name}' reads back different bytes"
                )
    del p


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    mp: int = 1,
    layout: str | None = None,
    expert_dtype: str | None = None,
    shard_bytes: int = 4 << 30,
    progress: bool | None = None,
    force_expert_dtype: bool = False,
    mtp: bool = True,
) -> Path:
    """`dsv4 convert`: read any layout, write the target one (see save).

    --to fp8: experts become MXFP4 when expert_dtype is "fp4", or (unless force_expert_dtype) when the
    source experts or config are MXFP4; otherwise FP8. mtp=False leaves the draft out (the MTP block or a
    DSpark draft); a DSpark draft is kept by --to bf16 / fp8 / inference (transformers has no draft: --to
    hf leaves it out).
    """
    p = for_loading(plan(src, layout=layout), mtp)
    cfg = p.cfg
    if to == "fp8" and not force_expert_dtype and expert_dtype is None:
        expert_dtype = "fp4" if (cfg.expert_dtype == "fp4" or _experts_are_fp4(p)) else None
    return save(plan_values(p, progress), cfg, dst, to, mp, expert_dtype, shard_bytes, copy_from=src)


def _experts_are_fp4(p: Plan) -> bool:
    return any(e.fmt == "fp4" for e in p.entries.values())


__all__ = [
    "TARGETS",
    "model_values",
    "plan_values",
    "encode",
    "save",
    "convert",
    "verify_checkpoint",
]
