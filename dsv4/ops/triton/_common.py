"""Shared helpers of the Triton backends: interpreter-aware kernel launch and input checks.

Triton decides at *decoration* time whether a `@triton.jit` function is compiled or interpreted (it reads
`TRITON_INTERPRET` when the decorator runs). dsv4 imports its kernels whenever `dsv4.ops` is imported, so a
test that sets the variable later would still get compiled kernels. `Kernel` therefore keeps the plain
Python function and builds the compiled or the interpreted form lazily, choosing at each launch from the
variable's value *then*: setting `TRITON_INTERPRET=1` at any time before a launch selects the CPU
interpreter, and unsetting it goes back to compiled kernels.

Kernels launched through `Kernel` must be self-contained (no calls to other jit functions), so that the
same source runs under both forms.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

LOG2E = 1.4426950408889634


def interpret_mode() -> bool:
    """True when kernels run on the Triton CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def interpreter_defect() -> str | None:
    """Why the Triton CPU interpreter of this environment cannot run kernels that use an integer argument
    as a Python int (`range(0, K, BK)` over a runtime K), or None when it can.

    The interpreter of triton 3.6 and earlier turns a scalar argument into a one-element numpy array and
    converts it with `int(array)`; numpy 2.4 removed that conversion for arrays of one or more dimensions
    (`TypeError: only 0-dimensional arrays can be converted to Python scalars`). Later triton releases
    squeeze the array first. Kernels without such loops still interpret correctly, so this is reported,
    not used to refuse the whole backend."""
    try:
        int(np.zeros(1, dtype=np.int32))
        return None  # numpy still converts one-element arrays
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        source = inspect.getsource(patch) if patch is not None else ""
    except (OSError, TypeError):
        source = ""
    if "int(self.handle.data))" not in source:
        return None
    return (
        f"the Triton {triton.__version__} CPU interpreter cannot run with numpy {np.__version__} "
        "(it converts one-element arrays with int(), which numpy 2.4 removed); "
        "use numpy<2.4 or a newer triton for TRITON_INTERPRET=1"
    )


class Kernel:
    """A Triton kernel whose compiled / interpreted form is chosen at launch: `Kernel(fn)[grid](...)`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._jit = None
        self._interp = None

    def __getitem__(self, grid):
        if interpret_mode():
            if self._interp is None:
                self._interp = InterpretedFunction(self.fn)
            launch = self._interp[grid]

            def run(*args, **kwargs):
                with _interpretable_lang():
                    return launch(*args, **kwargs)

            return run
        if self._jit is None:
            self._jit = triton.jit(self.fn)
        return self._jit[grid]


_LANG_SWAP: dict[str, InterpretedFunction] = {}


@contextlib.contextmanager
def _interpretable_lang():
    """Temporarily make triton.language's own jit helpers (tl.zeros, tl.sum, tl.max, ...) interpretable.

    When triton was imported without TRITON_INTERPRET=1 these helpers are compiled-only JITFunctions,
    which the interpreter refuses to call. The swap lasts for one (synchronous) interpreted launch."""
    if not _LANG_SWAP:
        for name, obj in vars(tl).items():
            if isinstance(obj, JITFunction):
                _LANG_SWAP[name] = InterpretedFunction(obj.fn)
    saved = {name: getattr(tl, name) for name in _LANG_SWAP}
    try:
        for name, fn in _LANG_SWAP.items():
            if isinstance(saved[name], JITFunction):
                setattr(tl, name, fn)
        yield
    finally:
        for name, obj in saved.items():
            setattr(tl, name, obj)


def device_reason(*tensors: torch.Tensor) -> str | None:
    """None when the tensors can be handed to a Triton kernel here, else why not."""
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        return f"tensors on several devices: {sorted(map(str, devs))}"
    dev = devs.pop()
    if dev.type == "cuda":
        return None if not interpret_mode() else "TRITON_INTERPRET=1 is set but tensors are on CUDA"
    if interpret_mode() and dev.type == "cpu":
        return None
    return f"tensors are on {dev.type}, the triton backend needs CUDA (or CPU with TRITON_INTERPRET=1)"


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in full IEEE precision (no silent TF32), half types natively."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_type(dtype: torch.dtype):
    """Operand type of `tl.dot` for inputs of `dtype`: native when compiled, fp32 in the interpreter.

    The Triton 3.x interpreter multiplies bf16 operands as their raw uint16 bit patterns (numpy has no
    bf16), so kernels cast dot operands to this type; values are first rounded to the storage dtype, so
    the interpreter still sees the same rounding as the compiled kernel.
    """
    return tl.float32 if interpret_mode() else _TL_DTYPES[dtype]


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as a [rows, n] view with unit inner stride (copied only when no such view exists)."""
    x2 = x.reshape(-1, x.size(-1))
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
