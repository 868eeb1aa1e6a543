"""Compare two tensors (or two stage dicts) by contract: error metrics, tolerances, first divergence.

Metrics per stage: max abs error, relative L2 (||a - b|| / ||b||), cosine similarity, non-finite counts
on each side, and for integer stages (indexer top-k, router indices) the fraction of selected indices
that differ (as sets per row: the order of equal picks does not matter).

Tolerances are contracts, not bit-for-bit rules across implementations:
- `exact`: bit-identical (one backend in deterministic mode, repeated runs);
- `fp32` / `bf16` / `fp16`: bounded error between implementations computing in that dtype. Discrete
  decisions (top-k, routing) may flip at near-ties, so a small fraction of differing indices is allowed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .capture import Stages


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float  # max relative L2 error of float stages
    index_frac: float  # max fraction of differing indices of integer stages
    name: str = ""


TOLERANCES: dict[str, Tolerance] = {
    "exact": Tolerance(0.0, 0.0, "exact"),
    "fp32": Tolerance(1e-4, 0.02, "fp32"),
    "bf16": Tolerance(5e-2, 0.25, "bf16"),
    "fp16": Tolerance(2e-2, 0.15, "fp16"),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def tolerance_for(*dtypes: torch.dtype, exact: bool = False) -> Tolerance:
    """The contract between two runs: exact when asked, else the loosest of the dtypes involved."""
    if exact:
        return TOLERANCES["exact"]
    order = ["fp32", "fp16", "bf16"]
    names = [DTYPE_NAMES.get(d, "fp32") for d in dtypes] or ["fp32"]
    return TOLERANCES[max(names, key=order.index)]


@dataclass
class Diff:
    name: str
    shape: list[int]
    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    index_frac: float | None = None  # integer stages only
    ok: bool = True
    reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("max_abs", "rel_l2", "cosine", "index_frac"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)
        return d

    def summary(self) -> str:
        if self.index_frac is not None:
            core = f"indices differ {self.index_frac:.2%}"
        else:
            core = f"max_abs {self.max_abs:.3e}  rel_l2 {self.rel_l2:.3e}  cos {self.cosine:.6f}"
        nf = f"  non-finite {self.nonfinite_a}/{self.nonfinite_b}" if self.nonfinite_a or self.nonfinite_b else ""
        why = f"  ({self.reason})" if self.reason else ""
        return f"{self.name:<34} {core}{nf}{why}"


def index_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of entries of a's rows that are not among the same row of b (rows = last dim)."""
    if a.numel() == 0:
        return 0.0
    member = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # [..., k]
    return float(1.0 - member.float().mean())


def diff(name: str, a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> Diff:
    """Compare stage a (the run under test) with b (the reference) under tolerance tol."""
    d = Diff(name, list(a.shape))
    if a.shape != b.shape:
        d.ok, d.reason = False, f"shape {list(a.shape)} vs {list(b.shape)}"
        return d
    if not a.is_floating_point() and not b.is_floating_point():
        d.index_frac = index_mismatch(a, b)
        d.ok = d.index_frac <= tol.index_frac
        if not d.ok:
            d.reason = f"index mismatch {d.index_frac:.2%} > {tol.index_frac:.2%}"
        return d
    af, bf = a.detach().double(), b.detach().double()
    fa, fb = torch.isfinite(af), torch.isfinite(bf)
    d.nonfinite_a, d.nonfinite_b = int((~fa).sum()), int((~fb).sum())
    both = fa & fb
    # same non-finite pattern (e.g. -inf masks) is part of the contract, values are compared where finite
    same_pattern = bool(((af == bf) | both).all()) if (d.nonfinite_a or d.nonfinite_b) else True
    if not same_pattern:
        d.ok, d.reason = False, "non-finite values differ"
    x, y = torch.where(both, af, 0.0), torch.where(both, bf, 0.0)
    err = x - y
    if err.numel():
        d.max_abs = float(err.abs().max())
        nb = float(y.norm())
        d.rel_l2 = float(err.norm()) / nb if nb > 0 else (0.0 if float(err.norm()) == 0 else math.inf)
        na = float(x.norm())
        d.cosine = float((x * y).sum()) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    if d.ok and d.rel_l2 > tol.rel_l2:
        d.ok, d.reason = False, f"rel_l2 {d.rel_l2:.3e} > {tol.rel_l2:.1e}"
    return d


@dataclass
class StageComparison:
    ok: bool
    tolerance: str
    first_divergence: str | None = None
    first: Diff | None = None
    diffs: list[Diff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "tolerance": self.tolerance,
            "first_divergence": self.first_divergence,
            "first": self.first.to_dict() if self.first else None,
            "stages": [d.to_dict() for d in self.diffs],
            "only_a": self.only_a,
            "only_b": self.only_b,
        }


def compare_stages(a: Stages, b: Stages, tol: Tolerance) -> StageComparison:
    """Stage by stage in a's order; the first stage out of tolerance is the first divergence."""
    diffs = [diff(name, t, b[name], tol) for name, t in a.items() if name in b]
    first = next((d for d in diffs if not d.ok), None)
    return StageComparison(
        ok=first is None,
        tolerance=tol.name,
        first_divergence=first.name if first else None,
        first=first,
        diffs=diffs,
        only_a=[n for n in a if n not in b],
        only_b=[n for n in b if n not in a],
    )
