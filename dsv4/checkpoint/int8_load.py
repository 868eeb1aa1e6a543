"""Loading with `quant_mode="int8"`: the weights INT8 mode covers (`dsv4.model.int8`) are requantized to
per-row INT8 as they stream in, one tensor at a time, and installed as INT8 modules; their float (or FP8 /
MXFP4) copies are never kept. Any storage format works: FP8 linears and FP8 / MXFP4 experts are decoded
to their exact values first, BF16 / fp32 weights are quantized from theirs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.int8 import Int8Experts, Int8Linear, is_int8_experts, is_int8_linear, quantize_rows, share_experts
from .storage import Value


class Int8Requantizer:
    """Collects the INT8 modules of one load: `take` each streamed tensor it covers, `finish` at the end."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.experts: dict[str, dict[str, list]] = {}  # module path -> w1/w2/w3 -> per expert (q, s)
        self.formats: dict[str, set[str]] = {}

    def take(self, mname: str, j: int | None, v: Value) -> bool:
        """Requantize the tensor (model name `mname`, expert index j) if INT8 mode covers it; False if not."""
        path, _, leaf = mname.rpartition(".")
        if j is None and leaf == "weight" and is_int8_linear(path):
            mod = Int8Linear.from_weight(v.dequantize(torch.float32), v.fmt)
            self.model.set_submodule(path, mod.to(self.model.get_submodule(path).weight.device))
            return True
        if j is not None and is_int8_experts(path):
            self._put(path, leaf, j, *quantize_rows(v.dequantize(torch.float32)), v.fmt)
            return True
        return False

    def take_stacked(self, mname: str, w: torch.Tensor, fmt: str) -> bool:
        """A whole stack of experts at once (a fused transformers tensor split into w [E, out, in])."""
        path, _, leaf = mname.rpartition(".")
        if not is_int8_experts(path):
            return False
        q, s = quantize_rows(w.float())
        for j in range(w.size(0)):
            self._put(path, leaf, j, q[j], s[j], fmt)
        return True

    def _put(self, path: str, leaf: str, j: int, q: torch.Tensor, s: torch.Tensor, fmt: str) -> None:
        if path not in self.experts:
            n = self.model.get_submodule(path).w1.size(0)
            self.experts[path] = {w: [None] * n for w in ("w1", "w2", "w3")}
        self.experts[path][leaf][j] = (q, s)
        self.formats.setdefault(path, set()).add(fmt)

    def written(self, path: str, leaf: str) -> int:
        return sum(p is not None for p in self.experts.get(path, {}).get(leaf, []))

    def finish(self) -> None:
        """Install the routed-expert modules (each part must have been streamed) and the INT8 shared
        experts."""
        for path, parts in self.experts.items():
            old = self.model.get_submodule(path)
            for w, items in parts.items():
                missing = [j for j, p in enumerate(items) if p is None]
                if missing:
                    raise RuntimeError(f"INT8 experts: {path}.{w} of expert {missing[0]} was never loaded")
            stacks = {
                w: (torch.stack([q for q, _ in items]), torch.stack([s for _, s in items]))
                for w, items in parts.items()
            }
            fmts = self.formats[path]
            new = Int8Experts(
                stacks, old.swiglu_limit, getattr(old, "offset", 0), fmts.pop() if len(fmts) == 1 else "mixed"
            )
            self.model.set_submodule(path, new.to(old.w1.device))
        share_experts(self.model)
