"""The checks of the conformance suite. Each check passes on the correct code and fails on its mutants.

A check takes the shared `Context` (a small check model, tokens and the clean run's stages) and returns
a `CheckResult(ok, error, detail)`; `error` is the measured number that decided it. By topic: `model`
(stages, routing, SwiGLU, decode, paging, the draft), `kernels` (attention backward, compilers, determinism,
memory, backend evidence, static shapes), `formats` (bytes, checkpoints, goldens), `int8`; `context` is what
they share.
"""

from __future__ import annotations

from collections.abc import Callable

from ..result import CheckResult, skipped
from .context import Context, backend_refusals
from .formats import (
    checkpoint_roundtrip,
    dspark_goldens,
    e8m0_bytes,
    ep_ranges,
    fp4_known_bytes,
    official_goldens,
    transformers_goldens,
)
from .int8 import int8_per_token, int8_weight_rows
from .kernels import (
    attention_backward_random,
    attention_backward_structured,
    backend_evidence,
    compile_attention,
    compile_moe,
    compile_parity,
    determinism,
    live_dtype,
    lse_contract,
    poisoned_memory_check,
    static_shapes,
)
from .model import (
    SWIGLU_GRID,
    draft_acceptance,
    indexer_padding,
    paged_batching,
    router_contract,
    stage_compare,
    swiglu_formula,
    swiglu_limit,
    teacher_forcing,
)

CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "checkpoint-roundtrip": checkpoint_roundtrip,
    "ep-ranges": ep_ranges,
    "stage-compare": stage_compare,
    "router-contract": router_contract,
    "swiglu-limit": swiglu_limit,
    "swiglu-formula": swiglu_formula,
    "attention-backward-random": attention_backward_random,
    "attention-backward-structured": attention_backward_structured,
    "lse-contract": lse_contract,
    "compile-attention": compile_attention,
    "compile-parity": compile_parity,
    "determinism": determinism,
    "poisoned-memory": poisoned_memory_check,
    "teacher-forcing": teacher_forcing,
    "paged-batching": paged_batching,
    "draft-acceptance": draft_acceptance,
    "indexer-padding": indexer_padding,
    "backend-evidence": backend_evidence,
    "static-shapes": static_shapes,
    "compile-moe": compile_moe,
    "live-dtype": live_dtype,
    "fp4-known-bytes": fp4_known_bytes,
    "e8m0-bytes": e8m0_bytes,
    "official-goldens": official_goldens,
    "transformers-goldens": transformers_goldens,
    "dspark-goldens": dspark_goldens,
    "int8-weight-rows": int8_weight_rows,
    "int8-per-token": int8_per_token,
}

__all__ = ["CHECKS", "SWIGLU_GRID", "CheckResult", "Context", "backend_refusals", "skipped"]
