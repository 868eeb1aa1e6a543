"""Accumulation precision of the reference ops.

`exact_accumulation()` makes every reference matmul, einsum and reduction accumulate in float64 and round
once to the working dtype. The rounded results then no longer depend on how a computation is batched
(one [N, dim] matmul and N [1, dim] matmuls give the same fp32 numbers), which makes the prefill and
decode paths bit-comparable for teacher forcing even through the FP8/FP4 round trips, whose rounding
would otherwise turn 1-ulp differences into whole quantization steps.

The setting is per thread, like the backend choice of `dsv4.ops.use_backend`: an engine thread in
deterministic mode and a training thread beside it do not change each other's numbers. The dtype is chosen
when an op runs forward; a backward follows what its forward recorded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_STATE = threading.local()


def is_exact() -> bool:
    return getattr(_STATE, "exact", False)


def acc_dtype() -> torch.dtype:
    return torch.float64 if is_exact() else torch.float32


@contextlib.contextmanager
def exact_accumulation(on: bool = True) -> Iterator[None]:
    prev = is_exact()
    _STATE.exact = on
    try:
        yield
    finally:
        _STATE.exact = prev
