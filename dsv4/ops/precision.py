"""Accumulation precision of the reference ops.

`exact_accumulation()` makes every reference matmul, einsum and reduction accumulate in float64 and round
once to the working dtype. The rounded results then no longer depend on how a computation is batched
(one [N, dim] matmul and N [1, dim] matmuls give the same fp32 numbers), which makes the prefill and
decode paths bit-comparable for teacher forcing even through the FP8/FP4 round trips, whose rounding
would otherwise turn 1-ulp differences into whole quantization steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_EXACT = [False]


def acc_dtype() -> torch.dtype:
    return torch.float64 if _EXACT[0] else torch.float32


def is_exact() -> bool:
    return _EXACT[0]


@contextlib.contextmanager
def exact_accumulation(on: bool = True) -> Iterator[None]:
    prev = _EXACT[0]
    _EXACT[0] = on
    try:
        yield
    finally:
        _EXACT[0] = prev
