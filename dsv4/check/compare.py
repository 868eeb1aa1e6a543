"""`dsv4 check compare`: run two configurations stage by stage and name the first stage that diverges.

A *side* is a model plus how to run it: ops backends, dtype, eager or `torch.compile`, or an external
implementation. Each run records its stages and the implementations that actually ran (`dsv4.ops.calls()`
deltas), so a backend flag is never trusted without evidence (docs/bugzoo.md Z22).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..errors import UserError
from ..model import DeepSeekV4
from .capture import Injector, Stages, capturing
from .metrics import TOLERANCES, Diff, StageComparison, Tolerance, compare_stages, diff, tolerance_for

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
# An external runner: tokens [b, s] -> logits [b, s, V], or (logits, {stage name: tensor}).
ExternalRunner = Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, Stages]"]


@dataclass
class Side:
    label: str
    model: nn.Module | None = None
    backend: str | dict[str, str] | None = None
    compile: bool | str = False  # True = torch.compile default (inductor), or a backend name
    external: ExternalRunner | None = None
    inject: Injector | None = None
    context: Callable[[], contextlib.AbstractContextManager] | None = None  # e.g. a planted mutant


@dataclass
class RunResult:
    label: str
    logits: torch.Tensor
    stages: Stages
    implementations: dict[str, list[str]] = field(default_factory=dict)  # op -> backends that ran


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype '{name}'; choose one of fp32, bf16, fp16") from None


def backend_choice(name: str) -> tuple[dict[str, str], list[str]]:
    """{op: name} for every op that has backend `name`, and the ops that do not have it."""
    have, missing = {}, []
    for op in ops.ops():
        (have.__setitem__(op, name) if name in ops.backends(op) else missing.append(op))
    if not have:
        known = ops.backend_names()
        raise UserError(f"no op has a backend named '{name}' (registered: {', '.join(known)})")
    return have, missing


def describe_implementations(impl: dict[str, list[str]]) -> str:
    """`moe_experts=grouped; every other op (9) reference` - what actually ran, compactly."""
    if not impl:
        return "no dsv4 op ran"
    names = {op: "/".join(b) for op, b in impl.items()}
    common = max(set(names.values()), key=list(names.values()).count)
    rest = [f"{op}={b}" for op, b in names.items() if b != common]
    n_common = len(names) - len(rest)
    tail = f"{'every other op' if rest else 'every op'} ({n_common}): {common}"
    return "; ".join(rest + [tail])


def run_side(side: Side, tokens: torch.Tensor) -> RunResult:
    """One forward pass of a side with stage capture."""
    if side.external is not None:
        out = side.external(tokens)
        logits, stages = out if isinstance(out, tuple) else (out, {})
        stages = dict(stages)
        stages.setdefault("head.logits", logits)
        return RunResult(side.label, logits.detach().float(), {k: v.detach() for k, v in stages.items()})
    model = side.model
    if side.compile:
        fn = torch.compile(model) if side.compile is True else torch.compile(model, backend=side.compile)
    else:
        fn = model
    ctx = ops.use_backend(side.backend) if side.backend is not None else contextlib.nullcontext()
    extra = side.context() if side.context is not None else contextlib.nullcontext()
    with ops.which_ran() as ran, torch.no_grad(), extra, ctx, capturing(inject=side.inject) as cap:
        try:
            logits = fn(tokens).logits
        except ops.BackendUnavailable as e:
            raise UserError(f"{side.label}: {e}") from None
    return RunResult(side.label, logits.detach().float(), cap.stages, ran)


@dataclass
class CompareReport:
    ok: bool
    a: str
    b: str
    tolerance: str
    stages: StageComparison
    logits: Diff
    implementations: dict[str, dict[str, list[str]]]
    notes: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:
        return self.stages.first_divergence

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "a": self.a,
            "b": self.b,
            "tolerance": self.tolerance,
            "first_divergence": self.first_divergence,
            "logits": self.logits.to_dict(),
            "implementations": self.implementations,
            "notes": self.notes,
            **{k: v for k, v in self.stages.to_dict().items() if k not in ("ok", "tolerance", "first_divergence")},
        }

    def render(self, max_rows: int = 12) -> str:
        lines = [f"compare: A = {self.a}   B = {self.b}   (tolerance: {self.tolerance})"]
        for label, impl in self.implementations.items():
            if impl:
                lines.append(f"  ran on {label}: {describe_implementations(impl)}")
        lines += [f"  note: {n}" for n in self.notes]
        diffs = self.stages.diffs
        if self.stages.first is None:
            shown = diffs[-max_rows:] if len(diffs) > max_rows else diffs
        else:
            i = diffs.index(self.stages.first)
            shown = diffs[max(0, i - 3) : i + max_rows - 3]
        lines.append(f"  {len(diffs)} common stages; showing {len(shown)}:")
        for d in shown:
            lines.append(("  ! " if not d.ok else "    ") + d.summary())
        if self.stages.only_a or self.stages.only_b:
            lines.append(f"  stages only in A: {len(self.stages.only_a)}, only in B: {len(self.stages.only_b)}")
        lines.append("  logits: " + self.logits.summary().split(None, 1)[1])
        if self.ok:
            lines.append("OK: every stage within tolerance")
        else:
            f = self.stages.first
            where = f"first divergence: {f.name} ({f.reason})" if f else f"logits differ ({self.logits.reason})"
            lines.append(f"DIVERGED: {where}")
        return "\n".join(lines)


DECISIONS = (".indexer.topk", ".router_indices")


def _forcing(ref: Stages, chosen: Stages, outer: Injector | None) -> Injector:
    """Injector that makes a run take the reference run's discrete decisions (top-k, routing) and keeps
    the decisions it would have taken in `chosen`: near-ties may flip legitimately between
    implementations, and one flipped expert would otherwise hide every later continuous difference."""
    seen: dict[str, int] = {}

    def fn(name: str, t: torch.Tensor):
        if outer is not None:
            out = outer(name, t)
            t = t if out is None else out
        if not name.endswith(DECISIONS):
            return t
        k = seen.get(name, 0)
        seen[name] = k + 1
        key = name if k == 0 else f"{name}#{k}"
        chosen[key] = t.detach().clone()
        want = ref.get(key)
        return want if want is not None and want.shape == t.shape else t

    return fn


def compare(
    a: Side, b: Side, tokens: torch.Tensor, tol: Tolerance | None = None, force_decisions: bool = True
) -> CompareReport:
    """Run both sides on tokens and compare stage by stage (A = under test, B = reference).

    force_decisions: A takes B's top-k / routing decisions; the decisions A would have taken are still
    compared (as index mismatch fractions), and continuous stages measure the error given equal decisions.
    """
    rb = run_side(b, tokens)
    chosen: Stages = {}
    if force_decisions and a.external is None:
        a = Side(a.label, a.model, a.backend, a.compile, a.external, _forcing(rb.stages, chosen, a.inject), a.context)
    elif force_decisions and hasattr(a.external, "force"):
        a.external.force = rb.stages  # an external runner that can take decisions
    ra = run_side(a, tokens)
    ra.stages.update(chosen)
    if tol is None:
        dts = [s.model.embed.weight.dtype for s in (a, b) if s.model is not None]
        tol = tolerance_for(*dts)
    stages = compare_stages(ra.stages, rb.stages, tol)
    logits = diff("head.logits", ra.logits, rb.logits, tol)
    notes = []
    if force_decisions and a.external is None:
        notes.append("A ran with B's top-k and routing decisions; index stages show the decisions A would take")
    if a.external is not None or b.external is not None:
        notes.append("external side: only the stages it reports are compared")
    return CompareReport(
        ok=stages.ok and logits.ok,
        a=a.label,
        b=b.label,
        tolerance=tol.name,
        stages=stages,
        logits=logits,
        implementations={a.label: ra.implementations, b.label: rb.implementations},
        notes=notes,
    )


# ------------------------------------------------------------------------------ building sides
def build_model(
    preset: str | None = None,
    checkpoint: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cfg: ModelConfig | None = None,
    keep_quantized: bool = False,
    quant_mode: str | None = None,
) -> DeepSeekV4:
    """A model from a checkpoint directory (quant_mode: numerics of its FP8 / FP4 weights, default the
    config's), else a random one (preset or cfg) with a fixed seed."""
    if checkpoint is not None:
        from ..checkpoint import CheckpointError, load_pretrained

        try:
            return load_pretrained(checkpoint, dtype=dtype, keep_quantized=keep_quantized, quant_mode=quant_mode)
        except (CheckpointError, FileNotFoundError) as e:
            raise UserError(f"cannot load checkpoint '{checkpoint}': {e}") from None
    if cfg is None:
        try:
            cfg = ModelConfig.preset(preset or "tiny")
        except (KeyError, ValueError) as e:
            raise UserError(str(e)) from None
    return DeepSeekV4.from_config(cfg, seed=seed, dtype=dtype).eval()


@torch.no_grad()
def perturbed(model: nn.Module, name: str, eps: float = 1e-2, seed: int = 0) -> nn.Module:
    """A deep copy of model with parameter `name` nudged by eps * its RMS * N(0, 1)."""
    params = dict(model.named_parameters())
    if name not in params:
        near = [n for n in params if name.split(".")[-1] in n][:5]
        raise UserError(f"model has no parameter '{name}'" + (f"; similar: {', '.join(near)}" if near else ""))
    other = copy.deepcopy(model)
    p = dict(other.named_parameters())[name]
    gen = torch.Generator().manual_seed(seed)
    rms = p.detach().float().square().mean().sqrt().clamp_min(1e-6)
    p.add_((torch.randn(p.shape, generator=gen) * rms * eps).to(p.dtype))
    return other


def load_external(spec: str, model: nn.Module) -> ExternalRunner:
    """`module:callable` -> callable(model) -> runner(tokens). `hf` is the transformers adapter."""
    if spec in ("hf", "transformers"):
        spec = "dsv4.check.hf:runner"
    if ":" not in spec:
        raise UserError(f"--external wants module:callable, got '{spec}'")
    mod_name, attr = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"cannot import '{mod_name}' for --external: {e}") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise UserError(f"module '{mod_name}' has no '{attr}'")
    return fn(model)


def parse_tolerance(name: str | None) -> Tolerance | None:
    if name is None:
        return None
    if name in TOLERANCES:
        return TOLERANCES[name]
    try:
        v = float(name)
    except ValueError:
        raise UserError(f"--tolerance must be one of {', '.join(TOLERANCES)} or a number, got '{name}'") from None
    return Tolerance(v, 0.02 if v > 0 else 0.0, f"rel_l2<={v:g}")
