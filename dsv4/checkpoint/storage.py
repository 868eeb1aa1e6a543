"""How tensors are stored: a `Value` as read, its encoding into a storage format, and the streaming
safetensors writers the layouts put their files through (one shard set, or one file per rank).

Below the layouts (`layouts/`), the reader and the writer: it knows formats, not layouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import formats as fm
from .names import EXPERT, F32, INT, LINEAR, Spec, scale_name
from .safetensors_io import st_dtype


@dataclass
class Value:
    """A tensor as stored: float/int data, or quantized data with its block scale (bits untouched)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt == "fp8":
            return fm.dequantize_fp8(self.data, self.scale, dtype)
        if self.fmt == "fp4":
            return fm.dequantize_mxfp4(self.data, self.scale, dtype)
        if self.fmt == "int":
            return self.data
        return self.data.to(dtype)


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
    quant = (target == "fp8" and spec.role in (LINEAR, EXPERT)) or (spec.role == EXPERT and expert_dtype == "fp4")
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
        if self.cur is None or (self.cur.offset and self.cur.offset + t.numel() * t.element_size() > self.limit):
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
            final = self.root / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
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


# ------------------------------------------------------------------------------------------ keep
def inference_dtype(t: torch.Tensor) -> torch.Tensor:
    """The official converter stores packed MXFP4 experts as float4_e2m1fn_x2."""
    if t.dtype == torch.int8 and fm.HAS_FP4:
        return t.view(torch.float4_e2m1fn_x2)
    return t


def keep_format(spec: Spec, name: str, v: Value) -> dict[str, torch.Tensor]:
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


__all__ = ["Value", "encode", "keep_format", "StreamingFile", "ShardedWriter", "RankWriter"]
