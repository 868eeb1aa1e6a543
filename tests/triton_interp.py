"""Shared by the Triton backend tests: run kernels on the CPU interpreter (TRITON_INTERPRET=1).

Triton fixes interpreted vs compiled when a kernel is decorated, so the kernel modules are re-imported
with the variable set, and re-imported again afterwards so later tests see the compiled kernels.
Import the two fixtures into a test module to use them.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from dsv4.ops.triton._common import interpreter_defect

MODULES = (
    "_mm_utils",
    "moe",
    "mhc_bwd",
    "mhc_fn",
    "mhc",
    "quant_gemm",
    "w8a8_gemm",
    "w8a8_decode",
    "int8_gemm",
    "int8_decode",
)


def rebuild_kernels(interpret: bool) -> None:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        for name in MODULES:
            importlib.reload(importlib.import_module(f"dsv4.ops.triton.{name}"))
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    """The module's tests run the kernels on the CPU interpreter; afterwards the compiled ones come back.
    Where this environment's interpreter cannot run them (`interpreter_defect`), the module is skipped with
    that reason: on a CUDA machine the compiled kernels are tested by test_w8a8_cuda.py and the CUDA
    conformance run."""
    defect = interpreter_defect()
    if defect:
        pytest.skip(defect)
    rebuild_kernels(True)
    yield
    rebuild_kernels(False)


@pytest.fixture(autouse=True)
def interpret_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------- launch-time kernels
# Kernels launched through `dsv4.ops.triton._common.Kernel` choose interpreted or compiled at each launch,
# so their tests only set the variable (no module reloads).
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if CUDA else "cpu")


def interpret_unless_cuda(monkeypatch) -> None:
    """Run launch-time kernels on the CPU interpreter for this test when there is no GPU."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def poison_allocator(monkeypatch, module) -> None:
    """The backend module's output allocator (`module._alloc`) hands out NaN-filled memory (integer outputs:
    all bits set, the E4M3 NaN byte for FP8 codes): every element a kernel should write must be written."""

    def alloc(*shape, dtype=None, device=None):
        dtype = dtype or torch.get_default_dtype()
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(*shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(module, "_alloc", alloc)
