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
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .. import formats as fm
from ..config import ModelConfig
from ..safe_paths import contained, open_regular, regular_file
from .atomic import atomic_directory
from .layouts import CONFIG_FILES
from .names import (
    EXPERT,
    F32,
    INT,
    LINEAR,
    Spec,
    hf_name,
    official_tensors,
    scale_name,
    split_dim,
    to_official,
)
from .reader import Plan, Value, plan, stream
from .safetensors_io import CheckpointError, st_dtype

TARGETS = ("bf16", "fp8", "hf", "inference")


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


# ------------------------------------------------------------------------------------------ encode
def _same_bits(v: Value) -> bool:
    return v.scale is not None and v.scale.dtype not in (torch.float32, torch.bfloat16, torch.float16)


def encode(spec: Spec, name: str, v: Value, target: str, expert_dtype: str | None) -> dict[str, torch.Tensor]:
    """One official tensor -> {official stored name: tensor} in the target storage format.

    target "bf16": floats as BF16 (F32-role tensors stay F32); only experts with expert_dtype "fp4"
    are quantized (to MXFP4).
    target "fp8": linears FP8 E4M3 + E8M0 block scales; experts MXFP4 (expert_dtype "fp4") or FP8;
    already-quantized inputs in the same format are copied bit for bit.
    """
    if spec.role == INT:
        return {name: v.data.to(torch.int32)}
    if spec.role == F32:
        return {name: v.dequantize(torch.float32)}
    quant = (target == "fp8" and spec.role in (LINEAR, EXPERT)) or (
        spec.role == EXPERT and expert_dtype == "fp4"
    )
    if not quant:
        return {name: v.dequantize(torch.bfloat16)}
    if spec.role == EXPERT and expert_dtype == "fp4":
        if v.fmt == "fp4" and _same_bits(v):
            return {name: fm.packed_from_bytes(v.data), scale_name(name): fm.e8m0_from_bytes(v.scale)}
        q, s = fm.quantize_mxfp4(v.dequantize())
        return {name: q, scale_name(name): s}
    if v.fmt == "fp8" and _same_bits(v):
        return {name: fm.fp8_from_bytes(v.data), scale_name(name): fm.e8m0_from_bytes(v.scale)}
    q, s = fm.quantize_fp8(v.dequantize())
    return {name: q, scale_name(name): s}


# ------------------------------------------------------------------------------------------ files
class StreamingFile:
    """A safetensors file written tensor by tensor: payload to a side file, header at close()."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data_path = path.with_name(path.name + ".payload")
        self.f = open(self.data_path, "wb")
        self.header: dict[str, dict] = {}
        self.offset = 0
        self.digests: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> int:
        t = t.detach().contiguous().cpu()
        dt = st_dtype(t.dtype)
        shape = list(t.shape)
        if dt == "F4":
            shape[-1] *= 2
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        mv = memoryview(raw.numpy())
        self.f.write(mv)
        self.header[name] = {
            "dtype": dt,
            "shape": shape,
            "data_offsets": [self.offset, self.offset + len(mv)],
        }
        self.offset += len(mv)
        self.digests[name] = hashlib.blake2b(mv, digest_size=16).hexdigest()
        return len(mv)

    def close(self, metadata: dict[str, str] | None = None) -> None:
        self.f.close()
        head = dict(self.header)
        head["__metadata__"] = {"format": "pt", **(metadata or {})}
        hb = json.dumps(head, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(self.path, "wb") as out, open(self.data_path, "rb") as src:
            out.write(struct.pack("<Q", len(hb)))
            out.write(hb)
            shutil.copyfileobj(src, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
        self.data_path.unlink()


class ShardedWriter:
    """Release/HF style: shards of at most shard_bytes, then renamed model-0000i-of-0000N + index json."""

    def __init__(self, root: Path, shard_bytes: int) -> None:
        self.root, self.limit = root, shard_bytes
        self.done: list[StreamingFile] = []
        self.cur: StreamingFile | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.cur is None or (
            self.cur.offset and self.cur.offset + t.numel() * t.element_size() > self.limit
        ):
            if self.cur is not None:
                self.done.append(self.cur)
            self.cur = StreamingFile(self.root / f"shard-{len(self.done):05d}.tmp")
        self.cur.add(name, t)

    def close(self) -> dict[str, dict[str, str]]:
        if self.cur is not None:
            self.done.append(self.cur)
        n = len(self.done)
        weight_map, digests, total = {}, {}, 0
        for i, sf in enumerate(self.done):
            final = self.root / (
                "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            )
            sf.close()
            sf.path.rename(final)
            total += sf.offset
            for k in sf.header:
                weight_map[k] = final.name
            digests[final.name] = sf.digests
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return digests


class RankWriter:
    """Inference layout: one model{r}-mp{N}.safetensors per rank."""

    def __init__(self, root: Path, mp: int) -> None:
        self.files = [StreamingFile(root / f"model{r}-mp{mp}.safetensors") for r in range(mp)]

    def add(self, rank: int, name: str, t: torch.Tensor) -> None:
        self.files[rank].add(name, t)

    def close(self) -> dict[str, dict[str, str]]:
        for sf in self.files:
            sf.close()
        return {sf.path.name: sf.digests for sf in self.files}


# ------------------------------------------------------------------------------------------ save
def output_config(cfg: ModelConfig, target: str, expert_dtype: str | None) -> dict:
    if target == "inference":
        return cfg.to_inference_json()
    if target == "fp8":
        c = cfg.replace(dtype="fp8", expert_dtype=expert_dtype, scale_fmt="ue8m0").to_hf_json()
        c["quantization_config"] = {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "scale_fmt": "ue8m0",
        }
        if expert_dtype:
            c["expert_dtype"] = expert_dtype
        return c
    return cfg.replace(dtype="bf16", expert_dtype=None, scale_fmt=None).to_hf_json()


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
    if target not in TARGETS:
        raise CheckpointError(f"unknown target '{target}'; choose one of {TARGETS}")
    dst = Path(dst)
    if os.path.lexists(dst) and not (overwrite and dst.is_dir() and not dst.is_symlink()):
        raise CheckpointError(f"{dst}: already exists; choose a new destination (nothing was written)")
    if mp < 1 or (target != "inference" and mp != 1):
        raise CheckpointError("--mp applies to --to inference only, and must be >= 1")
    if target == "inference" and cfg.n_routed_experts % mp:
        raise CheckpointError(f"--mp {mp} does not divide the {cfg.n_routed_experts} routed experts")
    extra_files = _extra_files(copy_from) if copy_from is not None else []
    with atomic_directory(dst, replace=overwrite) as tmp:
        specs = official_tensors(cfg)
        if target == "hf":
            specs = {k: v for k, v in specs.items() if not k.startswith("mtp.")}
        digests = _write(values, cfg, specs, tmp, target, mp, expert_dtype, shard_bytes)
        cfg_json = output_config(cfg, target, expert_dtype)
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
        for src in extra_files:
            with open_regular(src) as f_in, open(tmp / src.name, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 16 << 20)
        if verify:
            verify_checkpoint(tmp, digests, cfg if target != "hf" else None)
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


def _write(
    values: Iterable[tuple[str, Value]],
    cfg: ModelConfig,
    specs: dict[str, Spec],
    root: Path,
    target: str,
    mp: int,
    expert_dtype: str | None,
    shard_bytes: int,
) -> dict[str, dict[str, str]]:
    fmt = "fp8" if target == "fp8" else "keep" if target == "inference" else "bf16"
    seen: set[str] = set()
    if target == "inference":
        out = RankWriter(root, mp)
        n_local = cfg.n_routed_experts // mp
    else:
        out = ShardedWriter(root, shard_bytes)
    fused: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, v in values:
        if name not in specs:
            if target == "hf" and name.startswith("mtp."):
                continue
            raise CheckpointError(f"tensor '{name}' is not part of the config's checkpoint")
        seen.add(name)
        spec = specs[name]
        if target == "hf" and spec.role == EXPERT:
            prefix, j, w = _expert_parts(name)
            buf = fused.setdefault(prefix, {})
            buf[(j, w)] = v.dequantize(torch.bfloat16)
            if len(buf) == 3 * cfg.n_routed_experts:
                e = cfg.n_routed_experts
                gate_up = torch.stack([torch.cat([buf[(j, "w1")], buf[(j, "w3")]], 0) for j in range(e)])
                down = torch.stack([buf[(j, "w2")] for j in range(e)])
                hp = hf_name(prefix + ".x").rsplit(".", 1)[0]
                out.add(f"{hp}.gate_up_proj", gate_up)
                out.add(f"{hp}.down_proj", down)
                del fused[prefix]
            continue
        if fmt == "keep":
            stored = _keep_format(spec, name, v)
        else:
            stored = encode(spec, name, v, fmt, expert_dtype)
        for sname, t in stored.items():
            if target == "hf":
                out.add(hf_name(sname), t.long() if spec.role == INT else t)    # transformers: int64 table
            elif target == "inference":
                j = _expert_index(name)
                if j is not None:
                    out.add(j // n_local, sname, _inference_dtype(t))
                    continue
                dim = split_dim(sname)
                for r in range(mp):
                    if dim is None:
                        out.add(r, sname, t)
                    else:
                        if t.size(dim) % mp or (
                            sname.endswith(".weight")
                            and t.element_size() == 1
                            and mp > 1
                            and (t.size(dim) // mp) % fm.FP8_BLOCK
                        ):
                            raise CheckpointError(
                                f"tensor '{sname}' {list(t.shape)} cannot be split into {mp} "
                                f"ranks on dim {dim}"
                            )
                        out.add(r, sname, t.chunk(mp, dim)[r].contiguous())
            else:
                out.add(sname, t)
    missing = [n for n in specs if n not in seen]
    if missing or fused:
        raise CheckpointError(f"source is missing tensor '{missing[0] if missing else next(iter(fused))}'")
    return out.close()


def _expert_parts(name: str) -> tuple[str, int, str]:
    head, j, w, _ = name.rsplit(".", 3)
    return head, int(j), w


def _expert_index(name: str) -> int | None:
    from .names import expert_index

    return expert_index(name)


def _inference_dtype(t: torch.Tensor) -> torch.Tensor:
    """The official converter stores packed MXFP4 experts as float4_e2m1fn_x2."""
    if t.dtype == torch.int8 and fm.HAS_FP4:
        return t.view(torch.float4_e2m1fn_x2)
    return t


def _keep_format(spec: Spec, name: str, v: Value) -> dict[str, torch.Tensor]:
    """Inference layout: stored formats kept as they are; wo_a dequantized to BF16 (official converter)."""
    if spec.role == INT:
        return {name: v.data.to(torch.int32)}
    if spec.role == F32:
        return {name: v.dequantize(torch.float32)}
    if v.fmt == "fp8" and not name.endswith("attn.wo_a.weight"):
        return {name: fm.fp8_from_bytes(v.data), scale_name(name): _scale_out(v.scale)}
    if v.fmt == "fp4":
        return {name: fm.packed_from_bytes(v.data), scale_name(name): fm.e8m0_from_bytes(v.scale)}
    return {name: v.dequantize(torch.bfloat16)}


def _scale_out(s: torch.Tensor) -> torch.Tensor:
    return s if s.dtype in (torch.float32, torch.bfloat16, torch.float16) else fm.e8m0_from_bytes(s)


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
) -> Path:
    """`dsv4 convert`: read any layout, write the target one (see save).

    --to fp8: experts become MXFP4 when expert_dtype is "fp4", or (unless force_expert_dtype) when the
    source experts or config are MXFP4; otherwise FP8.
    """
    p = plan(src, layout=layout)
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
