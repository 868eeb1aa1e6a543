"""Teacher forcing: one prefill of N tokens vs prefill of k tokens + N-k single-token decode steps.

Both paths must give the same logits at every position. Discrete decisions (indexer top-k, MoE routing)
can legitimately flip between the two paths at near-ties, because the paths round differently
(a [1, dim] and an [N, dim] matmul accumulate in different orders, and the FP4/FP8 round trips amplify
1-ulp differences into bucket changes). So the decode path is *forced* to take the full path's decisions
(through the stage recorder's replacement hook), and the flips it would have made are counted and
reported separately with the size of the score gap they crossed. What remains is the cache machinery
itself: window ring buffer, compressed entries, compressor and indexer state - where docs/bugzoo.md Z10/Z11 live.

By default both paths also run under `dsv4.ops.precision.exact_accumulation()` (float64 accumulation,
rounded once) on the reference ops, which makes their numbers independent of batching, so that the
quantization round trips see identical inputs in both paths; `exact=False` checks the fast accumulation
and the fast kernels (Triton on a GPU) as they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .. import ops
from ..model import DeepSeekV4
from ..model.layers import recording
from ..ops.precision import exact_accumulation

DECISIONS = (".indexer.topk", ".router_indices")


@dataclass
class TeacherForcingReport:
    ok: bool
    tokens: int
    prefill: int
    batch: int
    max_rel_error: float
    tolerance: float
    first_position: int | None = None  # first position whose logits diverge
    first_row: int | None = None
    first_stage: str | None = None  # first stage (module) that diverges at that position
    stage_error: float | None = None
    forced_flips: dict[str, int] = field(default_factory=dict)  # decisions the decode path would change
    per_position: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row max |a-b| / max |b| over the last dim."""
    return (a.float() - b.float()).abs().amax(-1) / b.float().abs().amax(-1).clamp_min(1e-30)


@torch.no_grad()
def teacher_forcing(
    model: DeepSeekV4,
    tokens: torch.Tensor,
    prefill: int,
    tolerance: float = 1e-4,
    force_decisions: bool = True,
    exact: bool = True,
    progress: bool = False,
) -> TeacherForcingReport:
    """Compare full-sequence logits with prefill(prefill) + decode steps for tokens [b, n]. `progress`: a bar of
    the decode steps on a terminal (dsv4.progress)."""
    with exact_accumulation(exact), _exact_backends(exact):
        return _teacher_forcing(model, tokens, prefill, tolerance, force_decisions, progress)


def _exact_backends(exact: bool) -> contextlib.AbstractContextManager:
    """Under exact accumulation, each op's reference unless the caller asked for a backend (a planted
    mutant's, say): only the references accumulate in float64. A fast kernel (Triton on a GPU) accumulates
    in fp32 in an order of its own that differs between a prefill and a decode step, so their results could
    differ by an ulp of the working dtype, which an exact comparison does not allow."""
    if not exact:
        return contextlib.nullcontext()
    return ops.use_backend({op: ops.requested(op) or "reference" for op in ops.ops()})


def _teacher_forcing(
    model: DeepSeekV4,
    tokens: torch.Tensor,
    prefill: int,
    tolerance: float,
    force_decisions: bool,
    progress: bool = False,
) -> TeacherForcingReport:
    from ..progress import bar

    b, n = tokens.shape
    if not 1 <= prefill <= n:
        raise ValueError(f"prefill length must be in [1, {n}], got {prefill}")
    model.eval()
    full_stages: dict[str, torch.Tensor] = {}

    def keep(name: str, t: torch.Tensor) -> None:
        if t.dim() >= 2 and t.shape[:2] == (b, n) or name.endswith(".router_indices"):
            full_stages[name] = t.detach().clone()

    with recording(keep):
        full = model(tokens).logits  # [b, n, V]

    def token_slice(name: str, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        ref = full_stages[name]
        if name.endswith(".router_indices"):  # flat [b*n, k]
            return ref.view(b, n, -1)[:, lo:hi].reshape(-1, ref.size(-1))
        return ref[:, lo:hi]

    flips: dict[str, int] = {}
    step_stages: dict[int, dict[str, torch.Tensor]] = {}

    def forcer(lo: int, hi: int):
        def fn(name: str, t: torch.Tensor):
            if hi - lo == 1:
                step_stages.setdefault(lo, {})[name] = t.detach().clone()
            if force_decisions and name.endswith(DECISIONS) and name in full_stages:
                want = token_slice(name, t, lo, hi)
                if want.shape == t.shape:
                    if not torch.equal(want, t):
                        flips[name] = flips.get(name, 0) + int((want != t).any(-1).sum())
                    return want
            return None

        return fn

    cache = model.new_cache(b, max_len=n)
    with recording(forcer(0, prefill)):
        outs = [model.prefill(tokens[:, :prefill], cache, last_only=False)]
    with bar(n - prefill, "teacher forcing: decode steps", progress) as steps:
        for i in range(prefill, n):
            with recording(forcer(i, i + 1)):
                outs.append(model.decode_step(tokens[:, i : i + 1], cache))
            steps.update(1)
    inc = torch.cat(outs, 1)

    err = _rel_err(inc, full)  # [b, n]
    per_pos = err.amax(0)
    report = TeacherForcingReport(
        ok=bool((err <= tolerance).all()),
        tokens=n,
        prefill=prefill,
        batch=b,
        max_rel_error=float(err.max()),
        tolerance=tolerance,
        forced_flips=flips,
        per_position=[float(x) for x in per_pos],
    )
    if not report.ok:
        bad = (err > tolerance).nonzero()
        first = bad[bad[:, 1].argmin()]
        row, pos = int(first[0]), int(first[1])
        report.first_row, report.first_position = row, pos
        if pos >= prefill and pos in step_stages:
            for name, t in step_stages[pos].items():  # stage order
                if name not in full_stages or name.endswith(DECISIONS):
                    continue
                ref = full_stages[name][row, pos]
                got = t[row, 0] if t.dim() >= 2 and t.size(1) == 1 else None
                if got is None or got.shape != ref.shape:
                    continue
                e = float(_rel_err(got.flatten(), ref.flatten()))
                if e > tolerance:
                    report.first_stage, report.stage_error = name, e
                    break
    return report
