"""Run-time defaults shared by the Python API and the command line, so that the same model, prompt and seed
give the same text either way.

- DEVICE: where a model is built or loaded when nothing says otherwise: the CPU, on every machine (a GPU
  being present never changes a default; ask for it with device="cuda" / --device cuda).
- DTYPE: the parameter dtype of weights that are not fp32 by design (norms, mHC, head always are): fp32.
  The shipped model was trained with fp32 master weights and is small; give bf16 to halve the memory of
  large checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import UserError

ASSETS = Path(__file__).resolve().parent / "assets"

DEVICE = "cpu"
DTYPE = "fp32"
# fp16: for hardware without bf16 math; the ops whose range needs it stay in fp32 (README, "FP16 compute")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shipped_model_dir() -> Path | None:
    """The model shipped inside the package (the default of generate / serve / chat), if present."""
    if not ASSETS.is_dir():
        return None
    return next((d for d in sorted(ASSETS.iterdir()) if (d / "config.json").exists()), None)


def default_dtype() -> torch.dtype:
    return DTYPES[DTYPE]


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A dtype name ("fp32", "bf16", "fp16"), a torch dtype or None (the default) -> the torch dtype."""
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_device(name: str | torch.device | None, flag: str = "--device") -> torch.device:
    """A device name -> torch.device, or a UserError (one line) naming why it cannot be used here:
    an unknown name, CUDA asked of a torch build without CUDA or of a machine without a GPU, a GPU index
    past the last one."""
    if name is None:
        name = DEVICE
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"{flag} {name}: not a device name ({e})") from None
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise UserError(f"{flag} {name}: this torch build ({torch.__version__}) has no CUDA support; "
                            f"install a CUDA build of torch or use {flag} cpu")
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {name}: no CUDA device is available to this process; use {flag} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta") and not _available(dev):
        raise UserError(f"{flag} {name}: this torch cannot use a '{dev.type}' device here")
    return dev


def _available(dev: torch.device) -> bool:
    mod = getattr(torch, dev.type, None)
    is_available = getattr(mod, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


__all__ = ["DEVICE", "DTYPE", "DTYPES", "default_dtype", "resolve_dtype", "resolve_device"]
