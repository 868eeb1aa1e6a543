"""Numerics of the weights a checkpoint stores as FP8 / FP4: W8A8 (the official code's) or W8A16.

The official inference code quantizes every activation that feeds an FP8 or FP4 weight - each linear
stored as FP8, the routed experts (FP8 or MXFP4) and the shared expert - per token in blocks of 128 to
FP8 E4M3 (`act_quant`: power-of-two scales when `scale_fmt` is "ue8m0", amax/448 otherwise) and
multiplies FP8 x FP8 / FP8 x FP4. That is W8A8, the default here. W8A16 keeps the activations in the
model dtype and multiplies them with the dequantized weights.

Two passes over a built model choose them, defined here so that the model's modules are set by the model
alone: the checkpoint loader hands `mark_stored` the format each module's weights were stored in (its
`stored_format`: "fp8", "fp4", or "mixed" for a layer of routed experts stored partly quantized) and then
calls `set_quant_mode`, which sets each such module's `act_format` from the config: None (W8A16), "ue8m0"
or "fp32" (and None for "int8": those weights are INT8 modules then, `dsv4.model.int8`). The same numerics
hold whether the weights were dequantized at load (then they are the exact dequantized values and only
the activations are rounded: `ops.fp8_round_trip`) or kept quantized (`ops.act_quant` + `ops.fp8_gemm` /
`ops.fp4_gemm` / `ops.quantized_moe_experts`).

Not quantized, as in the official model: the grouped output projection `wo_a` (the release stores it as
FP8; the official converter dequantizes it to bf16 and the attention multiplies bf16 activations), and
every weight the release keeps in bf16 / fp32 (embeddings, head, router, compressors, indexer weights).
"""

from __future__ import annotations

from torch import nn

from ..config import QUANT_MODES, ModelConfig
from .int8 import int8_modules, quantize_int8

# weights stored as FP8 whose official computation uses the dequantized weight and unquantized activations
DEQUANTIZED_IN_OFFICIAL = (".attn.wo_a",)


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module name: stored format} of every module the loader marked as stored FP8 / FP4."""
    return {name: m.stored_format for name, m in model.named_modules() if getattr(m, "stored_format", None) is not None}


STORED_FORMATS = ("fp8", "fp4", "mixed")


def mark_stored(model: nn.Module, formats: dict[str, str]) -> None:
    """Record how a checkpoint stored the weights of the modules named in `formats` ({module path: "fp8",
    "fp4" or "mixed"}); `set_quant_mode` then gives them their numerics. Raises ValueError for a path
    the model does not have or a format not in STORED_FORMATS."""
    for path, fmt in formats.items():
        if fmt not in STORED_FORMATS:
            raise ValueError(f"{path}: stored format must be one of {STORED_FORMATS}, got {fmt!r}")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"the model has no module {path!r} to mark as stored {fmt}") from None
        mod.stored_format = fmt


def set_quant_mode(model: nn.Module, mode: str | None = None) -> None:
    """Apply `mode` ("w8a8", "w8a16" or "int8"; default: the model config's `quant_mode`) to every module
    whose weights the checkpoint stored quantized, and record it in the config of the model and of every
    module that holds one (a new config: configs are frozen). "int8" requantizes the weights INT8 mode
    covers in place (`dsv4.model.int8.quantize_int8`, also on a float model); a model holding INT8 weights
    cannot go back (their source values are gone: load it again). Raises ValueError for W8A8 on a layer of
    routed experts stored partly quantized (W8A8 needs one format per layer)."""
    if mode is not None:
        if mode not in QUANT_MODES:
            raise ValueError(f"quant_mode must be one of {QUANT_MODES}, got {mode!r}")
        if mode != "int8" and int8_modules(model):
            raise ValueError(
                f"this model's weights were requantized to INT8; quant_mode {mode!r} needs the checkpoint loaded again"
            )
        cfg = model.cfg.replace(quant_mode=mode)
        for m in model.modules():
            if isinstance(getattr(m, "cfg", None), ModelConfig):
                m.cfg = cfg
    if model.cfg.quant_mode == "int8":
        quantize_int8(model)
    act = model.cfg.act_format
    for name, m in model.named_modules():
        fmt = getattr(m, "stored_format", None)
        if fmt is None or name.endswith(DEQUANTIZED_IN_OFFICIAL):
            continue
        if fmt == "mixed" and act is not None:
            raise ValueError(
                f"{name}: some routed experts are stored quantized and others not; W8A8 needs one "
                "storage format per layer (load with quant_mode='w8a16')"
            )
        m.act_format = act


__all__ = ["DEQUANTIZED_IN_OFFICIAL", "STORED_FORMATS", "mark_stored", "quantized_modules", "set_quant_mode"]
