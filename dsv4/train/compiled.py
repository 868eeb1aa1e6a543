"""`--compile`: the model's blocks under torch.compile."""

from __future__ import annotations

import os

import torch

from ..errors import UserError


def compile_blocks(model: torch.nn.Module, device: torch.device, backend: str = "inductor") -> None:
    """`--compile`: torch.compile (inductor by default) every main and MTP block. The routed experts stay eager: their
    loop over experts is data-dependent (under expert parallelism the exchange sizes are host values too),
    so tracing them would only add graph breaks and recompilations."""
    import shutil

    import torch._dynamo

    if (
        backend == "inductor"
        and device.type == "cpu"
        and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
    ):
        raise UserError(
            "--compile on a CPU needs a C++ compiler for inductor (g++ not found): install one, "
            "set CXX, or train without --compile"
        )
    blocks = [*model.layers, *model.mtp]
    # all blocks share one code object, so each block is a separately guarded variant (and the rope
    # cache's first fill adds one more): allow that many before dynamo falls back to eager
    dyn = torch._dynamo.config
    dyn.recompile_limit = max(dyn.recompile_limit, 4 * len(blocks))
    model.set_options(eager_experts_under_compile=True)
    for block in blocks:
        block.compile(backend=backend)
