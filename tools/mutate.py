"""Source mutation testing: how many ordinary one-line bugs do the test suite and `dsv4 check conformance`
catch?

The bug zoo (`dsv4.check.mutants`) plants the failures we know of through injection points, so it can
only measure the checks against bugs someone already imagined in the shape the checks expect. This
module edits the *source*: each entry of `MUTATIONS` replaces one line of one file of a copy of the
package in a temporary directory, then runs (a) a fast subset of the test suite and (b) `dsv4 check
conformance --preset tiny` on the copy. A mutation is killed by a side when that side fails. Nothing in the
working tree is modified.

Each entry's `old` text must occur exactly once in its file: when the code moves, the entry fails loudly
("not found") instead of silently testing nothing, and the list is updated with the code.

    python3 tools/mutate.py --list
    python3 tools/mutate.py --only fp8-kv-sim-off,ns-4-steps --no-conformance
    python3 tools/mutate.py                     # everything: ~2 min per mutation on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the fast subset of the suite run on every mutation (in this order; -x stops at the first failure)
FAST_SUITE = (
    "tests/model/test_oracles.py",
    "tests/model/test_goldens.py",
    "tests/formats/test_formats.py",
    "tests/ops/test_ops_reference.py",
    "tests/model/test_model.py",
    "tests/checkpoint/test_checkpoint.py",
    "tests/train/test_train.py",
)


@dataclass(frozen=True)
class Mutation:
    """One one-line bug: in `path`, the text `old` (exactly one occurrence) becomes `new`.

    area: model / ops / formats / optimizer / checkpoint / data; semantic: the bug changes what the model
    computes, so `dsv4 check conformance` is expected to catch it (optimizer and data bugs are the suite's);
    kills: tests that must catch it on their own (the quick selection the CI test runs)."""

    id: str
    area: str
    path: str
    old: str
    new: str
    what: str
    semantic: bool
    kills: tuple[str, ...] = ()


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "sink-times-scale",
        "ops",
        "dsv4/ops/reference.py",
        "sink_col = sink.to(acc).view(1, 1, h, 1).expand(b, s, h, 1)",
        "sink_col = (sink.to(acc) * scale).view(1, 1, h, 1).expand(b, s, h, 1)",
        "the attention sink logit multiplied by the softmax scale",
        True,
        ("tests/model/test_oracles.py::test_sparse_attention_against_float64_softmax_with_sink",),
    ),
    Mutation(
        "swiglu-gate-clamped-below",
        "ops",
        "dsv4/ops/reference.py",
        "gate = gate.clamp(max=swiglu_limit)",
        "gate = gate.clamp(-swiglu_limit, swiglu_limit)",
        "the SwiGLU gate clamped from below too (reference expert FFN)",
        True,
        ("tests/model/test_oracles.py::test_clamped_swiglu_against_formula",),
    ),
    Mutation(
        "swiglu-gate-clamped-below-shared",
        "ops",
        "dsv4/ops/moe_shared.py",
        "gate = gate.clamp(max=limit)",
        "gate = gate.clamp(-limit, limit)",
        "the SwiGLU gate clamped from below too (grouped / triton expert FFN)",
        True,
        ("tests/model/test_oracles.py::test_clamped_swiglu_against_formula",),
    ),
    Mutation(
        "swiglu-up-not-clamped-below-shared",
        "ops",
        "dsv4/ops/moe_shared.py",
        "up = up.clamp(-limit, limit)",
        "up = up.clamp(max=limit)",
        "the SwiGLU up projection clamped from above only (grouped / triton expert FFN)",
        True,
        ("tests/model/test_oracles.py::test_clamped_swiglu_against_formula",),
    ),
    Mutation(
        "mtp-embedding-not-normed",
        "model",
        "dsv4/model/block.py",
        "return self.e_proj(self.enorm(e)).unsqueeze(2) + self.h_proj(self.hnorm(h))",
        "return self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h))",
        "the MTP block's next-token embedding not RMS-normed before e_proj",
        True,
        ("tests/model/test_goldens.py::test_official_goldens_match",),
    ),
    Mutation(
        "output-rotated-forward",
        "model",
        "dsv4/model/attention.py",
        "o = apply_rope_tail(o, self.rope, positions, inverse=True)",
        "o = apply_rope_tail(o, self.rope, positions, inverse=False)",
        "the attention output rotated forward instead of de-rotated",
        True,
        ("tests/model/test_oracles.py::test_attention_is_translation_invariant",),
    ),
    Mutation(
        "fp8-kv-sim-off",
        "model",
        "dsv4/model/attention.py",
        "        if self.cfg.fp8_kv_sim:",
        "        if False:",
        "the window-KV FP8 simulation silently off",
        True,
        ("tests/model/test_oracles.py::test_fp8_kv_simulation_happens",),
    ),
    Mutation(
        "compressed-fp8-sim-off",
        "model",
        "dsv4/model/attention.py",
        "        elif self.fp8_sim:",
        "        elif False:",
        "the compressed-KV FP8 simulation silently off",
        True,
        ("tests/model/test_oracles.py::test_fp8_kv_simulation_happens",),
    ),
    Mutation(
        "compressed-rope-position",
        "model",
        "dsv4/model/attention.py",
        "entries = apply_rope_tail(entries, self.rope, entry_ids * self.ratio)",
        "entries = apply_rope_tail(entries, self.rope, entry_ids)",
        "compressed entry j roped at position j instead of j * ratio",
        True,
        ("tests/model/test_goldens.py::test_official_goldens_match",),
    ),
    Mutation(
        "rope-wrong-direction",
        "ops",
        "dsv4/ops/reference.py",
        "y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)",
        "y = torch.stack([x0 * cos + x1 * sin, -x0 * sin + x1 * cos], dim=-1).flatten(-2)",
        "rotary embedding turning the other way (forward and inverse swapped)",
        True,
    ),
    Mutation(
        "rms-norm-sum",
        "ops",
        "dsv4/ops/reference.py",
        "y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)",
        "y = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)",
        "RMS norm over the sum of squares instead of the mean",
        True,
    ),
    Mutation(
        "compressed-visible-early",
        "ops",
        "dsv4/ops/reference.py",
        'return j < torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(-1)',
        'return j <= torch.div(positions + 1, ratio, rounding_mode="floor").unsqueeze(-1)',
        "a compressed entry visible one group before it is complete (future leak)",
        True,
    ),
    Mutation(
        "sinkhorn-one-iteration-short",
        "ops",
        "dsv4/ops/reference.py",
        "for _ in range(iters - 1):",
        "for _ in range(iters - 2):",
        "mHC Sinkhorn one (row, column) normalization short",
        True,
        ("tests/model/test_oracles.py::test_hc_sinkhorn_against_hand_written_iteration",),
    ),
    Mutation(
        "route-scale-dropped",
        "ops",
        "dsv4/ops/reference.py",
        "return (picked * route_scale).float(), indices, scores",
        "return picked.float(), indices, scores",
        "routing weights without route_scale",
        True,
    ),
    Mutation(
        "muon-coefficient",
        "optimizer",
        "dsv4/train/muon_batched.py",
        "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)",
        "NS_COEFFICIENTS = (3.4445, -4.7750, 2.0)",
        "a wrong Muon Newton-Schulz coefficient",
        False,
    ),
    Mutation(
        "ns-4-steps",
        "optimizer",
        "dsv4/train/optim.py",
        "def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS,",
        "def newton_schulz(g: torch.Tensor, steps: int = 4,",
        "the Newton-Schulz diagnostic running 4 steps instead of 5",
        False,
        ("tests/model/test_oracles.py::test_newton_schulz_diagnostic_is_five_quintic_steps",),
    ),
    Mutation(
        "loader-position-not-restored",
        "data",
        "dsv4/train/data.py",
        'self.state = LoaderState(int(d["epoch"]), int(d["index"]))',
        'self.state = LoaderState(int(d["epoch"]), 0)',
        "the data-loader position not restored on resume",
        False,
    ),
    Mutation(
        "expert-scale-of-expert-0",
        "checkpoint",
        "dsv4/checkpoint/quantized.py",
        'self.fmt, getattr(self, f"{w}_q")[j], getattr(self, f"{w}_scale")[j], self.compute_dtype',
        'self.fmt, getattr(self, f"{w}_q")[j], getattr(self, f"{w}_scale")[0], self.compute_dtype',
        "every quantized expert dequantized with expert 0's block scales",
        False,
    ),
    Mutation(
        "fp8-scale-floor",
        "formats",
        "dsv4/formats/fp8.py",
        'sbytes = e8m0_encode(amax / FP8_MAX, "ceil")',
        'sbytes = e8m0_encode(amax / FP8_MAX / 2, "ceil")',
        "FP8 weight block scale one power of two too small (values clamp at 448)",
        False,
        ("tests/model/test_oracles.py::test_fp8_scale_bytes_from_the_formula",),
    ),
    Mutation(
        "mxfp4-scale-max",
        "formats",
        "dsv4/formats/fp4.py",
        'sbytes = e8m0_encode(amax / FP4_MAX, "ceil")',
        'sbytes = e8m0_encode(amax / 4.0, "ceil")',
        "MXFP4 block scale from amax / 4 instead of amax / 6",
        False,
        ("tests/model/test_oracles.py::test_mxfp4_scale_bytes_from_the_formula",),
    ),
)

BY_ID = {m.id: m for m in MUTATIONS}


@dataclass
class Outcome:
    id: str
    area: str
    semantic: bool
    suite: str = "not run"  # killed / survived / timeout / error / not run
    conformance: str = "not run"
    suite_detail: str = ""
    conformance_detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def mutated_copy(m: Mutation, dest: Path) -> Path:
    """Copy the package, its tests and pyproject.toml to dest and apply m there; returns dest."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    shutil.copytree(ROOT / "dsv4", dest / "dsv4", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    target = dest / m.path
    text = target.read_text()
    n = text.count(m.old)
    if n != 1:
        raise ValueError(
            f"mutation {m.id}: the text to replace occurs {n} times in {m.path} (must be once): "
            f"update the entry with the code"
        )
    target.write_text(text.replace(m.old, m.new))
    return dest


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env.pop("TRITON_INTERPRET", None)
    return env


def _tail(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-300:]


def run_suite(copy: Path, tests: Sequence[str], timeout: float) -> tuple[str, str]:
    """pytest on the copy (one process, stop at the first failure): killed when it does not pass."""
    # the real-inductor test builds C++ for a minute and guards the compiler path, not the semantics
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n0", "-p", "no:cacheprovider", "-k", "not inductor", *tests]
    try:
        p = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        # not a kill: on a loaded machine a clean run can take this long too (rerun with a larger --timeout)
        return "timeout", f"timed out after {timeout:.0f} s"
    # 1: tests failed (killed); 0: all passed; anything else (collection error, no tests): the run broke
    status = {0: "survived", 1: "killed"}.get(p.returncode, "error")
    failed = [ln.strip() for ln in p.stdout.splitlines() if ln.startswith("FAILED tests/")]
    return status, (" | ".join(failed[:3])[-300:] if failed else _tail(p.stdout + p.stderr))


def run_conformance_cli(copy: Path, timeout: float) -> tuple[str, str]:
    """`dsv4 check conformance --preset tiny` on the copy: killed when it exits non-zero."""
    cmd = [sys.executable, "-m", "dsv4", "check", "conformance", "--preset", "tiny"]
    try:
        p = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"timed out after {timeout:.0f} s"
    failed = [ln.strip() for ln in p.stdout.splitlines() if "FAIL" in ln or "escaped" in ln]
    return ("survived" if p.returncode == 0 else "killed"), (" | ".join(failed[:3]) or _tail(p.stdout + p.stderr))


def run_mutation(
    m: Mutation, suite: bool = True, conformance: bool = True, quick: bool = False, timeout: float = 900.0
) -> Outcome:
    """Apply m to a temporary copy and run the selected sides. quick: only m's own `kills` tests."""
    out = Outcome(m.id, m.area, m.semantic)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsv4-mutant-") as tmp:
        copy = mutated_copy(m, Path(tmp))
        if suite:
            tests = m.kills if quick else FAST_SUITE
            if tests:
                out.suite, out.suite_detail = run_suite(copy, tests, timeout)
        if conformance:
            out.conformance, out.conformance_detail = run_conformance_cli(copy, timeout)
    out.seconds = round(time.perf_counter() - t0, 1)
    return out


def kill_rates(outcomes: Sequence[Outcome]) -> dict[str, dict[str, str]]:
    """Per area and overall: 'killed/run' for the suite, and for conformance over the semantic mutations."""
    rates: dict[str, dict[str, str]] = {}
    for area in sorted({o.area for o in outcomes}) + ["all"]:
        sel = [o for o in outcomes if area in ("all", o.area)]
        row = {}
        ran = [o for o in sel if o.suite != "not run"]
        if ran:
            row["suite"] = f"{sum(o.suite == 'killed' for o in ran)}/{len(ran)}"
        ran = [o for o in sel if o.conformance != "not run" and o.semantic]
        if ran:
            row["conformance"] = f"{sum(o.conformance == 'killed' for o in ran)}/{len(ran)}"
        rates[area] = row
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 tools/mutate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--only", default="", help="comma-separated mutation ids (default: all)")
    p.add_argument("--no-suite", action="store_true", help="skip the test-suite side")
    p.add_argument("--no-conformance", action="store_true", help="skip the `dsv4 check conformance` side")
    p.add_argument("--quick", action="store_true", help="suite side: only each mutation's own killing tests")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per side per mutation (default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the outcomes and kill rates as JSON")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.id:34s} {m.area:10s} {'semantic' if m.semantic else '        '}  {m.path}: {m.what}")
        return 0
    ids = [s for s in args.only.split(",") if s]
    unknown = [i for i in ids if i not in BY_ID]
    if unknown:
        print(f"error: unknown mutation ids {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    chosen = [BY_ID[i] for i in ids] if ids else list(MUTATIONS)
    outcomes = []
    for m in chosen:
        try:
            o = run_mutation(
                m, suite=not args.no_suite, conformance=not args.no_conformance, quick=args.quick, timeout=args.timeout
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        outcomes.append(o)
        print(f"{o.id:34s} suite: {o.suite:9s} conformance: {o.conformance:9s} ({o.seconds:.0f} s)", flush=True)
        for side, detail in (("suite", o.suite_detail), ("conformance", o.conformance_detail)):
            status = getattr(o, side)
            if status in ("survived", "error", "timeout"):
                print(f"    {side} {'passed' if status == 'survived' else status}: {detail}", flush=True)
    rates = kill_rates(outcomes)
    for area, row in rates.items():
        print(f"{area:10s} " + "  ".join(f"{k} killed {v}" for k, v in row.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"outcomes": [asdict(o) for o in outcomes], "rates": rates}, indent=1))
    # the goal: every mutation killed by the suite, every semantic one by conformance too
    missed = any(
        o.suite in ("survived", "error", "timeout") or (o.semantic and o.conformance in ("survived", "timeout"))
        for o in outcomes
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
