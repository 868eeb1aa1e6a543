"""Modules that keep checkpoint weights quantized and dequantize per block when computing.

Both compute through `dsv4.ops` (fast backends where they can run, every call recorded):
- `QuantLinear` replaces an `nn.Linear` whose checkpoint weight is FP8 (128x128 E8M0/fp32 scales) or
  MXFP4. W8A8 (`act_format` set, the default): `ops.act_quant` then `ops.fp8_gemm` / `ops.fp4_gemm`, the
  official numerics; W8A16: `ops.fp8_linear` / `ops.fp4_linear` (the weight dequantized to the activation
  dtype). `.weight` gives the dequantized weight, so code that reads the weight directly keeps working
  (the grouped output projection `wo_a`, which the official model also computes in bf16).
- `QuantExperts` replaces the stacked routed experts of a layer stored as MXFP4 or FP8. W8A8: one
  `ops.quantized_moe_experts` call. W8A16: small batches (decode) dequantize only the experts they route
  to, one at a time; from `GROUPED_MIN_TOKENS` tokens on (prefill) the experts are dequantized a chunk at
  a time into a bounded scratch and each chunk runs through `ops.moe_experts`: static shapes, no host sync.
Stored bytes are kept bit for bit (`weight_q`, `scale` buffers).

Both can be built empty from the shapes a checkpoint's headers give (`Stored`), on any device the meta
device included, and filled tensor by tensor afterwards (`load_` / `put`): the loader materializes every
buffer once, at its final size, and never holds a dequantized copy of a quantized weight. `narrow` keeps
a range of experts (expert parallelism: each rank holds E/N of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import formats as fm
from .. import ops
from ..ops.reference import ACT_BLOCK, act_pow2
from .reader import Value


def _dequant(fmt: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if fmt == "fp8":
        return fm.dequantize_fp8(q, scale, dtype)
    return fm.dequantize_mxfp4(q, scale, dtype)


def _raw(fmt: str, t: torch.Tensor) -> torch.Tensor:
    return fm.as_fp8_bytes(t) if fmt == "fp8" else fm.as_packed_bytes(t)


def _raw_scale(s: torch.Tensor) -> torch.Tensor:
    return s.float() if s.dtype in (torch.float32, torch.bfloat16, torch.float16) else fm.as_e8m0_bytes(s)


@dataclass(frozen=True)
class Stored:
    """How one quantized weight is stored: format, packed data shape [out, in or in/2] (uint8 bytes) and
    block-scale shape, the scale as fp32 values (scale_float) or E8M0 bytes."""

    fmt: str
    q_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    scale_float: bool

    @classmethod
    def of(cls, value: Value) -> Stored:
        return cls(
            value.fmt,
            tuple(value.data.shape),
            tuple(value.scale.shape),
            value.scale.dtype in (torch.float32, torch.bfloat16, torch.float16),
        )

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.scale_float else torch.uint8

    def in_features(self) -> int:
        return self.q_shape[-1] * (2 if self.fmt == "fp4" else 1)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise RuntimeError(
            f"{what}: stored as {src.dtype} {list(src.shape)}, the module holds {dst.dtype} {list(dst.shape)}"
        )
    dst.copy_(src)


class QuantLinear(nn.Module):
    """y = x @ dequant(weight_q, scale)^T: W8A8 (act_format "ue8m0" / "fp32") or W8A16 (act_format None)."""

    act_format: str | None = None

    def __init__(self, value: Value | Stored, compute_dtype: torch.dtype, device: torch.device | str | None = None):
        """From a stored value (copied to `device`), or empty from its `Stored` shapes (fill with `load_`)."""
        super().__init__()
        st = value if isinstance(value, Stored) else Stored.of(value)
        self.fmt = st.fmt
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_q", torch.empty(st.q_shape, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.empty(st.scale_shape, dtype=st.scale_dtype, device=device))
        self.out_features, self.in_features = st.q_shape[0], st.in_features()
        if isinstance(value, Value):
            self.load_(value)

    @torch.no_grad()
    def load_(self, value: Value) -> None:
        """Copy a stored value's bytes (and scale) into the buffers; shapes and formats must match."""
        if value.fmt != self.fmt:
            raise RuntimeError(f"quantized linear holds {self.fmt}, the value is {value.fmt}")
        _copy_checked(self.weight_q, _raw(value.fmt, value.data).to(self.weight_q.device), "quantized weight")
        _copy_checked(self.scale, _raw_scale(value.scale).to(self.scale.device), "block scale")

    @property
    def weight(self) -> torch.Tensor:
        return _dequant(self.fmt, self.weight_q, self.scale, self.compute_dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype, or in out_dtype (as `dsv4.model.layers.Linear`)."""
        # through the ops dispatch: a fast backend dequantizes inside its GEMM, and the call is recorded
        if self.act_format is not None:
            q, s = ops.act_quant(x, ACT_BLOCK, act_pow2(self.act_format))
            return ops.call(
                "fp8_gemm" if self.fmt == "fp8" else "fp4_gemm", q, s, self.weight_q, self.scale, out_dtype or x.dtype
            )
        if out_dtype is not None and out_dtype != x.dtype:
            x = x.to(out_dtype)
        return ops.call("fp8_linear" if self.fmt == "fp8" else "fp4_linear", x, self.weight_q, self.scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.fmt}, act={self.act_format}"


GROUPED_MIN_TOKENS = 1024  # from this many tokens, experts run chunk by chunk through ops.moe_experts
CHUNK_BYTES = 256 << 20  # dequantized scratch per chunk (w1 + w2 + w3 of its experts)


class QuantExperts(nn.Module):
    """Stacked routed experts kept quantized: w{1,2,3}_q [E, o, i or i/2] + scales, experts
    offset .. offset + E - 1 of the layer."""

    act_format: str | None = None

    def __init__(
        self,
        template: nn.Module,
        fmt: str,
        compute_dtype: torch.dtype,
        stored: dict[str, Stored] | None = None,
        device: torch.device | str | None = None,
    ):
        """template: the float `Experts` this replaces (its expert count, offset and limit). With `stored`
        ({"w1": Stored, ...}) the buffers are allocated at once on `device`; otherwise each projection's
        on its first `put`."""
        super().__init__()
        self.fmt, self.compute_dtype = fmt, compute_dtype
        self.offset = getattr(template, "offset", 0)
        self.swiglu_limit = getattr(template, "swiglu_limit", 0.0)
        self.n = template.w1.size(0)
        self._filled: dict[str, torch.Tensor] | None = {
            w: torch.zeros(self.n, dtype=torch.bool) for w in ("w1", "w2", "w3")
        }
        for w, st in (stored or {}).items():
            self._alloc(w, st, device)

    def _alloc(self, w: str, st: Stored, device) -> None:
        self.register_buffer(f"{w}_q", torch.empty((self.n, *st.q_shape), dtype=torch.uint8, device=device))
        self.register_buffer(f"{w}_scale", torch.empty((self.n, *st.scale_shape), dtype=st.scale_dtype, device=device))

    @torch.no_grad()
    def put(self, w: str, j: int, value: Value, device=None) -> None:
        """Expert j (counted from this module's first expert) of projection w, copied in bit for bit."""
        if self._filled is None:
            raise RuntimeError("quantized experts: put after finish")
        if not 0 <= j < self.n:
            raise RuntimeError(
                f"quantized experts: expert {j + self.offset} is not held here "
                f"([{self.offset}, {self.offset + self.n}))"
            )
        if getattr(self, f"{w}_q", None) is None:
            self._alloc(w, Stored.of(value), device if device is not None else value.data.device)
        q, s = getattr(self, f"{w}_q"), getattr(self, f"{w}_scale")
        _copy_checked(q[j], _raw(self.fmt, value.data).to(q.device), f"{w} of expert {j + self.offset}")
        _copy_checked(s[j], _raw_scale(value.scale).to(s.device), f"{w} scale of expert {j + self.offset}")
        self._filled[w][j] = True

    def finish(self) -> None:
        """Check that every expert of every projection was put."""
        for w, filled in (self._filled or {}).items():
            if not bool(filled.all()):
                missing = int((~filled).nonzero()[0])
                raise RuntimeError(f"quantized experts: {w} of expert {missing + self.offset} was never loaded")
        self._filled = None

    @torch.no_grad()
    def narrow(self, lo: int, hi: int) -> QuantExperts:
        """Keep only experts [lo, hi) of the layer (global ids; they must be held here). In place."""
        a, b = lo - self.offset, hi - self.offset
        if not 0 <= a < b <= self.n:
            raise ValueError(f"experts [{lo}, {hi}) are not all held here ([{self.offset}, {self.offset + self.n}))")
        for w in ("w1", "w2", "w3"):
            for part in ("q", "scale"):
                name = f"{w}_{part}"
                setattr(self, name, getattr(self, name)[a:b].clone())
        self.offset, self.n = lo, b - a
        return self

    def expert(self, w: str, j: int) -> torch.Tensor:
        return _dequant(self.fmt, getattr(self, f"{w}_q")[j], getattr(self, f"{w}_scale")[j], self.compute_dtype)

    @property
    def w1(self) -> torch.Tensor:
        return torch.stack([self.expert("w1", j) for j in range(self.n)])

    @property
    def w2(self) -> torch.Tensor:
        return torch.stack([self.expert("w2", j) for j in range(self.n)])

    @property
    def w3(self) -> torch.Tensor:
        return torch.stack([self.expert("w3", j) for j in range(self.n)])

    def stacked(self, w: str, lo: int, hi: int) -> torch.Tensor:
        """Experts [lo, hi) of projection w dequantized: [hi - lo, out, in] in the compute dtype."""
        q, s = getattr(self, f"{w}_q")[lo:hi], getattr(self, f"{w}_scale")[lo:hi]
        if self.fmt == "fp4":
            return fm.dequantize_mxfp4(q, s, self.compute_dtype)  # batched over experts
        return torch.stack([self.expert(w, j) for j in range(lo, hi)])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> fp32 [T, dim]: the routed experts' weighted sum."""
        if self.act_format is not None:
            return ops.quantized_moe_experts(
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
                self.fmt,
                self.act_format,
            )
        if x.size(0) >= GROUPED_MIN_TOKENS:
            return self._chunked(x, weights, indices)
        return self._per_expert(x, weights, indices)

    def _chunked(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Dequantize CHUNK_BYTES of experts at a time; each chunk is one `ops.moe_experts` call over the
        expert range it holds (slots routed elsewhere add zero)."""
        bytes_per_expert = (
            sum(getattr(self, f"{w}_q")[0].numel() * (2 if self.fmt == "fp4" else 1) for w in ("w1", "w2", "w3"))
            * x.element_size()
        )
        chunk = max(1, CHUNK_BYTES // bytes_per_expert)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for lo in range(0, self.n, chunk):
            hi = min(self.n, lo + chunk)
            w1, w2, w3 = (self.stacked(w, lo, hi).to(x.dtype) for w in ("w1", "w2", "w3"))
            y = y + ops.moe_experts(x, weights, indices, w1, w2, w3, self.swiglu_limit, self.offset + lo)
        return y

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Dequantize only the experts this batch routes to (one host read of the routed set)."""
        from ..ops import reference as ref

        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        local = indices - self.offset
        for j in torch.unique(local).tolist():
            if not 0 <= j < self.n:
                continue
            tok, slot = torch.where(local == j)
            w1, w2, w3 = (self.expert(w, j).to(x.dtype) for w in ("w1", "w2", "w3"))
            out = ref.expert_ffn(x[tok], w1, w2, w3, self.swiglu_limit, weights[tok, slot].unsqueeze(-1))
            y = y.index_add(0, tok, out.float())
        return y
