"""INT8 W8A8 (`quant_mode="int8"`): for hardware with INT8 dot products but no FP8 (GPUs before Hopper,
NPUs, CPUs).

Every weight a release checkpoint stores quantized - the FP8 linears and the routed experts (FP8 or
MXFP4) - is requantized once, when the model is loaded, to symmetric INT8 with one fp32 scale per output
row (`ops.int8_quant` on the weight's exact values), and kept so in memory: one byte per weight plus 4
bytes per row. At run time each such module quantizes its input per token to INT8 (`ops.int8_quant`) and
multiplies INT8 x INT8 with INT32 sums (`ops.int8_gemm`: `torch._int_mm`, a Triton kernel or the
reference), dequantized with the two scales. The experts' clamped SwiGLU runs in fp32 on the fp32 outputs
of the gate and up GEMMs and is quantized per token again before the down projection
(`ops.int8_moe_experts`; the shared expert the same way, `Int8SharedExpert`).

From a BF16 checkpoint or random weights the same weights are quantized from their float values. Not
quantized, as in the official W8A8 model: the grouped output projection `wo_a` (the official converter
dequantizes it and the attention multiplies it in the activation dtype), and every weight the release keeps
in bf16 / fp32 (embeddings, head, router, compressors, the indexer's head weights).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops.int8_native import swiglu_fp32

# the linears (suffixes of module paths) and the routed experts a release stores quantized, wo_a left out
INT8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "e_proj", "h_proj")
INT8_SHARED = "ffn.shared_experts"
INT8_ROUTED = "ffn.experts"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] (any float dtype) -> (int8 [..., N, K], fp32 scales [..., N]): per output row."""
    q, s = ops.int8_quant(w)
    return q, s.squeeze(-1)


class Int8Linear(nn.Module):
    """y = int8_gemm(int8_quant(x), weight_q, scale) in x's dtype (`ops.int8_linear`): weight_q [N, K] int8,
    scale [N] fp32.

    `weight` gives the dequantized weight (fp32), for code that reads a weight directly."""

    def __init__(self, weight_q: torch.Tensor, scale: torch.Tensor, source_format: str = "float"):
        super().__init__()
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("scale", scale)
        self.out_features, self.in_features = weight_q.shape
        self.source_format = source_format

    @classmethod
    def from_weight(cls, w: torch.Tensor, source_format: str = "float") -> Int8Linear:
        return cls(*quantize_rows(w.detach()), source_format)

    @property
    def weight(self) -> torch.Tensor:
        return ops.reference.int8_dequant(self.weight_q, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.int8_linear(x, self.weight_q, self.scale)  # int8_quant, then int8_gemm (fused where it can)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-row (from {self.source_format})"


class Int8SharedExpert(nn.Module):
    """The shared expert on INT8 weights: x quantized per token once, gate and up to fp32, the clamped SwiGLU
    in fp32, then the down projection (`int8_linear`: quantized per token again) in x's dtype."""

    def __init__(self, w1: Int8Linear, w2: Int8Linear, w3: Int8Linear, swiglu_limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = ops.int8_quant(x)  # once for gate and up
        gate = ops.int8_gemm(q, s, self.w1.weight_q, self.w1.scale, torch.float32)
        up = ops.int8_gemm(q, s, self.w3.weight_q, self.w3.scale, torch.float32)
        return ops.int8_linear(swiglu_fp32(gate, up, self.swiglu_limit), self.w2.weight_q, self.w2.scale, x.dtype)


class Int8Experts(nn.Module):
    """The routed experts of one layer on INT8 weights: w1_q, w3_q [E, inter, dim], w2_q [E, dim, inter]
    int8 with per-row scales w{1,2,3}_scale [E, out] fp32; one `ops.int8_moe_experts` call.
    `w1` / `w2` / `w3` give the dequantized stacks (fp32)."""

    def __init__(
        self,
        w: dict[str, tuple[torch.Tensor, torch.Tensor]],
        swiglu_limit: float,
        offset: int = 0,
        source_format: str = "float",
    ):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            q, s = w[name]
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_scale", s)
        self.swiglu_limit, self.offset, self.source_format = swiglu_limit, offset, source_format
        self.n = self.w1_q.size(0)

    @classmethod
    def from_weights(
        cls,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        swiglu_limit: float,
        offset: int = 0,
        source_format: str = "float",
    ) -> Int8Experts:
        ws = {"w1": quantize_rows(w1.detach()), "w2": quantize_rows(w2.detach()), "w3": quantize_rows(w3.detach())}
        return cls(ws, swiglu_limit, offset, source_format)

    def _dequant(self, name: str) -> torch.Tensor:
        return ops.reference.int8_dequant(getattr(self, f"{name}_q"), getattr(self, f"{name}_scale"))

    @property
    def w1(self) -> torch.Tensor:
        return self._dequant("w1")

    @property
    def w2(self) -> torch.Tensor:
        return self._dequant("w2")

    @property
    def w3(self) -> torch.Tensor:
        return self._dequant("w3")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> fp32 [T, dim]: the routed experts' weighted sum."""
        return ops.int8_moe_experts(
            x,
            weights,
            indices,
            self.w1_q,
            self.w1_scale,
            self.w2_q,
            self.w2_scale,
            self.w3_q,
            self.w3_scale,
            self.swiglu_limit,
            self.offset,
        )

    def extra_repr(self) -> str:
        e, i, d = self.w1_q.shape
        return f"experts={e}, dim={d}, inter={i}, int8 per-row (from {self.source_format})"


def _ends(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def is_int8_linear(path: str) -> bool:
    """Whether the module at `path` is a linear that INT8 mode requantizes (a shared-expert projection
    included)."""
    return any(_ends(path, s) for s in INT8_LINEARS) or _ends(path.rpartition(".")[0], INT8_SHARED)


def is_int8_experts(path: str) -> bool:
    """Whether the module at `path` holds a layer's routed experts."""
    return _ends(path, INT8_ROUTED)


def _source(m: nn.Module) -> str:
    return getattr(m, "stored_format", None) or getattr(m, "source_format", None) or "float"


def share_experts(model: nn.Module) -> None:
    """Turn every shared expert whose three projections are Int8Linear into an `Int8SharedExpert`."""
    for path, m in list(model.named_modules()):
        if (
            path.endswith(INT8_SHARED)
            and not isinstance(m, Int8SharedExpert)
            and all(isinstance(getattr(m, w, None), Int8Linear) for w in ("w1", "w2", "w3"))
        ):
            shared = Int8SharedExpert(m.w1, m.w2, m.w3, m.swiglu_limit)
            stored = getattr(m, "stored_format", None)
            if stored is not None:
                shared.stored_format = stored
            model.set_submodule(path, shared)


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Requantize in place every linear and routed-expert layer INT8 mode covers (see the module docstring)
    from the weights the model holds now (float parameters, or FP8 / MXFP4 kept quantized: their exact
    dequantized values); modules already INT8 are kept. Returns the model."""
    for path, m in list(model.named_modules()):
        if isinstance(m, (Int8Linear, Int8Experts, Int8SharedExpert)):
            continue
        if is_int8_experts(path) and hasattr(m, "w1"):
            new = Int8Experts.from_weights(m.w1, m.w2, m.w3, m.swiglu_limit, getattr(m, "offset", 0), _source(m))
            model.set_submodule(path, new)
        elif is_int8_linear(path) and hasattr(m, "weight"):
            model.set_submodule(path, Int8Linear.from_weight(m.weight, _source(m)))
    share_experts(model)
    return model


def int8_modules(model: nn.Module) -> dict[str, str]:
    """{module path: the format its INT8 weights were requantized from} of every INT8 module."""
    return {path: m.source_format for path, m in model.named_modules() if isinstance(m, (Int8Linear, Int8Experts))}


__all__ = [
    "INT8_LINEARS",
    "Int8Experts",
    "Int8Linear",
    "Int8SharedExpert",
    "int8_modules",
    "is_int8_experts",
    "is_int8_linear",
    "quantize_int8",
    "quantize_rows",
    "share_experts",
]
