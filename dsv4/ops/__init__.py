"""Math primitives of DeepSeek-V4 behind one dispatch point.

Every op has exactly one plain-torch *reference* (`dsv4.ops.reference`) that defines it. Fast backends
(`triton`, ...) register themselves for the ops they implement and must match the reference forward and
backward. The contract:

- `dsv4.ops.<op>(..., backend=None)`: `backend=None` takes the default for the inputs' device (the
  fastest registered backend that can run there, else the reference); a named backend that cannot run
  raises `BackendUnavailable` with the reason - never a silent fallback.
- Every call records the implementation that actually ran: `dsv4.ops.calls()` returns
  `{(op, backend): count}`; `dsv4.ops.last_backend(op)` the latest one.
- `use_backend("reference")` (or `{op: backend}`) sets the default inside a `with` block.
- `set_deterministic(True)` asks backends for bit-identical repeats (backends that cannot promise it
  refuse explicit requests in that mode).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import reference as _ref


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run these inputs; the message says why."""


@dataclass
class Backend:
    name: str
    fn: Callable
    # returns None when the backend can run on these inputs, else the reason it cannot
    can_run: Callable[..., str | None]
    deterministic: bool = True
    priority: int = 0  # higher wins when chosen by default
    # default selection only: None, or returns whether these inputs suit this backend best (an explicit
    # request ignores it; e.g. a GEMM backend that wins only for large token batches)
    prefer: Callable[..., bool] | None = None


_REGISTRY: dict[str, dict[str, Backend]] = {}
_CALLS: Counter = Counter()
_LAST: dict[str, str] = {}
_STATE = threading.local()
_DETERMINISTIC = [False]


def register(op: str, name: str, fn: Callable, can_run: Callable[..., str | None] | None = None,
             deterministic: bool = True, priority: int = 0, prefer: Callable[..., bool] | None = None) -> None:
    _REGISTRY.setdefault(op, {})[name] = Backend(name, fn, can_run or (lambda *a, **k: None),
                                                 deterministic, priority, prefer)


def unregister(op: str, name: str) -> None:
    """Remove a backend (the reference cannot be removed)."""
    if name == "reference":
        raise ValueError(f"op '{op}': the reference defines the op and cannot be unregistered")
    _REGISTRY.get(op, {}).pop(name, None)


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY.get(op, {}))


def ops() -> list[str]:
    return sorted(_REGISTRY)


def calls() -> dict[tuple[str, str], int]:
    return dict(_CALLS)


def reset_calls() -> None:
    _CALLS.clear()
    _LAST.clear()


def last_backend(op: str) -> str | None:
    return _LAST.get(op)


def set_deterministic(on: bool = True) -> None:
    _DETERMINISTIC[0] = bool(on)


def is_deterministic() -> bool:
    return _DETERMINISTIC[0]


@contextlib.contextmanager
def use_backend(choice: str | dict[str, str] | None) -> Iterator[None]:
    """Default backend inside the block: one name for every op, or `{op: name}`."""
    prev = getattr(_STATE, "choice", None)
    _STATE.choice = choice
    try:
        yield
    finally:
        _STATE.choice = prev


def _requested(op: str, backend: str | None) -> str | None:
    if backend is not None:
        return backend
    choice = getattr(_STATE, "choice", None)
    if isinstance(choice, dict):
        return choice.get(op)
    return choice


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def resolve(op: str, backend: str | None, *args, **kwargs) -> Backend:
    """The backend that will run `op` on these inputs (raises for an impossible explicit request)."""
    table = _REGISTRY.get(op)
    if not table:
        raise KeyError(f"unknown op '{op}'")
    name = _requested(op, backend)
    if name is not None:
        if name not in table:
            raise BackendUnavailable(
                f"op '{op}' has no backend '{name}' (registered: {sorted(table)}); "
                f"install its dependencies or choose another")
        be = table[name]
        reason = be.can_run(*args, **kwargs)
        if reason is None and is_deterministic() and not be.deterministic:
            reason = "it is not deterministic and deterministic mode is on"
        if reason is not None:
            raise BackendUnavailable(f"op '{op}': backend '{name}' cannot run here: {reason}")
        return be
    best = table["reference"]
    for be in table.values():
        if be.priority > best.priority and be.can_run(*args, **kwargs) is None and (
                be.deterministic or not is_deterministic()) and (be.prefer is None or be.prefer(*args, **kwargs)):
            best = be
    return best


def call(op: str, *args, backend: str | None = None, **kwargs):
    be = resolve(op, backend, *args, **kwargs)
    if not torch.compiler.is_compiling():
        # host bookkeeping, left out of torch.compile graphs: tracing it would guard on the counter's
        # value and recompile at every call (compiled calls are therefore not counted)
        _CALLS[(op, be.name)] += 1
        _LAST[op] = be.name
    return be.fn(*args, **kwargs)


def _make(op: str) -> Callable:
    def wrapper(*args, backend: str | None = None, **kwargs):
        return call(op, *args, backend=backend, **kwargs)

    ref = getattr(_ref, op)
    wrapper.__name__ = op
    wrapper.__qualname__ = op
    wrapper.__doc__ = ref.__doc__
    register(op, "reference", ref)
    return wrapper


sparse_attention = _make("sparse_attention")
indexer_scores = _make("indexer_scores")
indexer_topk = _make("indexer_topk")
hc_split_sinkhorn = _make("hc_split_sinkhorn")
hc_pre = _make("hc_pre")
hc_post = _make("hc_post")
hc_head = _make("hc_head")
compress_pool = _make("compress_pool")
fp8_round_trip = _make("fp8_round_trip")
fp4_round_trip = _make("fp4_round_trip")
hadamard = _make("hadamard")
linear_fp32 = _make("linear_fp32")
rms_norm = _make("rms_norm")
rope_tail = _make("rope_tail")
moe_experts = _make("moe_experts")
act_quant = _make("act_quant")
fp8_gemm = _make("fp8_gemm")
fp4_gemm = _make("fp4_gemm")
quantized_moe_experts = _make("quantized_moe_experts")


def _load_optional_backends() -> None:
    """Fast backends register themselves on import; a missing dependency only means not registered."""
    from . import torch_native as _torch_native  # noqa: F401
    try:
        from . import triton as _triton  # noqa: F401
    except ImportError:
        pass


_load_optional_backends()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str | None = None):
    """y = x @ dequant(FP8 E4M3 weight [N, K], 128x128 block scales)^T in x.dtype."""
    return call("fp8_linear", x, weight, scale, backend=backend)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str | None = None):
    """y = x @ dequant(MXFP4 weight [N, K/2] packed, per-32 E8M0 scales)^T in x.dtype."""
    return call("fp4_linear", x, weight, scale, backend=backend)

__all__ = [
    "BackendUnavailable", "register", "unregister", "backends", "ops", "calls", "reset_calls", "last_backend",
    "use_backend", "set_deterministic", "is_deterministic", "resolve", "call",
    "sparse_attention", "indexer_scores", "indexer_topk", "hc_split_sinkhorn", "hc_pre", "hc_post",
    "hc_head", "compress_pool", "fp8_round_trip", "fp4_round_trip", "hadamard", "rms_norm", "rope_tail",
    "moe_experts", "act_quant", "fp8_gemm", "fp4_gemm", "quantized_moe_experts",
    "fp8_linear", "fp4_linear",
]
