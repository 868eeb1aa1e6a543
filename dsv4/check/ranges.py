"""`dsv4 check ranges`: the magnitudes a model's activations reach, op by op, against FP16's range.

The model runs once in fp32 and once in fp16 on the same tokens. Every floating tensor an aten op produces
is attributed to the innermost module running it (layer indices folded: `layers.*.attn.wq_b`) and to the
op; per (module, op) the report keeps the largest finite |value| of both runs (ops that only the fp16 run
has, casts into fp16, are measured there) and the dtypes the fp16 run holds those tensors in. A tensor held
in fp16 must stay below its largest finite value, 65504; `margin` is how far below. Rows held in fp32 in
the fp16 run are the model's fp32 islands.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FP16_MAX = torch.finfo(torch.float16).max
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # (FP8 codes are not activations)
_INDEX = re.compile(r"\b(layers|mtp)\.\d+")
# views hold no new values (casts do: `_to_copy` into fp16 is where a value overflows)
_SKIP = {
    "detach",
    "alias",
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "permute",
    "lift_fresh",
}


@dataclass
class RangeRow:
    module: str
    op: str
    amax: float  # largest finite |value| in either run
    dtypes: list[str] = field(default_factory=list)  # dtypes of these tensors in the fp16 run

    @property
    def in_fp16(self) -> bool:
        return "float16" in self.dtypes

    @property
    def margin(self) -> float:
        """FP16's largest finite value over this amax (inf for zeros)."""
        return FP16_MAX / self.amax if self.amax > 0 else float("inf")


@dataclass
class RangeReport:
    rows: list[RangeRow]
    tokens: int
    nonfinite_fp16: list[str]  # (module, op) holding inf / NaN in the fp16 run only

    @property
    def ok(self) -> bool:
        return not self.nonfinite_fp16 and all(r.margin > 1 for r in self.rows if r.in_fp16)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "tokens": self.tokens,
            "nonfinite_fp16": self.nonfinite_fp16,
            "rows": [dict(r.__dict__, margin=r.margin, in_fp16=r.in_fp16) for r in self.rows],
        }

    def render(self, top: int = 25) -> str:
        fp16 = sorted((r for r in self.rows if r.in_fp16), key=lambda r: -r.amax)
        fp32 = sorted((r for r in self.rows if not r.in_fp16 and r.dtypes), key=lambda r: -r.amax)
        lines = [
            f"activation ranges over {self.tokens} tokens (largest |value| per module and op)",
            f"  held in fp16 by an fp16 model ({len(fp16)} module/op pairs; FP16 max {FP16_MAX:.0f}):",
        ]
        lines += [f"    {r.module:<40} {r.op:<24} {r.amax:>12.4g}  margin {r.margin:>9.3g}x" for r in fp16[:top]]
        lines.append(f"  kept in fp32 by an fp16 model ({len(fp32)} pairs), the largest:")
        lines += [f"    {r.module:<40} {r.op:<24} {r.amax:>12.4g}" for r in fp32[: min(top, 10)]]
        if self.nonfinite_fp16:
            lines.append(f"  NON-FINITE in the fp16 run: {', '.join(self.nonfinite_fp16[:10])}")
        lines.append("OK: every fp16 tensor within FP16's range" if self.ok else "FAILED: fp16 overflow")
        return "\n".join(lines)


class _Record(TorchDispatchMode):
    def __init__(self, where: list[str]):
        super().__init__()
        self.where = where
        self.amax: dict[tuple[str, str], float] = {}
        self.dtypes: dict[tuple[str, str], set[str]] = {}
        self.nonfinite: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if op in _SKIP:
            return out
        key = (self.where[-1], op)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.numel():
                a = t.detach().abs()
                finite = torch.isfinite(a)
                self.amax[key] = max(self.amax.get(key, 0.0), float(torch.where(finite, a, 0).amax()))
                self.dtypes.setdefault(key, set()).add(str(t.dtype).removeprefix("torch."))
                if not bool(finite.all()):
                    self.nonfinite.add(key)
        return out


@contextmanager
def _tracking(model: nn.Module) -> Iterator[_Record]:
    where = ["model"]
    handles = []

    def leave(mod: nn.Module, args, out) -> None:  # a hook that returns a value replaces the output
        where.pop()

    for name, m in model.named_modules():
        label = _INDEX.sub(lambda g: f"{g.group(1)}.*", name) or "model"
        handles.append(m.register_forward_pre_hook(lambda mod, a, label=label: where.append(label)))
        handles.append(m.register_forward_hook(leave))
    rec = _Record(where)
    try:
        with rec:
            yield rec
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def activation_ranges(model32: nn.Module, model16: nn.Module, tokens: torch.Tensor) -> RangeReport:
    """Run both models (the same weights in fp32 and fp16) on tokens [b, s]; see the module docstring."""
    with _tracking(model32) as r32:
        model32(tokens)
    with _tracking(model16) as r16:
        model16(tokens)
    # casts into fp16 run in the fp16 model only: their finite values there are the range (an overflow is
    # reported as non-finite)
    keys = set(r32.amax) | set(r16.amax)
    rows = [
        RangeRow(
            m, op, max(r32.amax.get((m, op), 0.0), r16.amax.get((m, op), 0.0)), sorted(r16.dtypes.get((m, op), ()))
        )
        for m, op in keys
    ]
    # masks are -inf by design (in both runs); what only the fp16 run holds is an overflow
    bad = sorted(f"{m}:{op}" for m, op in r16.nonfinite - r32.nonfinite)
    return RangeReport(sorted(rows, key=lambda r: -r.amax), tokens.numel(), bad)


__all__ = ["FP16_MAX", "RangeReport", "RangeRow", "activation_ranges"]
