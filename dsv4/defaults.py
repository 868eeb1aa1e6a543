"""Run-time defaults shared by the Python API and the command line, so that the same model, prompt and seed
give the same text either way.

- DEVICE: where the Python API builds or loads a model when nothing says otherwise: the CPU, on every
  machine (ask for a GPU with device="cuda"). The command line's `--device` defaults to "auto", the best
  device present (a CUDA GPU, else the CPU), on every command (`dsv4.options`).
- DTYPE: the parameter dtype of weights that are not fp32 by design (norms, mHC, head always are): fp32.
  The shipped model was trained with fp32 master weights and is small; give bf16 to halve the memory of
  large checkpoints. The command line's `--dtype auto` is bf16 on a GPU, fp32 on a CPU.
- Threads (`set_threads`): a command that computes uses `--threads N`, or when it is 0 the cores this
  process may use (minus what it reserves for another process, e.g. the server's HTTP process), or
  OMP_NUM_THREADS when that is set.
"""

from __future__ import annotations

import os
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


def best_device() -> str:
    """The device `--device auto` means: a CUDA GPU when this torch sees one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name ("fp32", "bf16", "fp16", "auto": bf16 on a GPU, fp32 elsewhere), a torch dtype or None (the
    default) -> the torch dtype."""
    if dtype is None:
        return default_dtype()
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device or DEVICE).type == "cuda" else torch.float32
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
    if name == "auto":
        name = best_device()
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"{flag} {name}: not a device name ({e})") from None
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise UserError(
                f"{flag} {name}: this torch build ({torch.__version__}) has no CUDA support; "
                f"install a CUDA build of torch or use {flag} cpu"
            )
        if not torch.cuda.is_available():
            raise UserError(f"{flag} {name}: no CUDA device is available to this process; use {flag} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{flag} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta") and not _available(dev):
        raise UserError(f"{flag} {name}: this torch cannot use a '{dev.type}' device here")
    return dev


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_threads(n: int = 0, reserve: int = 0) -> int:
    """Set torch's compute threads: n when given (> 0); else OMP_NUM_THREADS when set; else the cores this
    process may use minus `reserve` (at least 1). Returns the number in use."""
    if n and n > 0:
        torch.set_num_threads(n)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, cores() - reserve))
    return torch.get_num_threads()


def _available(dev: torch.device) -> bool:
    mod = getattr(torch, dev.type, None)
    is_available = getattr(mod, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


__all__ = [
    "DEVICE",
    "DTYPE",
    "DTYPES",
    "best_device",
    "cores",
    "default_dtype",
    "dtype_name",
    "resolve_device",
    "resolve_dtype",
    "set_threads",
]
