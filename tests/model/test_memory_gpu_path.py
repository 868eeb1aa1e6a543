"""The GPU training estimate's per-block accounting (`dsv4.memory.train_layer_saved`) against what the GPU
path's ops actually save for the backward, run on the Triton CPU interpreter under bf16 autocast.

Counted with `torch.autograd.graph.saved_tensors_hooks`: the bytes of the distinct storages saved during a
forward, parameters and the bf16 casts of weights (`TrainState.copies`) left out.
"""

from __future__ import annotations

import pytest
import torch

import dsv4.ops as ops
from dsv4 import memory as mem
from dsv4.config import ModelConfig
from dsv4.model import DeepSeekV4

pytest.importorskip("triton", reason="triton is not installed: no triton backend to test")
from triton_interp import interpret_env, interpreted_kernels  # noqa: E402,F401  (autouse fixtures)


def _saved_bytes(model: torch.nn.Module, fn) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) of the storages autograd saves while fn() runs under bf16
    autocast: a saved bf16 tensor shaped like a parameter (or its transpose) is a weight's cast."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = set()
    for p in model.parameters():
        s = tuple(p.shape)
        shapes |= {s, s[::-1]} | ({(s[0], s[2], s[1])} if len(s) == 3 else set())
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), (st.nbytes(), t.dtype == torch.bfloat16 and tuple(t.shape) in shapes))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        fn()
    return (sum(n for n, copy in seen.values() if not copy), sum(n for n, copy in seen.values() if copy))


def test_moe_saves_what_the_estimate_counts():
    """The router and the routed + shared experts of one block (the Triton grouped-GEMM MoE): the fp32 SwiGLU
    intermediates per routed slot are the largest part of a block's saved bytes."""
    cfg = ModelConfig.preset("tiny").replace(dim=96, moe_inter_dim=80)
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).train()
    moe = model.layers[1].ffn
    b, s = 2, 22  # token and slot counts unlike any weight dimension (the copies are told by shape)
    x = torch.randn(b, s, cfg.dim).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    # the router's fp32 projection as CUDA runs it at these rows: bf16x3 (saves the bf16 input itself)
    with ops.which_ran() as ran, ops.use_backend({"linear_fp32": "bf16x3"}, inherit=True):
        saved, copies = _saved_bytes(model, lambda: moe(x, tokens, {}, 1e-4))
    assert ran["moe_experts"] == ["triton"] and ran["linear_fp32"] == ["bf16x3"]
    terms = mem.train_layer_saved(cfg, 4, b, s)
    # the block's MoE input (the normed stream) is counted there, and x here is that input
    want = terms["router"] + terms["moe"]
    assert abs(saved / want - 1) < 0.01, (saved, want)  # int64 / bool bookkeeping of a few bytes aside
    assert copies == sum(p.numel() * 2 for n, p in moe.named_parameters() if n.startswith(("experts.", "shared")))
