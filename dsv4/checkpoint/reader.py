"""Read any layout: scan headers, validate everything against the config, then stream tensor by tensor.

`plan()` reads only headers. It maps every stored tensor to its official name, checks that each expected
tensor is present exactly once with an allowed dtype and shape, that each quantized weight has its block
scale with the right shape (FP8: ceil(out/128) x ceil(in/128); MXFP4: out x in/32, packed out x in/2),
and that nothing unexpected is left. All problems are collected; the first is the error message.

`stream()` then yields one official tensor at a time (weight + scale, inference pieces reassembled),
reading each payload once, so at most one tensor is in flight besides what the consumer keeps.
Non-finite values (NaN/inf floats, NaN FP8 codes, NaN E8M0 scales), block scales whose dequantized
weights would overflow, and integer tables with out-of-range entries (a tid2eid expert id >=
n_routed_experts) stop the stream with an error naming the tensor and file, before any compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import formats as fm
from ..config import ModelConfig
from ..safe_paths import open_regular
from . import layouts
from .inventory import Entry, Piece, Plan, Problems
from .layouts import find_files, without_mtp
from .names import EXPERT, F32, INT, Spec, canonical, expert_index
from .safetensors_io import FLOAT_DTYPES, INT_DTYPES, CheckpointError, TensorInfo, read_header, read_tensor
from .storage import Value

FP8_DTYPES = {"F8_E4M3"}
FP4_DTYPES = {"I8", "U8", "F4"}
E8M0_DTYPES = {"F8_E8M0", "U8"}
FP8_SCALE_DTYPES = E8M0_DTYPES | {"F32", "BF16", "F16"}


def _fmt_of(dtype: str) -> str:
    if dtype in FP8_DTYPES:
        return "fp8"
    if dtype in FP4_DTYPES:
        return "fp4"
    if dtype in FLOAT_DTYPES:
        return "float"
    if dtype in INT_DTYPES:
        return "int"
    return "other"


def _stored_shape(info: TensorInfo) -> tuple[int, ...]:
    """The shape as bytes hold it: an F4 header counts fp4 elements, the packed tensor has half."""
    if info.dtype == "F4":
        return (*info.shape[:-1], info.shape[-1] // 2)
    return info.shape


def _piece_shape(full: tuple[int, ...], dim: int | None, mp: int) -> tuple[int, ...]:
    if dim is None or mp == 1:
        return full
    s = list(full)
    s[dim] //= mp
    return tuple(s)


def scan(path: str | Path) -> tuple[str, list[Path], int, dict[Path, dict[str, TensorInfo]]]:
    """Headers of every file (no payloads) and the detected layout's name."""
    rank_files, files, mp = find_files(path)
    headers = {f: read_header(f)[0] for f in files}
    names = [n for h in headers.values() for n in h]
    return layouts.detect(names, rank_files).name, files, mp, headers


def plan(
    path: str | Path, cfg: ModelConfig | None = None, layout: str | None = None, overrides: dict | None = None
) -> Plan:
    """Validate a checkpoint directory against cfg from its headers alone; raise CheckpointError.

    Without cfg, the directory's config.json is read with the layout's semantics (`Layout.semantics`) and
    then `overrides` applied, before validation."""
    root = Path(path)
    found, files, mp, headers = scan(root)
    lay = layouts.get(found)
    if layout is not None:
        asked = layouts.get(layout)
        if asked.rank_files != lay.rank_files:
            raise CheckpointError(f"{root}: --layout {layout} given, but the files are a {found} checkpoint")
        lay = asked
    warnings: list[str] = []
    if cfg is None:
        cfg, warnings = lay.configure(lay.load_config(root, overrides), [n for h in headers.values() for n in h], root)
    probs = Problems()
    weights: dict[str, list[Piece]] = {}
    scales: dict[str, list[Piece]] = {}
    fused: dict[str, tuple[Piece, tuple[str, ...]]] = {}
    ignored: list[TensorInfo] = []
    for index, f in enumerate(files):
        for info in sorted(headers[f].values(), key=lambda t: t.begin):
            c = canonical(info.name)
            piece = Piece(info, lay.piece_rank(index))
            if c.kind == "ignored":
                ignored.append(info)
            elif c.kind == "fused":
                if c.name in fused:
                    probs.add(f"tensor {piece.where()} is stored twice (also {fused[c.name][0].where()})")
                fused[c.name] = (piece, c.parts)
            else:
                (scales if c.kind == "scale" else weights).setdefault(c.name, []).append(piece)

    expected = lay.tensors(cfg, root)
    has_mtp = any(n.startswith("mtp.") for n in weights)
    absent = lay.mtp_absent(root) if cfg.n_mtp_layers and not has_mtp else None
    if absent is not None:
        warnings.append(absent)
        cfg = without_mtp(cfg)
        expected = lay.tensors(cfg, root)

    entries: dict[str, Entry] = {}
    covered: set[str] = set()
    for name, (piece, parts) in fused.items():
        prefix = name.rsplit(".", 1)[0]  # layers.i.ffn.experts
        e, inter, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
        want = (e, 2 * inter, d) if parts == ("w1", "w3") else (e, d, inter)
        if f"{prefix}.0.w1.weight" not in expected:
            probs.add(
                f"unexpected tensor {piece.where()}: no such layer in config.json "
                f"({cfg.n_layers} layers); do config and weights match?"
            )
            continue
        if piece.info.dtype not in FLOAT_DTYPES:
            probs.add(
                f"{piece.info.file}: tensor '{piece.info.name}' has dtype {piece.info.dtype}, "
                "expected a float dtype (quantized fused experts are not supported)"
            )
        if piece.info.shape != want:
            probs.add(
                f"{piece.info.file}: tensor '{piece.info.name}' has shape {list(piece.info.shape)}, "
                f"expected {list(want)}"
            )
        entries[name] = Entry(name, Spec(want, EXPERT), "float", [piece], parts=parts)
        covered.update(f"{prefix}.{j}.{w}.weight" for j in range(e) for w in parts)

    for name, spec in expected.items():
        if name in covered:
            if name in weights:
                probs.add(f"tensor {weights[name][0].where()} is stored twice (also in a fused expert tensor)")
                weights.pop(name)
            continue
        pieces = weights.pop(name, None)
        if not pieces:
            probs.add(f"{root}: missing tensor '{name}' ({_describe(spec)}) - no file in the checkpoint has it")
            continue
        sc = scales.pop(name[: -len(".weight")] + ".scale", []) if name.endswith(".weight") else []
        entry = _check_entry(name, spec, pieces, sc, lay, mp, probs)
        if entry is not None:
            entries[name] = entry

    for name, pieces in list(weights.items()) + list(scales.items()):
        p = pieces[0]
        hint = ""
        if name.startswith(("layers.", "mtp.")):
            hint = f"; config.json has {cfg.n_layers} layers, {cfg.n_mtp_layers} MTP - do config and weights match?"
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in expected:
            probs.add(f"unexpected tensor {p.where()}: a block scale for a weight that is not quantized")
        else:
            probs.add(f"unexpected tensor {p.where()} (official name '{name}'){hint}")
    probs.raise_if_any()
    return Plan(root, lay.name, cfg, files, mp, entries, ignored, headers, warnings)


def for_loading(p: Plan, mtp: bool = True) -> Plan:
    """The plan a model is built from: its layout may refuse what dsv4 cannot run (`Unsupported`);
    mtp=False drops the MTP block and its tensors."""
    return layouts.get(p.layout).prepare_load(p, mtp)


def restrict_experts(p: Plan, lo: int, hi: int) -> Plan:
    """The plan of one expert-parallel rank: every routed expert outside [lo, hi) left out (never read), a
    fused expert tensor [E, ...] (transformers layout) narrowed to its rows [lo, hi) - a contiguous byte
    range of the file, so only those bytes are read. Everything else unchanged."""
    entries: dict[str, Entry] = {}
    for name, e in p.entries.items():
        if e.parts:
            entries[name] = dataclasses.replace(
                e, spec=Spec((hi - lo, *e.spec.shape[1:]), e.spec.role), weight=[_rows(pc, lo, hi) for pc in e.weight]
            )
            continue
        j = expert_index(name)
        if j is None or lo <= j < hi:
            entries[name] = e
    return dataclasses.replace(p, entries=entries)


def _rows(piece: Piece, lo: int, hi: int) -> Piece:
    """Rows [lo, hi) of a stored tensor along its first dim (row-major: one byte range)."""
    info = piece.info
    row = info.nbytes // info.shape[0]
    part = dataclasses.replace(
        info, shape=(hi - lo, *info.shape[1:]), begin=info.begin + lo * row, end=info.begin + hi * row
    )
    return dataclasses.replace(piece, info=part)


def _describe(spec: Spec) -> str:
    kinds = {F32: "F32", INT: "integer", EXPERT: "float, FP8 or MXFP4 + scale"}
    return f"{kinds.get(spec.role, 'float or FP8 + scale')} {list(spec.shape)}"


def _check_entry(
    name: str,
    spec: Spec,
    pieces: list[Piece],
    scales: list[Piece],
    lay: layouts.Layout,
    mp: int,
    probs: Problems,
) -> Entry | None:
    n0 = len(probs.items)
    split = lay.split_dim(name)
    pieces, scales = lay.gather(name, spec, pieces, scales, mp, probs)
    replicated = lay.replicated(name)
    fmts = {_fmt_of(p.info.dtype) for p in pieces}
    fmt = fmts.pop() if len(fmts) == 1 else "mixed"
    want_piece = _piece_shape(spec.shape, split, mp)
    for p in pieces:
        dt, where = p.info.dtype, f"{p.info.file}: tensor '{p.info.name}'"
        ok = {INT: fmt == "int", F32: fmt == "float", EXPERT: fmt in ("float", "fp8", "fp4")}.get(
            spec.role, fmt in ("float", "fp8")
        )
        if not ok:
            probs.add(f"{where} has dtype {dt}, expected {_describe(spec)}")
            continue
        shape = _stored_shape(p.info)
        want = want_piece if fmt != "fp4" else (*want_piece[:-1], want_piece[-1] // 2)
        if fmt == "fp4" and want_piece[-1] % fm.FP4_BLOCK:
            probs.add(f"{where}: MXFP4 needs the input dim to be a multiple of 32, got {want_piece}")
        if shape != want:
            what = " (packed FP4: two values per byte)" if fmt == "fp4" else ""
            probs.add(f"{where} has shape {list(shape)}, expected {list(want)}{what}")
    if len(probs.items) > n0:
        return None
    if fmt in ("fp8", "fp4"):
        if not scales:
            p = pieces[0]
            probs.add(
                f"{p.info.file}: tensor '{p.info.name}' is {p.info.dtype} but has no block scale "
                f"'{name[: -len('.weight')]}.scale' (a quantized weight without its scale cannot be used)"
            )
            return None
        if len(scales) != len(pieces):
            probs.add(f"block scale of '{name}' has {len(scales)} pieces for {len(pieces)} weight pieces")
            return None
        for s in scales:
            dt, where = s.info.dtype, f"{s.info.file}: tensor '{s.info.name}'"
            wshape = _piece_shape(spec.shape, split, mp)
            if fmt == "fp8":
                want_s, ok_dt = fm.fp8_scale_shape(*wshape), dt in FP8_SCALE_DTYPES
                if split is not None and mp > 1 and wshape[split] % fm.FP8_BLOCK:
                    probs.add(f"{where}: FP8 weight piece {list(wshape)} is not split on a 128-block boundary")
            else:
                want_s, ok_dt = (wshape[0], wshape[1] // fm.FP4_BLOCK), dt in E8M0_DTYPES
            if not ok_dt:
                probs.add(
                    f"{where} has dtype {dt}, expected an E8M0 block scale (F8_E8M0)"
                    + (" or F32" if fmt == "fp8" else "")
                )
            elif s.info.shape != want_s:
                probs.add(
                    f"{where} has shape {list(s.info.shape)}, expected {list(want_s)} "
                    f"(block scale of {fmt.upper()} weight {list(wshape)})"
                )
    elif scales:
        probs.add(
            f"unexpected tensor {scales[0].where()}: a block scale for '{name}', "
            f"which is stored unquantized ({pieces[0].info.dtype})"
        )
    if len(probs.items) > n0:
        return None
    if replicated:  # every rank holds a full copy (all checked above); rank 0's is read
        pieces, scales = pieces[:1], scales[:1]
    return Entry(name, spec, fmt, pieces, scales, split)


# ------------------------------------------------------------------------------------------- stream
class _Handles:
    def __init__(self) -> None:
        self.open: dict[Path, object] = {}

    def read(self, info: TensorInfo) -> torch.Tensor:
        f = self.open.get(info.file)
        if f is None:
            if len(self.open) >= 8:
                self.open.pop(next(iter(self.open))).close()
            f = self.open[info.file] = open_regular(info.file)
        return read_tensor(info, f)

    def close(self) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()


def _check_finite(entry: Entry, v: Value) -> None:
    where = f"tensor '{entry.weight[0].info.name}' in {entry.weight[0].info.file}"
    if v.fmt == "float" and not bool(torch.isfinite(v.data).all()):
        n = int((~torch.isfinite(v.data)).sum())
        raise CheckpointError(f"{where} has {n} non-finite values (NaN/inf)")
    if v.fmt == "fp8" and bool(((fm.as_fp8_bytes(v.data) & 0x7F) == 0x7F).any()):
        raise CheckpointError(f"{where} has FP8 NaN codes")
    if v.scale is not None:
        swhere = f"block scale '{entry.scale[0].info.name}' in {entry.scale[0].info.file}"
        if v.scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
            if not bool(torch.isfinite(v.scale).all()):
                raise CheckpointError(f"{swhere} has non-finite values")
        elif bool((fm.as_e8m0_bytes(v.scale) == fm.E8M0_NAN).any()):
            raise CheckpointError(f"{swhere} has E8M0 NaN bytes (255)")
        _check_dequantized_range(where, swhere, v)


# the largest magnitude a dequantized weight may have: bf16's (the narrowest load dtype), so the weights
# stay finite in every dtype the model computes in
WEIGHT_LIMIT = float(torch.finfo(torch.bfloat16).max)
_CODE_MAX = {"fp8": fm.FP8_MAX, "fp4": 6.0}  # largest E4M3 / E2M1 magnitude


def _scale_fp64(v: Value) -> torch.Tensor:
    s = v.scale
    if s.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return s.double()
    return fm.e8m0_decode(s).double()


def _check_dequantized_range(where: str, swhere: str, v: Value) -> None:
    """Refuse block scales that turn weights into inf (or beyond bf16's range) when dequantized.

    Only blocks whose scale times the format's largest code exceeds the limit can overflow; those
    (none in a sane checkpoint) are dequantized exactly to see whether the stored codes reach it."""
    worst = float(_scale_fp64(v).abs().max()) * _CODE_MAX[v.fmt] if v.scale.numel() else 0.0
    if worst <= WEIGHT_LIMIT:
        return
    w = v.dequantize(torch.float32)
    bad = ~torch.isfinite(w) | (w.abs() > WEIGHT_LIMIT)
    if bool(bad.any()):
        raise CheckpointError(
            f"{swhere}: scales up to {float(_scale_fp64(v).abs().max()):.3g} make {int(bad.sum())} values of "
            f"{where} overflow when dequantized (beyond {WEIGHT_LIMIT:.3g}); the scale bytes are corrupt"
        )


def _check_table(entry: Entry, v: Value, cfg: ModelConfig) -> None:
    """Integer tables index other tensors: every tid2eid entry must name an existing routed expert."""
    if not entry.name.endswith("tid2eid"):
        return
    t = v.data
    n = cfg.n_routed_experts
    bad = (t < 0) | (t >= n)
    if bool(bad.any()):
        first = int(t[bad].flatten()[0])
        raise CheckpointError(
            f"tensor '{entry.weight[0].info.name}' in {entry.weight[0].info.file} has {int(bad.sum())} "
            f"expert ids outside [0, {n}) (n_routed_experts), e.g. {first}"
        )


def stream(p: Plan, progress: bool | None = None) -> Iterator[tuple[Entry, Value]]:
    """Yield (entry, value) for every entry, ordered by file and offset; one tensor in flight."""
    order = sorted(p.entries.values(), key=lambda e: (p.files.index(e.weight[0].info.file), e.weight[0].info.begin))
    handles = _Handles()
    bar = None
    if progress or (progress is None and len(p.files) > 1):
        from ..progress import bar as progress_bar

        bar = progress_bar(p.nbytes, f"loading {p.root.name}", unit="B", unit_scale=True)  # (a terminal only)
    try:
        for e in order:
            data = [handles.read(w.info) for w in e.weight]
            scale = [handles.read(s.info) for s in e.scale]
            if e.split is not None and len(data) > 1:
                if e.fmt in ("fp8", "fp4"):
                    data = [fm.as_fp8_bytes(d) if e.fmt == "fp8" else fm.as_packed_bytes(d) for d in data]
                    scale = [s.view(torch.uint8) if s.element_size() == 1 else s for s in scale]
                data = [torch.cat(data, e.split)]
                scale = [torch.cat(scale, e.split)] if scale else []
            v = Value(e.fmt, data[0], scale[0] if scale else None)
            _check_finite(e, v)
            if e.fmt == "int":
                _check_table(e, v, p.cfg)
            yield e, v
            if bar is not None:
                bar.update(e.nbytes)
    finally:
        handles.close()
        if bar is not None:
            bar.close()
