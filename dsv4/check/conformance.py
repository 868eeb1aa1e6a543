"""`dsv4 check conformance`: every BUGZOO entry as a mutant, and the checks that must catch it.

For each check: it must pass on the correct code (else the suite itself is broken). For each mutant:
planted, its checks run; it is *caught* when at least one fails, *escaped* when all pass, *pending*
when the code it would break does not exist yet. Exit status 1 when a mutant escapes or a check fails
on the correct code.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from .inputs import check_config
from .mutants import MUTANTS, Mutant
from .zoo import CHECKS, CheckResult, Context


@dataclass
class Row:
    id: str
    title: str
    status: str                               # caught | escaped | pending | error
    check: str | None = None                  # the first check that caught it
    error: float | None = None                # its measured number
    detail: str = ""
    results: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ConformanceReport:
    ok: bool
    preset: str
    seconds: float
    rows: list[Row]
    baseline: dict[str, dict]                 # check -> result on the correct code

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "preset": self.preset, "seconds": round(self.seconds, 2), "counts": self.counts(),
                "baseline": self.baseline, "mutants": [r.to_dict() for r in self.rows]}

    def render(self) -> str:
        lines = [f"conformance ({self.preset}): {len(self.rows)} bug-zoo entries, {len(self.baseline)} checks"]
        broken = {k: v for k, v in self.baseline.items() if not v["ok"]}
        for k, v in broken.items():
            lines.append(f"  CHECK FAILS ON CORRECT CODE: {k}: {v['detail']}")
        for r in self.rows:
            err = "" if r.error is None else f"{r.error:.3g}"
            what = r.check or ""
            lines.append(f"  {r.id}  {r.status:<8} {what:<30} {err:>10}  {r.title}")
            if r.status in ("caught", "escaped", "error") and r.detail:
                lines.append(f"        {r.detail}")
        c = self.counts()
        lines.append(", ".join(f"{k}: {v}" for k, v in sorted(c.items())) + f"  ({self.seconds:.1f} s)")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


def _run(check: str, ctx: Context) -> CheckResult:
    try:
        return CHECKS[check](ctx)
    except Exception as e:                                                       # noqa: BLE001
        # a mutant that makes a check crash is caught by it; on the correct code it is a broken check
        last = traceback.extract_tb(e.__traceback__)[-1]
        return CheckResult(False, None, f"raised {type(e).__name__}: {str(e)[:200]} "
                                        f"({last.filename.rsplit('/', 1)[-1]}:{last.lineno})")


# slow checks (a torch.compile with autograd): run with full=True (`--full`)
SLOW = {"compile-attention", "compile-moe"}


def _pending_now(m: Mutant) -> str:
    return m.pending


def run_conformance(cfg: ModelConfig | str = "tiny", ids: list[str] | None = None, seed: int = 0,
                    compiler: str = "aot_eager", full: bool = False) -> ConformanceReport:
    t0 = time.perf_counter()
    preset = cfg if isinstance(cfg, str) else cfg.name
    torch.manual_seed(seed)
    ctx = Context.build(check_config(cfg), seed=seed)
    ctx.compiler = compiler
    mutants = [m for m in MUTANTS if ids is None or m.id in ids]
    def checks_of(m: Mutant) -> list[str]:
        return [c for c in m.checks if full or c not in SLOW]

    needed = sorted({c for m in mutants if not _pending_now(m) for c in checks_of(m)})
    baseline = {}
    for c in needed:
        t = time.perf_counter()
        baseline[c] = dict(_run(c, ctx).__dict__, seconds=round(time.perf_counter() - t, 2))
    rows = []
    for m in mutants:
        pending = _pending_now(m)
        if pending:
            rows.append(Row(m.id, m.title, "pending", detail=pending))
            continue
        row = Row(m.id, m.title, "escaped")
        try:
            with m.plant(ctx):
                ctx.current = None
                for c in checks_of(m):
                    res = _run(c, ctx) if baseline[c]["ok"] else CheckResult(True, None, "check broken")
                    row.results[c] = res.__dict__
                    if not res.ok and row.check is None:
                        row.status, row.check, row.error, row.detail = "caught", c, res.error, res.detail
        except Exception as e:                                                   # noqa: BLE001
            row.status, row.detail = "error", f"planting failed: {type(e).__name__}: {e}"
        finally:
            ctx.current = None
        if row.status == "escaped":
            row.detail = "; ".join(f"{c}: {r['detail']}" for c, r in row.results.items())
        rows.append(row)
    ok = all(v["ok"] for v in baseline.values()) and all(r.status in ("caught", "pending") for r in rows)
    return ConformanceReport(ok, preset, time.perf_counter() - t0, rows, baseline)
