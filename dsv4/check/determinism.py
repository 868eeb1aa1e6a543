"""`dsv4 check determinism`: N identical runs of forward + backward; every output, stage and gradient
must hash the same (docs/bugzoo.md Z09, Z18). Reports which tensors drift and by how much."""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ops
from ..model import DeepSeekV4
from .capture import capturing


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 (16 hex digits) of a tensor's dtype, shape and bytes."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


@dataclass
class DeterminismReport:
    ok: bool
    runs: int
    tensors: int
    backend: str | None
    drifting: list[dict] = field(default_factory=list)  # name, distinct hashes, max abs difference
    implementations: dict[str, list[str]] = field(default_factory=dict)
    first_op: dict | None = None  # see locate_nondeterminism

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def render(self) -> str:
        lines = [
            f"determinism: {self.runs} runs of forward + backward, {self.tensors} tensors hashed "
            f"(backend: {self.backend or 'default'})"
        ]
        if self.implementations:
            from .compare import describe_implementations

            lines.append(f"  ran: {describe_implementations(self.implementations)}")
        for d in self.drifting[:20]:
            lines.append(f"  ! {d['name']:<40} {d['distinct']} distinct hashes, max abs diff {d['max_abs']:.3e}")
        if len(self.drifting) > 20:
            lines.append(f"  ... {len(self.drifting) - 20} more")
        if self.first_op:
            f = self.first_op
            lines.append(
                f"  first nondeterministic op: {f['op']} ({f['phase']}"
                + (f", in {f['where']}" if f.get("where") else "")
                + f"), op #{f['index']}: "
                + f["reason"]
            )
        lines.append("OK: bit-identical" if self.ok else f"DRIFT: {len(self.drifting)} tensors differ between runs")
        return "\n".join(lines)


class _OpTrace(TorchDispatchMode):
    """Every aten op of a run: (name, phase, where, hash of inputs, hash of outputs)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, str, str, str]] = []
        self.phase, self.stage = "forward", ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        where = node.name() if node is not None else self.stage
        h_in = _hash_all((args, kwargs or {}))
        self.ops.append((str(func.overloadpacket.__name__), self.phase, where, h_in, _hash_all(out)))
        return out


def _hash_all(x) -> str:
    if isinstance(x, torch.Tensor):
        return tensor_hash(x) if x.device.type != "meta" else "meta"
    if isinstance(x, (list, tuple)):
        return hashlib.sha256("".join(_hash_all(v) for v in x).encode()).hexdigest()[:16]
    if isinstance(x, dict):
        return _hash_all(list(x.values()))
    return repr(x)[:32]


def _one_run(model: DeepSeekV4, tokens: torch.Tensor, trace: _OpTrace | None = None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)

    def stage(name: str, t: torch.Tensor):
        if trace is not None:
            trace.stage = f"after stage {name}"

    with capturing(inject=stage) as cap:
        out = model(tokens, mtp=len(model.mtp) > 0 and not model.cfg.dspark)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        for lg in out.mtp_logits:
            loss = loss + lg.float().logsumexp(-1).mean() * 0.1
    if trace is not None:
        trace.phase = "backward"
    loss.backward()
    tensors = {"loss": loss.detach(), "logits": out.logits.detach()}
    tensors.update({f"stage:{k}": v for k, v in cap.stages.items()})
    tensors.update({f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return tensors


def determinism(
    model: DeepSeekV4,
    tokens: torch.Tensor,
    runs: int = 3,
    backend: str | dict | None = None,
    deterministic_mode: bool = True,
) -> DeterminismReport:
    """Run forward + backward `runs` times on the same inputs; compare hashes of everything.

    deterministic_mode: `dsv4.ops.set_deterministic(True)` and torch's deterministic algorithms (on CPU
    with several threads, some torch backward kernels are not bit-reproducible without the latter).
    """
    if runs < 2:
        raise ValueError("determinism needs at least 2 runs")
    prev = ops.is_deterministic()
    prev_torch = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    ops.set_deterministic(deterministic_mode)
    if deterministic_mode:
        torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = ops.use_backend(backend) if backend is not None else contextlib.nullcontext()
    try:
        with ops.which_ran() as impl, ctx:
            results = [_one_run(model, tokens) for _ in range(runs)]
    finally:
        ops.set_deterministic(prev)
        torch.use_deterministic_algorithms(prev_torch, warn_only=prev_warn)
        model.zero_grad(set_to_none=True)
    first = results[0]
    drifting = []
    for name, t0 in first.items():
        hashes = {tensor_hash(r[name]) for r in results if name in r}
        if len(hashes) > 1:
            diff = max(
                float((r[name].double() - t0.double()).abs().nan_to_num(float("inf")).max()) for r in results[1:]
            )
            drifting.append({"name": name, "distinct": len(hashes), "max_abs": diff})
    return DeterminismReport(
        ok=not drifting,
        runs=runs,
        tensors=len(first),
        backend=backend if isinstance(backend, str) or backend is None else str(backend),
        drifting=drifting,
        implementations={k: sorted(v) for k, v in sorted(impl.items())},
    )


def locate_nondeterminism(
    model: DeepSeekV4, tokens: torch.Tensor, backend: str | dict | None = None, deterministic_mode: bool = True
) -> dict | None:
    """Trace every aten op of two runs; the first op whose inputs hash the same in both runs but whose
    outputs do not is the nondeterministic one (named with its phase and the stage or autograd node)."""
    prev, prev_torch = ops.is_deterministic(), torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    ops.set_deterministic(deterministic_mode)
    if deterministic_mode:
        torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = ops.use_backend(backend) if backend is not None else contextlib.nullcontext()
    traces = []
    try:
        with ctx:
            for _ in range(2):
                with _OpTrace() as tr:
                    _one_run(model, tokens, tr)
                traces.append(tr.ops)
    finally:
        ops.set_deterministic(prev)
        torch.use_deterministic_algorithms(prev_torch, warn_only=prev_warn)
        model.zero_grad(set_to_none=True)
    for i, (a, b) in enumerate(zip(*traces)):
        if a[0] != b[0]:
            return {"index": i, "op": a[0], "phase": a[1], "where": a[2], "reason": f"op sequence differs ({b[0]})"}
        if a[3] == b[3] and a[4] != b[4]:
            return {"index": i, "op": a[0], "phase": a[1], "where": a[2], "reason": "same inputs, different outputs"}
    return None
