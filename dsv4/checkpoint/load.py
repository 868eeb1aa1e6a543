"""`load_pretrained(DIR)`: any layout -> a DeepSeekV4 model, validated before a byte of payload is used.

Steps: read the config; plan (headers only: layout, names, shapes, dtypes, scales - every problem found
up front); build the model on the meta device (only this rank's routed experts under expert parallelism;
empty kept-quantized modules where weights stay FP8 / FP4) and materialize it once on the target device,
without random init; stream tensor by tensor into the parameters (dequantized to the parameter dtype,
or kept quantized); check that every parameter was written;
record which modules were stored FP8 / FP4 and apply the config's quant_mode to them (`dsv4.model.quant`).
Any error raises and no model is returned.

Semantics by layout: a Hugging Face transformers directory ("hf" layout) computes as transformers does,
which simulates no quantization-aware training: fp8_kv_sim and fp4_indexer_sim default to off (and
dimensions those simulations could not block then load). Every other layout gets the official model's
semantics. Keyword arguments override either.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .. import defaults
from .. import formats as fm
from ..config import ModelConfig
from .hub import resolve_model_path
from .int8_load import Int8Requantizer
from .inventory import Entry
from .names import to_model
from .quantized import QuantExperts, QuantLinear, Stored
from .reader import Plan, Value, for_loading, plan, restrict_experts, stream
from .safetensors_io import FLOAT_DTYPES, CheckpointError

log = logging.getLogger("dsv4.checkpoint")


def load_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    layout: str | None = None,
    config: ModelConfig | None = None,
    keep_quantized: bool = False,
    progress: bool | None = None,
    quant_mode: str | None = None,
    fp8_kv_sim: bool | None = None,
    fp4_indexer_sim: bool | None = None,
    mtp: bool = True,
    rank: int = 0,
    world_size: int = 1,
):
    """Load a checkpoint directory (release, inference MP shards or HF transformers) into DeepSeekV4.

    path: a directory, or a Hugging Face Hub id `org/name[@revision]` (fetched into the Hub cache; see hub.py).

    dtype: parameter dtype of the weights that are not fp32 by design (norms, mHC, head stay fp32);
    dtype and device default to `dsv4.defaults` (fp32, cpu), as the command line's --dtype / --device.
    keep_quantized: FP8 linears and FP8/MXFP4 experts stay quantized (dequantized per block at compute
    time) instead of being dequantized to `dtype` on load.
    quant_mode: "w8a8" (the official numerics, the default) or "w8a16" for the weights stored as FP8 /
    FP4, or "int8": every linear and routed expert a release stores quantized is requantized at load to
    per-row INT8 and runs INT8 x INT8 (`dsv4.model.int8`; from any storage format, BF16 included; the
    weights are not also kept quantized). fp8_kv_sim / fp4_indexer_sim: the QAT simulations. None = the
    config's value, or for a transformers ("hf" layout) directory transformers' semantics (both
    simulations off).
    mtp: False builds the model without its draft (the MTP block, or a DSpark draft) and leaves the
    checkpoint's `mtp.*` tensors unread.
    rank, world_size: expert parallelism (`dsv4.parallel`). Every MoE layer of the model holds only the
    routed experts [rank*E/N, (rank+1)*E/N) and only their tensors are read (of a transformers checkpoint's
    fused expert tensors, only those rows); everything else is read whole. No process group is needed:
    `dsv4.parallel.parallelize_for_serving` then connects the ranks.

    The model is built on the meta device and materialized once at its final size (quantized weights as
    their stored bytes, this rank's experts only), then filled tensor by tensor: host memory holds the
    model's share plus one tensor in flight. `model.checkpoint_plan` records what was read.
    """
    from ..model import DeepSeekV4
    from ..model.moe import expert_slice
    from ..model.quant import set_quant_mode

    asked = {
        k: v
        for k, v in (("quant_mode", quant_mode), ("fp8_kv_sim", fp8_kv_sim), ("fp4_indexer_sim", fp4_indexer_sim))
        if v is not None
    }
    path = resolve_model_path(path)
    p = plan(path, config.replace(**asked) if config is not None and asked else config, layout, overrides=asked)
    p = for_loading(p, mtp)
    for w in p.warnings:
        log.warning(w)
    experts = None
    if world_size != 1 or rank != 0:
        try:
            experts = expert_slice(p.cfg.n_routed_experts, rank, world_size)
        except ValueError as e:
            raise CheckpointError(f"{p.root}: {e}") from None
        p = restrict_experts(p, *experts)
    dtype = dtype or defaults.default_dtype()
    device = torch.device(device or defaults.DEVICE)
    int8 = p.cfg.quant_mode == "int8"
    keep_quantized = keep_quantized and not int8
    model = DeepSeekV4(p.cfg, dtype=dtype, device="meta")
    if experts is not None:
        _narrow_experts(model, *experts, dtype)
    if keep_quantized:
        _place_quantized(model, p, dtype)
    model.to_empty(device=device)
    stats = load_into(model, p, dtype=dtype, keep_quantized=keep_quantized, progress=progress, int8=int8)
    try:
        set_quant_mode(model)
    except ValueError as e:
        raise CheckpointError(f"{p.root}: {e}") from None
    model.loaded_from(
        {
            "path": str(p.root),
            "layout": p.layout,
            "files": len(p.files),
            "mp": p.mp,
            "warnings": list(p.warnings),
            "rank": rank,
            "world_size": world_size,
            "experts": list(experts) if experts is not None else [0, p.cfg.n_routed_experts],
            "read": stats,
        }
    )
    return model.eval()


_QUANT = ("fp8", "fp4")


def _narrow_experts(model: nn.Module, lo: int, hi: int, dtype: torch.dtype) -> None:
    """On the meta model: every MoE layer's routed experts become experts [lo, hi) only."""
    from ..model.layers import building_on
    from ..model.moe import Experts, MoE

    for path, moe in list(model.named_modules()):
        if isinstance(moe, MoE):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device("meta"), building_on("meta"):
                    model.set_submodule(f"{path}.experts", Experts(model.cfg, hi - lo, lo))
            finally:
                torch.set_default_dtype(prev)


def _stored(e: Entry) -> Stored:
    """The stored form of a quantized official weight, from its validated spec and scale header."""
    o, i = e.spec.shape
    q = (o, i) if e.fmt == "fp8" else (o, i // 2)
    scale = fm.fp8_scale_shape(o, i) if e.fmt == "fp8" else (o, i // fm.FP4_BLOCK)
    return Stored(e.fmt, q, tuple(scale), e.scale[0].info.dtype in FLOAT_DTYPES)


def _place_quantized(model: nn.Module, p: Plan, dtype: torch.dtype) -> None:
    """On the meta model: put an empty QuantLinear / QuantExperts where the checkpoint stores FP8 / FP4
    weights, so that materializing allocates their stored bytes only (never a dequantized copy)."""
    experts: dict[str, dict[str, set]] = {}
    for e in p.entries.values():
        if e.parts:
            continue
        mname, j = to_model(e.name)
        path, _, leaf = mname.rpartition(".")
        if j is not None:
            experts.setdefault(path, {}).setdefault(leaf, set()).add(_stored(e) if e.fmt in _QUANT else e.fmt)
        elif e.fmt in _QUANT and leaf == "weight":
            mod = model.get_submodule(path)
            if isinstance(mod, nn.Linear):
                compute = mod.weight.dtype if mod.weight.dtype == torch.float32 else dtype
                model.set_submodule(path, QuantLinear(_stored(e), compute, "meta"))
    for path, parts in experts.items():
        kinds = {k for ks in parts.values() for k in ks}
        if all(isinstance(k, str) for k in kinds):
            continue  # stored as floats: a float layer
        fmts = {k.fmt if isinstance(k, Stored) else k for k in kinds}
        if len(fmts) > 1 or any(len(ks) > 1 for ks in parts.values()):
            raise CheckpointError(
                f"{p.root}: experts of '{path}' mix storage formats or shapes; load without keep_quantized"
            )
        stored = {w: next(iter(ks)) for w, ks in parts.items()}
        model.set_submodule(path, QuantExperts(model.get_submodule(path), fmts.pop(), dtype, stored, "meta"))


def _float_names(model: nn.Module) -> dict[str, int]:
    """{model tensor name as a checkpoint names it: parts to load} - a kept-quantized module counts as the
    float weights it replaces; stacked routed experts take one part per expert held."""
    out: dict[str, int] = {}
    for path, mod in model.named_modules():
        pre = f"{path}." if path else ""
        if isinstance(mod, QuantLinear):
            out[f"{pre}weight"] = 1
            continue
        if isinstance(mod, QuantExperts):
            out.update({f"{pre}{w}": mod.n for w in ("w1", "w2", "w3")})
            continue
        for name, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if t is None:
                continue
            stacked = name in ("w1", "w2", "w3") and t.dim() == 3 and pre.endswith("experts.")
            out[f"{pre}{name}"] = t.size(0) if stacked else 1
    return out


@torch.no_grad()
def load_into(
    model: nn.Module,
    p: Plan,
    *,
    dtype: torch.dtype = torch.bfloat16,
    keep_quantized: bool = False,
    progress: bool | None = None,
    int8: bool = False,
) -> dict[str, int]:
    """Stream a validated plan into an existing model; every model tensor must be written exactly once.

    Kept-quantized modules already in the model (`load_pretrained` places them) are filled in place;
    with keep_quantized, float modules whose weights are stored FP8 / FP4 are swapped for them here.
    Routed experts go to the row of the expert's id minus the layer's `offset` (expert parallelism).
    int8: the weights INT8 mode covers are requantized to per-row INT8 as they stream in
    (`dsv4.checkpoint.int8_load`).
    Records the storage format of every module a quantized weight was written into (`dsv4.model.quant.
    mark_stored`). Returns what was read: {"tensors": official tensors, "bytes": stored bytes}."""
    from ..model.quant import mark_stored

    want = _float_names(model)
    names = {to_model(n)[0] for n in p.entries if not p.entries[n].parts}
    for e in p.entries.values():
        if e.parts:
            names.update(f"{e.name.rsplit('.', 1)[0]}.{w}" for w in e.parts)
    if names != set(want):
        extra, lost = sorted(names - set(want)), sorted(set(want) - names)
        raise RuntimeError(
            f"checkpoint names and model parameters disagree: not in the model {extra[:5]}, "
            f"not in the checkpoint {lost[:5]}"
        )
    sd = model.state_dict(keep_vars=True)
    written: dict[str, int] = {}
    swapped: dict[str, QuantExperts] = {}
    stored: dict[str, set[str]] = {}  # module -> storage formats of the weights written into it
    stats = {"tensors": 0, "bytes": 0}
    requant = Int8Requantizer(model) if int8 else None
    for e, v in stream(p, progress):
        stats["tensors"] += 1
        stats["bytes"] += e.nbytes
        if e.parts:  # fused HF experts [E, 2I, D] / [E, D, I]
            prefix = e.name.rsplit(".", 1)[0]
            for w, chunk in zip(e.parts, v.data.chunk(len(e.parts), dim=1)):
                name = f"{prefix}.{w}"
                if requant is None or not requant.take_stacked(name, chunk, v.fmt):
                    sd[name].copy_(chunk)
                written[name] = sd[name].size(0)
            continue
        mname, j = to_model(e.name)
        path, _, leaf = mname.rpartition(".")
        stored.setdefault(path, set()).add(v.fmt)
        mod = model.get_submodule(path)
        if isinstance(mod, QuantLinear) and j is None:
            mod.load_(v)
            written[mname] = 1
            continue
        if isinstance(mod, QuantExperts) or (keep_quantized and j is not None and v.fmt in _QUANT):
            qe = mod if isinstance(mod, QuantExperts) else swapped.get(path)
            if qe is None:
                qe = swapped[path] = QuantExperts(mod, v.fmt, dtype)
            if qe.fmt != v.fmt:
                raise CheckpointError(
                    f"{p.root}: experts of '{mname}' mix storage formats; load without keep_quantized"
                )
            qe.put(leaf, j - qe.offset, v, sd[mname].device if mname in sd else None)
            written[mname] = written.get(mname, 0) + 1
            continue
        v = Value(v.fmt, v.data.to(sd[mname].device), None if v.scale is None else v.scale.to(sd[mname].device))
        if requant is not None and requant.take(mname, None if j is None else j - getattr(mod, "offset", 0), v):
            written[mname] = written.get(mname, 0) + 1
            continue
        if keep_quantized and v.fmt in _QUANT and j is None and _swap_linear(model, mname, v, dtype, sd[mname].device):
            written[mname] = 1
            continue
        target = sd[mname]
        val = v.dequantize(target.dtype) if v.fmt != "int" else v.data
        dst = target if j is None else target[j - getattr(mod, "offset", 0)]
        if tuple(dst.shape) != tuple(val.shape):
            raise CheckpointError(f"tensor '{e.name}' has shape {list(val.shape)}, the model expects {list(dst.shape)}")
        dst.copy_(val)
        written[mname] = written.get(mname, 0) + 1
    for path, qe in swapped.items():
        qe.finish()
        model.set_submodule(path, qe)
    for mod in model.modules():
        if isinstance(mod, QuantExperts) and getattr(mod, "_filled", None) is not None:
            try:
                mod.finish()
            except RuntimeError as err:
                raise CheckpointError(f"{p.root}: {err}") from None
    if requant is not None:
        requant.finish()
    mark_stored(
        model, {path: fmts.pop() if len(fmts) == 1 else "mixed" for path, fmts in stored.items() if fmts & set(_QUANT)}
    )
    for name, need in want.items():
        if written.get(name, 0) != need:
            raise CheckpointError(
                f"{p.root}: tensor '{name}' was not completely loaded ({written.get(name, 0)} of {need} parts)"
            )
    return stats


def _swap_linear(model: nn.Module, mname: str, v: Value, dtype: torch.dtype, device) -> bool:
    """Replace the nn.Linear owning `mname` (an FP8/FP4 weight) by a QuantLinear; False if not a Linear."""
    if not mname.endswith(".weight"):
        return False
    path = mname[: -len(".weight")]
    mod = model.get_submodule(path)
    if not isinstance(mod, nn.Linear):
        return False
    model.set_submodule(path, QuantLinear(v, mod.weight.dtype if mod.weight.dtype == torch.float32 else dtype, device))
    return True
