"""`dsv4 check nonfinite`: run with hooks and stop at the first op that produces NaN/Inf; name it.

Three levels of hooks, innermost first:
- every aten op (a TorchDispatchMode): the first op whose output has a NaN while its inputs have none;
  (infinities are legitimate inside ops: masks use -inf);
- every `dsv4.ops` primitive: NaN or Inf in its outputs (except the -inf masks its contract allows);
- every model stage (`record`) and every module output: NaN or Inf.
The report names the op, the dsv4 op and the module (stage) it ran in, forward or backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ops
from ..model import DeepSeekV4
from ..model.layers import recording

# dsv4 ops whose outputs may hold -inf by contract (masked scores)
MAY_HOLD_NEG_INF = {"indexer_scores"}


class NonFiniteFound(Exception):
    def __init__(self, report: NonFiniteReport):
        super().__init__(report.summary())
        self.report = report


@dataclass
class NonFiniteReport:
    ok: bool
    level: str | None = None  # aten | op | stage | module
    name: str | None = None  # aten op / dsv4 op / stage / module path
    module: str | None = None  # innermost module running
    dsv4_op: str | None = None  # dsv4 op running (if any)
    phase: str = "forward"
    nan: int = 0
    inf: int = 0
    shape: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        if self.ok:
            return "OK: no NaN/Inf produced"
        where = f" in module {self.module}" if self.module else ""
        inside = f" inside dsv4 op {self.dsv4_op}" if self.dsv4_op and self.level == "aten" else ""
        return (
            f"first non-finite ({self.phase}): {self.level} '{self.name}'{inside}{where}: "
            f"{self.nan} NaN, {self.inf} Inf in a tensor of shape {self.shape}"
        )


def _counts(t) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.element_size() < 2:
        return 0, 0  # fp8 storage is decoded before use and checked there
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class _Tracker:
    def __init__(self):
        self.modules: list[str] = []
        self.op: str | None = None
        self.phase = "forward"

    def fail(self, level: str, name: str, t: torch.Tensor, nan: int, inf: int) -> None:
        raise NonFiniteFound(
            NonFiniteReport(
                False,
                level,
                name,
                self.modules[-1] if self.modules else None,
                self.op,
                self.phase,
                nan,
                inf,
                list(t.shape),
            )
        )


class _NaNOps(TorchDispatchMode):
    """First aten op whose output has NaN while none of its inputs had one."""

    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            nan, inf = _counts(t)
            if nan and not any(_counts(i)[0] for i in _tensors((args, kwargs or {}))):
                self.tracker.fail("aten", str(func.overloadpacket.__name__), t, nan, inf)
        return out


@contextlib.contextmanager
def _watch_ops(tracker: _Tracker):
    """Wrap `dsv4.ops.call` so every primitive's outputs are checked."""
    original = ops.call

    def checked(op, *args, backend=None, **kwargs):
        prev, tracker.op = tracker.op, op
        try:
            out = original(op, *args, backend=backend, **kwargs)
        finally:
            tracker.op = prev
        for t in _tensors(out):
            nan, inf = _counts(t)
            if op in MAY_HOLD_NEG_INF:
                inf = int(torch.isposinf(t).sum()) if t.is_floating_point() else 0
            if nan or inf:
                tracker.fail("op", f"{op}[{ops.last_backend(op)}]", t, nan, inf)
        return out

    ops.call = checked
    try:
        yield
    finally:
        ops.call = original


@contextlib.contextmanager
def _watch_modules(model: torch.nn.Module, tracker: _Tracker):
    handles = []
    for name, mod in model.named_modules():
        path = name or "model"

        def pre(m, inp, path=path):
            tracker.modules.append(path)

        def post(m, inp, out, path=path):
            if tracker.modules and tracker.modules[-1] == path:
                tracker.modules.pop()
            for t in _tensors(out):
                nan, inf = _counts(t)
                if nan or inf:
                    tracker.fail("module", path, t, nan, inf)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def find_nonfinite(
    model: DeepSeekV4, tokens: torch.Tensor, backward: bool = True, aten: bool = True
) -> NonFiniteReport:
    """Forward (and backward) with every hook armed; the first producer of NaN/Inf is reported."""
    tracker = _Tracker()

    def stage(name: str, t: torch.Tensor):
        nan, inf = _counts(t)
        if nan or inf:
            tracker.fail("stage", name, t, nan, inf)
        return None

    mode = _NaNOps(tracker) if aten else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    try:
        with _watch_ops(tracker), _watch_modules(model, tracker), recording(stage), mode:
            out = model(tokens)
            loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            if backward:
                tracker.phase, tracker.modules = "backward", []
                loss.backward()
        if backward:
            for n, p in model.named_parameters():
                if p.grad is not None:
                    nan, inf = _counts(p.grad)
                    if nan or inf:
                        tracker.fail("gradient", n, p.grad, nan, inf)
    except NonFiniteFound as e:
        return e.report
    finally:
        model.zero_grad(set_to_none=True)
    return NonFiniteReport(True)
