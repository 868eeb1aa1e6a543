"""`dsv4 check conformance`: every bug-zoo entry (docs/bugzoo.md) as a mutant, and the checks that must catch it.

For each check: it must pass on the correct code (else the suite itself is broken). For each mutant:
planted, its checks run; it is *caught* when at least one fails, *escaped* when all pass, *pending*
when the code it would break does not exist yet, *skipped* when none of its checks ran here (not
selected, or skipped on this device). Exit status 1 when a mutant escapes or a check fails on the
correct code.

The suite runs on one device (`device`): the model, the tokens and every check's inputs live there and
the default backend of each op there is what runs (Triton on CUDA; op-level checks take bf16 inputs where
the fast backend needs them, with a bf16 tolerance against an fp32 reference). `backend` prefers one
backend for every op that has it (an error up front when it cannot run on the device). Every check
result lists the backends that actually ran (`dsv4.ops.calls()`), for the clean code and under each
mutant, whose planted backends replace the fast ones.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .. import ops
from ..config import ModelConfig
from .compare import describe_implementations
from .inputs import check_config
from .mutants import MUTANTS, Mutant
from .zoo import CHECKS, CheckResult, Context, backend_refusals


@dataclass
class Row:
    id: str
    title: str
    status: str  # caught | escaped | pending | skipped | error
    check: str | None = None  # the first check that caught it
    error: float | None = None  # its measured number
    detail: str = ""
    results: dict[str, dict] = field(default_factory=dict)
    by_exception: bool = False  # caught because its check raised (read the detail)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ConformanceReport:
    ok: bool
    preset: str
    seconds: float
    rows: list[Row]
    baseline: dict[str, dict]  # check -> result on the correct code
    device: str = "cpu"
    backend: str | None = None  # the backend preferred for every op (None: each op's default)
    model_dtype: str = "float32"
    op_dtypes: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def backends(self) -> dict[str, dict[str, list[str]]]:
        """check -> {op: backends that ran} on the correct code."""
        return {k: v.get("backends", {}) for k, v in self.baseline.items()}

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "preset": self.preset,
            "device": self.device,
            "backend": self.backend,
            "model_dtype": self.model_dtype,
            "op_dtypes": self.op_dtypes,
            "seconds": round(self.seconds, 2),
            "counts": self.counts(),
            "backends": self.backends(),
            "baseline": self.baseline,
            "mutants": [r.to_dict() for r in self.rows],
        }

    def render(self) -> str:
        pref = f", preferred backend {self.backend}" if self.backend else ", default backends"
        dts = ", ".join(f"{op} {d}" for op, d in self.op_dtypes.items() if d != "float32")
        lines = [
            f"conformance ({self.preset}) on {self.device}{pref}: {len(self.rows)} bug-zoo entries, "
            f"{len(self.baseline)} checks; model {self.model_dtype}" + (f"; op-level inputs {dts}" if dts else ""),
            "  checks on the correct code (backends that ran):",
        ]
        for k, v in self.baseline.items():
            state = "SKIPPED" if v.get("skipped") else ("ok" if v["ok"] else "FAILS")
            where = f" [{v['device']}]" if v.get("device") else ""
            lines.append(f"    {k:<30} {state:<7} {describe_implementations(v.get('backends', {}))}{where}")
            if v.get("skipped"):
                lines.append(f"        skipped on {self.device}: {v['skipped']}")
        broken = {k: v for k, v in self.baseline.items() if not v["ok"] and not v.get("skipped")}
        for k, v in broken.items():
            what = "OFF THE INDEPENDENT ORACLE" if k in ALWAYS else "CHECK FAILS ON CORRECT CODE"
            lines.append(f"  {what}: {k}: {v['detail']}")
        for r in self.rows:
            err = "" if r.error is None else f"{r.error:.3g}"
            what = r.check or ""
            lines.append(f"  {r.id}  {r.status:<8} {what:<30} {err:>10}  {r.title}")
            if r.status in ("caught", "escaped", "error", "skipped") and r.detail:
                lines.append(f"        {r.detail}")
            if r.by_exception:
                lines.append("        (caught by an exception: make sure it is the planted bug that raised)")
            if r.check and r.check in r.results:
                lines.append(f"        ran: {describe_implementations(r.results[r.check].get('backends', {}))}")
        c = self.counts()
        lines.append(", ".join(f"{k}: {v}" for k, v in sorted(c.items())) + f"  ({self.seconds:.1f} s)")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _run(check: str, ctx: Context) -> CheckResult:
    with ops.which_ran() as ran:
        try:
            res = CHECKS[check](ctx)
        except Exception as e:  # noqa: BLE001
            # a mutant that makes a check crash is caught by it; on the correct code it is a broken check
            last = traceback.extract_tb(e.__traceback__)[-1]
            res = CheckResult(
                False,
                None,
                f"raised {type(e).__name__}: {str(e)[:200]} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})",
            )
    res.backends = ran
    if check in READS_STAGES and not ctx.planted:  # it judged the clean run
        for op, bes in ctx.clean_backends.items():
            res.backends[op] = sorted(set(res.backends.get(op, [])) | set(bes))
    return res


@contextlib.contextmanager
def preferred_backend(name: str | None, cfg: ModelConfig, device: torch.device) -> Iterator[None]:
    """Inside the block, backend `name` is the default of every op that has it (above every other backend)
    wherever it can run the call; where it refuses a call (e.g. a dtype or a backward it does not have) the
    op's next backend runs, and the check's `backends` shows it. Raises `BackendUnavailable` up front
    when `name` cannot run on `device` at all."""
    if name is None:
        yield
        return
    have = [op for op in ops.ops() if name in ops.backends(op)]
    if not have:
        known = ops.backend_names()
        raise ops.BackendUnavailable(f"no op has a backend named '{name}' (registered: {', '.join(known)})")
    refused = backend_refusals(name, cfg, device)
    if refused:
        why = "; ".join(f"{op}: {r}" for op, r in refused.items())
        raise ops.BackendUnavailable(f"backend '{name}' cannot run on {device}: {why}")
    with ops.prefer_backend(name):
        yield


# slow checks (a torch.compile with autograd): run with full=True (`--full`)
SLOW = {"compile-attention", "compile-moe"}


def _pending_now(m: Mutant) -> str:
    return m.pending


# checks that run on the correct code whatever mutants are selected: independent oracles, which no planted
# mutant is needed to make meaningful: the model against the official implementation's numbers
# (`dsv4.check.goldens`) and transformers' numbers, and every expert implementation against the
# clamped-SwiGLU formula
ALWAYS = ("official-goldens", "transformers-goldens", "swiglu-formula")


# checks that read the clean run's stages (computed once, before any check and any mutant)
READS_STAGES = {"stage-compare", "router-contract", "attention-backward-structured"}


def run_conformance(
    cfg: ModelConfig | str = "tiny",
    ids: list[str] | None = None,
    seed: int = 0,
    compiler: str = "aot_eager",
    full: bool = False,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    dtype: torch.dtype | None = None,
    checks: list[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ConformanceReport:
    """Plant every selected mutant and run its checks on `device` (see the module docstring).

    backend: prefer this backend for every op that has it; dtype: the check model's dtype (default: fp32,
    or bf16 where the device's fast mHC / MoE backends need it); checks: run only these checks (a mutant
    none of whose checks is selected is reported as skipped); progress: called as (done, total, what)
    before each check on the correct code and each mutant."""
    t0 = time.perf_counter()
    preset = cfg if isinstance(cfg, str) else cfg.name
    device = torch.device(device)
    if checks is not None:
        unknown = sorted(set(checks) - set(CHECKS))
        if unknown:
            raise KeyError(f"unknown checks {unknown} (known: {', '.join(CHECKS)})")
    torch.manual_seed(seed)
    cfg = check_config(cfg)
    with preferred_backend(backend, cfg, device):
        ctx = Context.build(cfg, seed=seed, device=device, dtype=dtype)
        ctx.compiler = compiler
        mutants = [m for m in MUTANTS if ids is None or m.id in ids]

        def checks_of(m: Mutant) -> list[str]:
            return [c for c in m.checks if (full or c not in SLOW) and (checks is None or c in checks)]

        needed = sorted(
            {c for m in mutants if not _pending_now(m) for c in checks_of(m)}
            | {c for c in ALWAYS if checks is None or c in checks}
        )
        if READS_STAGES & set(needed):
            ctx.clean  # noqa: B018
        total = len(needed) + len(mutants)
        step = progress or (lambda done, total, what: None)
        baseline = {}
        for i, c in enumerate(needed):
            step(i, total, f"check {c}")
            t = time.perf_counter()
            baseline[c] = dict(_run(c, ctx).__dict__, seconds=round(time.perf_counter() - t, 2))
        rows = []
        for i, m in enumerate(mutants):
            step(len(needed) + i, total, f"mutant {m.id}")
            rows.append(_mutant_row(m, checks_of(m), ctx, baseline))
        step(total, total, "done")
    ok = all(v["ok"] for v in baseline.values() if not v["skipped"]) and all(
        r.status in ("caught", "pending", "skipped") for r in rows
    )
    return ConformanceReport(
        ok,
        preset,
        time.perf_counter() - t0,
        rows,
        baseline,
        device=str(device),
        backend=backend,
        model_dtype=str(ctx.model_dtype).removeprefix("torch."),
        op_dtypes={op: str(d).removeprefix("torch.") for op, d in ctx.dtypes.items()},
    )


def _mutant_row(m: Mutant, checks: list[str], ctx: Context, baseline: dict[str, dict]) -> Row:
    pending = _pending_now(m)
    if pending:
        return Row(m.id, m.title, "pending", detail=pending)
    runnable = [c for c in checks if not baseline[c]["skipped"]]
    if not runnable:
        why = "; ".join(f"{c}: {baseline[c]['skipped']}" for c in checks) or "none of its checks is selected"
        return Row(m.id, m.title, "skipped", detail=f"not run on {ctx.device}: {why}")
    row = Row(m.id, m.title, "escaped")
    try:
        ctx.planted = True
        with m.plant(ctx):
            ctx.current = None
            for c in runnable:
                res = _run(c, ctx) if baseline[c]["ok"] else CheckResult(True, None, "check broken")
                row.results[c] = res.__dict__
                if not res.ok and row.check is None:
                    row.status, row.check, row.error, row.detail = "caught", c, res.error, res.detail
                    row.by_exception = res.detail.startswith("raised ")
    except Exception as e:  # noqa: BLE001
        row.status, row.detail = "error", f"planting failed: {type(e).__name__}: {e}"
    finally:
        ctx.current = None
        ctx.planted = False
    if row.status == "escaped":
        row.detail = "; ".join(f"{c}: {r['detail']}" for c, r in row.results.items())
    return row
