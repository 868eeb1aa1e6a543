"""Triton backends of `dsv4.ops`. Importing this package registers every kernel module listed below.

Each module registers its ops with `dsv4.ops.register(op, "triton", fn, can_run=..., priority=10)`.
`can_run` refuses tensors that are not on CUDA unless `TRITON_INTERPRET=1` (the CPU interpreter, used by
the test suite at small shapes).
"""

from __future__ import annotations

import importlib

import triton  # noqa: F401  (ImportError here means: no triton backend; dsv4.ops then has none registered)

_MODULES = (
    "sparse_attention",
    "indexer",
    "moe",
    "mhc",
    "quant_gemm",
    "w8a8_gemm",
    "w8a8_decode",
    "int8_gemm",
    "int8_decode",
    "int8_quant",
    "elementwise",
    "rows",
    "rownorm_rope",
    "sampling",
    "spec_accept",
    "spec_carry",
    "logprobs",
    "route",
    "swiglu",
    "plan",
    "fixed_gemm",
    "optim",
    "cross_entropy",
)

# every module is imported unconditionally: a missing or broken one is an error, never a silently absent op
for _name in _MODULES:
    importlib.import_module(f"{__name__}.{_name}")
