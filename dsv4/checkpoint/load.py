"""`load_pretrained(DIR)`: any layout -> a DeepSeekV4 model, validated before a byte of payload is used.

Steps: read the config; plan (headers only: layout, names, shapes, dtypes, scales - every problem found
up front); build the model on the target device without random init; stream tensor by tensor into the
parameters (dequantized to the parameter dtype, or kept quantized); check that every parameter was written;
record which modules were stored FP8 / FP4 and apply the config's quant_mode to them (`dsv4.model.quant`).
Any error raises and no model is returned.

Semantics by layout: a Hugging Face transformers directory ("hf" layout) computes as transformers does,
which simulates no quantization-aware training: fp8_kv_sim and fp4_indexer_sim default to off (and
dimensions those simulations could not block then load). Every other layout gets the official model's
semantics. Keyword arguments override either.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .. import defaults
from ..config import ModelConfig
from .hub import resolve_model_path
from .int8_load import Int8Requantizer
from .names import to_model
from .quantized import QuantExperts, QuantLinear
from .reader import Plan, Value, for_loading, plan, stream
from .safetensors_io import CheckpointError

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
):
    """Load a checkpoint directory (release, inference MP shards or HF transformers) into DeepSeekV4.

    path: a directory, or a Hugging Face Hub id `org/name[@revision]` (fetched into the Hub cache; see hub.py).

    dtype: parameter dtype of the weights that are not fp32 by design (norms, mHC, head stay fp32);
    dtype and device default to `dsv4.defaults` (fp32, cpu), as the command line's --dtype / --device.
    keep_quantized: FP8 linears and FP8/MXFP4 experts stay quantized (dequantized per block at compute
    time) instead of being dequantized to `dtype` on load.
    quant_mode: "w8a8" (the official numerics, the default) or "w8a16" for the weights stored as FP8 /
    FP4, or "int8": every linear and routed expert a release stores quantized is requantized at load to
    per-row INT8 and runs INT8 x INT8 (`dsv4.model.int8`; from any storage format, BF16 included).
    fp8_kv_sim / fp4_indexer_sim: the QAT simulations. None = the config's value, or for a transformers
    ("hf" layout) directory transformers' semantics (both simulations off).
    mtp: False builds the model without its MTP block and leaves the checkpoint's MTP tensors unread (the
    way to load the main model of a checkpoint whose draft dsv4 does not implement: DSpark).
    """
    from ..model import DeepSeekV4
    from ..model.quant import set_quant_mode

    asked = {k: v for k, v in (("quant_mode", quant_mode), ("fp8_kv_sim", fp8_kv_sim),
                               ("fp4_indexer_sim", fp4_indexer_sim)) if v is not None}
    path = resolve_model_path(path)
    p = plan(path, config.replace(**asked) if config is not None and asked else config, layout, overrides=asked)
    p = for_loading(p, mtp)
    for w in p.warnings:
        log.warning(w)
    dtype = dtype or defaults.default_dtype()
    device = torch.device(device or defaults.DEVICE)
    with _no_init(DeepSeekV4):
        model = DeepSeekV4(p.cfg, dtype=dtype, device=device)
    load_into(model, p, dtype=dtype, keep_quantized=keep_quantized, progress=progress,
              int8=p.cfg.quant_mode == "int8")
    try:
        set_quant_mode(model)
    except ValueError as e:
        raise CheckpointError(f"{p.root}: {e}") from None
    model.checkpoint_plan = {
        "path": str(p.root),
        "layout": p.layout,
        "files": len(p.files),
        "mp": p.mp,
        "warnings": list(p.warnings),
    }
    return model.eval()


@torch.no_grad()
def load_into(
    model: nn.Module,
    p: Plan,
    *,
    dtype: torch.dtype = torch.bfloat16,
    keep_quantized: bool = False,
    progress: bool | None = None,
    int8: bool = False,
) -> None:
    """Stream a validated plan into an existing model; every model tensor must be written exactly once.
    int8: the weights INT8 mode covers are requantized to per-row INT8 as they stream in
    (`dsv4.checkpoint.int8_load`)."""
    sd = model.state_dict(keep_vars=True)
    want = set(sd)
    names = {to_model(n)[0] for n in p.entries if not p.entries[n].parts}
    for e in p.entries.values():
        if e.parts:
            names.update(f"{e.name.rsplit('.', 1)[0]}.{w}" for w in e.parts)
    if names != want:
        extra, lost = sorted(names - want), sorted(want - names)
        raise RuntimeError(
            f"checkpoint names and model parameters disagree: not in the model {extra[:5]}, "
            f"not in the checkpoint {lost[:5]}"
        )
    written: dict[str, int] = {}
    quant_experts: dict[str, QuantExperts] = {}
    stored: dict[str, set[str]] = {}  # module -> storage formats of the weights written into it
    requant = Int8Requantizer(model) if int8 else None
    for e, v in stream(p, progress):
        if e.parts:  # fused HF experts [E, 2I, D] / [E, D, I]
            prefix = e.name.rsplit(".", 1)[0]
            for w, chunk in zip(e.parts, v.data.chunk(len(e.parts), dim=1)):
                name = f"{prefix}.{w}"
                if requant is None or not requant.take_stacked(name, chunk, v.fmt):
                    sd[name].copy_(chunk)
                written[name] = sd[name].size(0)
            continue
        mname, j = to_model(e.name)
        stored.setdefault(mname.rsplit(".", 1)[0], set()).add(v.fmt)
        target = sd[mname]
        v = Value(v.fmt, v.data.to(target.device), None if v.scale is None else v.scale.to(target.device))
        if requant is not None and requant.take(mname, j, v):
            written[mname] = written.get(mname, 0) + 1
            continue
        if keep_quantized and v.fmt in ("fp8", "fp4"):
            if j is None and _swap_linear(model, mname, v, dtype, target.device):
                written[mname] = 1
                continue
            if j is not None:
                qe = quant_experts.get(mname.rsplit(".", 1)[0])
                if qe is None:
                    qe = quant_experts[mname.rsplit(".", 1)[0]] = QuantExperts(
                        model.get_submodule(mname.rsplit(".", 1)[0]), v.fmt, dtype
                    )
                if qe.fmt == v.fmt:
                    qe.put(mname.rsplit(".", 1)[1], j, v, target.device)
                    written[mname] = written.get(mname, 0) + 1
                    continue
                raise CheckpointError(
                    f"{p.root}: experts of '{mname}' mix storage formats; load without keep_quantized"
                )
        val = v.dequantize(target.dtype) if v.fmt != "int" else v.data
        dst = target if j is None else target[j]
        if tuple(dst.shape) != tuple(val.shape):
            raise CheckpointError(
                f"tensor '{e.name}' has shape {list(val.shape)}, the model expects {list(dst.shape)}"
            )
        dst.copy_(val)
        written[mname] = written.get(mname, 0) + 1
    for path, qe in quant_experts.items():
        qe.finish()
        _set_module(model, path, qe)
    if requant is not None:
        requant.finish()
    for path, fmts in stored.items():
        quant = fmts & {"fp8", "fp4"}
        if quant:
            model.get_submodule(path).stored_format = fmts.pop() if len(fmts) == 1 else "mixed"
    for name, t in sd.items():
        need = t.size(0) if name.endswith(("experts.w1", "experts.w2", "experts.w3")) and t.dim() == 3 else 1
        if written.get(name, 0) != need:
            raise CheckpointError(
                f"{p.root}: tensor '{name}' was not completely loaded "
                f"({written.get(name, 0)} of {need} parts)"
            )


@contextlib.contextmanager
def _no_init(model_cls: type) -> Iterator[None]:
    """Build the model directly on its device without random init: every value is loaded afterwards.
    (Not on the meta device: modules may cache tensors computed at construction.)"""
    names = (
        "normal_",
        "uniform_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "trunc_normal_",
        "zeros_",
        "ones_",
        "constant_",
    )
    saved = {n: getattr(nn.init, n) for n in names}
    reset = model_cls.__dict__.get("reset_parameters")
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        if reset is not None:
            model_cls.reset_parameters = lambda self, *a, **k: None
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
        if reset is not None:
            model_cls.reset_parameters = reset


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _swap_linear(model: nn.Module, mname: str, v: Value, dtype: torch.dtype, device) -> bool:
    """Replace the nn.Linear owning `mname` (an FP8/FP4 weight) by a QuantLinear; False if not a Linear."""
    if not mname.endswith(".weight"):
        return False
    path = mname[: -len(".weight")]
    mod = model.get_submodule(path)
    if not isinstance(mod, nn.Linear):
        return False
    _set_module(
        model, path, QuantLinear(v, mod.weight.dtype if mod.weight.dtype == torch.float32 else dtype, device)
    )
    return True
