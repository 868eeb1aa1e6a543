"""Safetensors files read and written byte by byte: headers without payloads, tensors as raw bits.

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets},
"__metadata__": {...}}, then the payload. Reading the header alone gives the inventory (`dsv4 inspect`)
and, checked against the file size, detects truncated or corrupt files before any tensor is used.
Tensors come back with their stored bits untouched: exotic dtypes (F8_E8M0, F8_E4M3, F4) are views
of the bytes, or plain uint8 where this torch lacks the dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..safe_paths import open_regular

# safetensors dtype -> (bits per stored element, torch dtype name or None)
DTYPES: dict[str, tuple[int, str | None]] = {
    "F64": (64, "float64"),
    "F32": (32, "float32"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I64": (64, "int64"),
    "I32": (32, "int32"),
    "I16": (16, "int16"),
    "I8": (8, "int8"),
    "U8": (8, "uint8"),
    "BOOL": (8, "bool"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "F4": (4, "float4_e2m1fn_x2"),
    "U16": (16, "uint16"),
    "U32": (32, "uint32"),
    "U64": (64, "uint64"),
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]  # as stored in the header (F4: logical fp4 elements)
    begin: int  # absolute byte offsets in the file
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def torch_dtype(st_dtype: str) -> torch.dtype | None:
    name = DTYPES[st_dtype][1]
    return getattr(torch, name, None) if name else None


def st_dtype(dtype: torch.dtype) -> str:
    for k, (_, name) in DTYPES.items():
        if name and getattr(torch, name, None) == dtype:
            return k
    raise ValueError(f"no safetensors dtype for {dtype}")


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one file's header; returns ({name: TensorInfo}, metadata). Reads no payload."""
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: corrupt safetensors header (header length {n}, file size {size})")
        raw = f.read(n)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also over-long integers
        raise CheckpointError(f"{path}: corrupt safetensors header ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, v in obj.items():
        try:
            dt, shape, (b, e) = v["dtype"], tuple(v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}'") from None
        if not all(_is_count(x) for x in (*shape, b, e)):
            raise CheckpointError(
                f"{path}: corrupt header entry for tensor '{name}' (shape and data_offsets must be "
                "non-negative integers)"
            )
        if not isinstance(dt, str) or dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {str(dt)[:40]}")
        if dt == "F4" and (not shape or shape[-1] % 2):
            raise CheckpointError(
                f"{path}: tensor '{name}' is F4 with shape {list(shape)}: the last "
                "dimension must be even (two values per byte)"
            )
        want = math.prod(shape) * DTYPES[dt][0]
        if not (0 <= b <= e) or (e - b) * 8 != want:
            raise CheckpointError(
                f"{path}: tensor '{name}' ({dt} {list(shape)}) has {e - b} bytes, expected {want // 8}: corrupt file"
            )
        if base + e > size:
            raise CheckpointError(
                f"{path}: truncated file: tensor '{name}' ends at byte {base + e}, file has {size} bytes"
            )
        out[name] = TensorInfo(name, dt, shape, base + b, base + e, path)
        spans.append((b, e, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: corrupt file: tensors '{n0}' and '{n1}' overlap")
    return out, meta


def read_tensor(info: TensorInfo, handle=None) -> torch.Tensor:
    """The tensor's stored bits, shaped as stored (F4 -> [.., n/2] float4_e2m1fn_x2 or uint8 bytes)."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    own = handle is None
    if own:
        f = open_regular(info.file)
    else:
        f = handle
    try:
        f.seek(info.begin)
        got = f.readinto(memoryview(buf.numpy()))
    finally:
        if own:
            f.close()
    if got != info.nbytes:
        raise CheckpointError(f"{info.file}: truncated file while reading tensor '{info.name}'")
    shape = list(info.shape)
    if info.dtype == "F4":
        shape[-1] //= 2
    dt = torch_dtype(info.dtype)
    if dt is None:  # exotic dtype this torch lacks: the raw bytes
        return buf.view(shape) if DTYPES[info.dtype][0] <= 8 else buf
    return buf.view(dt).view(shape)


def iter_file(infos: dict[str, TensorInfo]) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """Tensors of one file in payload order (sequential reads)."""
    items = sorted(infos.values(), key=lambda t: t.begin)
    if not items:
        return
    with open_regular(items[0].file) as f:
        for info in items:
            yield info, read_tensor(info, f)


def write_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write tensors (any dtype, exotic ones as their bits) to one safetensors file; returns bytes written."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    blobs = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        dt = st_dtype(t.dtype)
        shape = list(t.shape)
        if dt == "F4":
            shape[-1] *= 2
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
        n = raw.numel()
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
        blobs.append(raw)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(memoryview(raw.reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(hb) + offset
