"""Math primitives of DeepSeek-V4 behind one dispatch point.

Every op has exactly one plain-torch *reference* (`dsv4.ops.reference`) that defines it. Fast backends
(`triton`, ...) register themselves for the ops they implement and must match the reference forward and
backward. The contract:

- `dsv4.ops.<op>(..., backend=None)`: `backend=None` takes the default for the inputs' device (the
  fastest registered backend that can run there, else the reference); a named backend that cannot run
  raises `BackendUnavailable` with the reason - never a silent fallback.
- Every call records the implementation that actually ran: `dsv4.ops.calls()` returns
  `{(op, backend): count}`; `dsv4.ops.last_backend(op)` the latest one; `with which_ran() as ran:`
  collects `{op: [backends]}` of the calls inside the block.
- `use_backend("reference")` (or `{op: backend}`) sets the default inside a `with` block;
  `requested(op)` is the backend such a block asks for. `prefer_backend(name)` makes `name` the default
  wherever it can run (the op's next choice where it refuses).
- `backends(op)` lists the registered backends; `refusal(op, name, *args)` says why one cannot run on
  these inputs (None when it can) - the same reason an explicit request would raise.
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

from ..scoped import scoped
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
_WATCHING: list[dict[str, dict[str, str]]] = []  # the open `which_refused` blocks' results (none: no bookkeeping)
_STATE = threading.local()
_DETERMINISTIC = [False]


def register(
    op: str,
    name: str,
    fn: Callable,
    can_run: Callable[..., str | None] | None = None,
    deterministic: bool = True,
    priority: int = 0,
    prefer: Callable[..., bool] | None = None,
) -> None:
    _REGISTRY.setdefault(op, {})[name] = Backend(
        name, fn, can_run or (lambda *a, **k: None), deterministic, priority, prefer
    )


def unregister(op: str, name: str) -> None:
    """Remove a backend (the reference cannot be removed)."""
    if name == "reference":
        raise ValueError(f"op '{op}': the reference defines the op and cannot be unregistered")
    _REGISTRY.get(op, {}).pop(name, None)


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY.get(op, {}))


def backend_names() -> list[str]:
    """Every backend name some op has."""
    return sorted({name for table in _REGISTRY.values() for name in table})


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
def use_backend(choice: str | dict[str, str | None] | None, inherit: bool = False) -> Iterator[None]:
    """Default backend inside the block: one name for every op, or `{op: name}` (None: the op's default).

    inherit: ops that `choice` does not name keep what an enclosing block asked for (without it the
    block replaces the enclosing choice)."""
    if inherit and isinstance(choice, dict):
        choice = {**{op: requested(op) for op in _REGISTRY}, **choice}
    with scoped(_STATE, "choice", choice):
        yield


def requested(op: str) -> str | None:
    """The backend the enclosing `use_backend` blocks ask for `op` (None: the op's default)."""
    choice = getattr(_STATE, "choice", None)
    if isinstance(choice, dict):
        return choice.get(op)
    return choice


@contextlib.contextmanager
def prefer_backend(name: str | None) -> Iterator[None]:
    """Inside the block, backend `name` is the default of every op that has it, above every other backend
    (its priority and its `prefer` hint aside) wherever it can run the call; where it refuses a call, the
    op's usual default runs. An explicit request (`backend=`, `use_backend`) still wins. None: no change."""
    with scoped(_STATE, "preferred", name):
        yield


def refusal(op: str, name: str, *args, **kwargs) -> str | None:
    """Why backend `name` cannot run `op` on these inputs (None: it can), as an explicit request sees it:
    not registered, its own `can_run` reason, or deterministic mode when it cannot promise repeats."""
    table = _REGISTRY.get(op)
    if not table:
        raise KeyError(f"unknown op '{op}'")
    be = table.get(name)
    if be is None:
        return f"op '{op}' has no backend '{name}' (registered: {sorted(table)})"
    reason = be.can_run(*args, **kwargs)
    if reason is None and is_deterministic() and not be.deterministic:
        reason = "it is not deterministic and deterministic mode is on"
    return reason


@contextlib.contextmanager
def which_ran() -> Iterator[dict[str, list[str]]]:
    """`with which_ran() as ran:` -> after the block, `ran` is `{op: sorted backends}` of the calls made
    inside it (from `calls()`; compiled calls are not counted)."""
    before = calls()
    ran: dict[str, list[str]] = {}
    try:
        yield ran
    finally:
        found: dict[str, set[str]] = {}
        for (op, be), n in calls().items():
            if n > before.get((op, be), 0):
                found.setdefault(op, set()).add(be)
        ran.update({op: sorted(bes) for op, bes in sorted(found.items())})


@contextlib.contextmanager
def which_refused() -> Iterator[dict[str, dict[str, str]]]:
    """`with which_refused() as refused:` -> after the block, `{op: {backend: reason}}` of the backends that
    the default choice passed over inside it because they refused the inputs (their `can_run` reason, the
    last one) although they outranked the backend that ran: where a faster path did not run, and why. (A
    backend not preferred for the inputs, or not deterministic in deterministic mode, is a choice, not a
    refusal: not listed.)"""
    refused: dict[str, dict[str, str]] = {}
    _WATCHING.append(refused)
    try:
        yield refused
    finally:  # (by identity: an enclosing block's dict may be equal to this one, e.g. both empty)
        del _WATCHING[next(i for i, d in enumerate(_WATCHING) if d is refused)]


def resolve(op: str, backend: str | None, *args, **kwargs) -> Backend:
    """The backend that will run `op` on these inputs (raises for an impossible explicit request)."""
    table = _REGISTRY.get(op)
    if not table:
        raise KeyError(f"unknown op '{op}'")
    name = backend if backend is not None else requested(op)
    if name is not None:
        reason = refusal(op, name, *args, **kwargs)
        if name not in table:
            raise BackendUnavailable(f"{reason}; install its dependencies or choose another")
        if reason is not None:
            raise BackendUnavailable(f"op '{op}': backend '{name}' cannot run here: {reason}")
        return table[name]
    preferred = getattr(_STATE, "preferred", None)
    if preferred in table and refusal(op, preferred, *args, **kwargs) is None:
        return table[preferred]
    best = table["reference"]
    refused: list[tuple[Backend, str]] | None = [] if _WATCHING else None  # (only inside `which_refused`)
    for be in table.values():
        if be.priority > best.priority and (be.deterministic or not is_deterministic()):
            reason = be.can_run(*args, **kwargs)
            if reason is None:
                if be.prefer is None or be.prefer(*args, **kwargs):
                    best = be
            elif refused is not None:
                refused.append((be, reason))
    if refused and not torch.compiler.is_compiling():
        for be, reason in refused:
            if be.priority > best.priority:
                for seen in _WATCHING:
                    seen.setdefault(op, {})[be.name] = reason
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
pool_groups = _make("pool_groups")
write_rows = _make("write_rows")
fp8_round_trip = _make("fp8_round_trip")
fp4_round_trip = _make("fp4_round_trip")
hadamard = _make("hadamard")
linear = _make("linear")
linear_fp32 = _make("linear_fp32")
linear_bf16_fp32 = _make("linear_bf16_fp32")
cross_entropy = _make("cross_entropy")
rms_norm = _make("rms_norm")
rope_tail = _make("rope_tail")
moe_experts = _make("moe_experts")
route = _make("route")
clamped_swiglu = _make("clamped_swiglu")
plan_window = _make("plan_window")
plan_groups = _make("plan_groups")
plan_keep = _make("plan_keep")
plan_entries = _make("plan_entries")
select_rows = _make("select_rows")
attend_rows = _make("attend_rows")
act_quant = _make("act_quant")
fp8_gemm = _make("fp8_gemm")
fp4_gemm = _make("fp4_gemm")
quantized_moe_experts = _make("quantized_moe_experts")
fp8_linear = _make("fp8_linear")
fp4_linear = _make("fp4_linear")
int8_quant = _make("int8_quant")
int8_gemm = _make("int8_gemm")
int8_linear = _make("int8_linear")
int8_moe_experts = _make("int8_moe_experts")
gumbel_argmax = _make("gumbel_argmax")
uniform = _make("uniform")
rejection_sample = _make("rejection_sample")
speculative_accept = _make("speculative_accept")
write_carry = _make("write_carry")
spec_advance = _make("spec_advance")
read_carry = _make("read_carry")
token_logprobs = _make("token_logprobs")
muon_momentum = _make("muon_momentum")
muon_apply = _make("muon_apply")


def keep_splits(module: torch.nn.Module) -> int:
    """Mark the fp32 matrices of `module` as fixed while it serves: `linear_fp32`'s bf16x3 backend then splits
    each into its three bf16 parts once, not at every call (`dsv4.ops.torch_native.keep_splits`; what a
    serving engine and the graphed decoders do). -> the number of matrices newly marked."""
    from .torch_native import keep_splits as keep

    return keep(module)


def _load_optional_backends() -> None:
    """Fast backends register themselves on import; a missing dependency only means not registered.

    Only triton itself may be missing: a kernel module of ours that fails to import is a broken install
    and raises, so it cannot pass as "no triton backend" (its tests would otherwise skip)."""
    from . import int8_native as _int8_native  # noqa: F401
    from . import torch_native as _torch_native  # noqa: F401

    try:
        import triton as _triton_dep  # noqa: F401
    except ImportError:
        return
    from . import triton as _triton  # noqa: F401


_load_optional_backends()


__all__ = [
    "BackendUnavailable",
    "register",
    "unregister",
    "backends",
    "ops",
    "calls",
    "reset_calls",
    "last_backend",
    "use_backend",
    "requested",
    "prefer_backend",
    "refusal",
    "which_ran",
    "which_refused",
    "set_deterministic",
    "is_deterministic",
    "resolve",
    "call",
    "keep_splits",
    "sparse_attention",
    "indexer_scores",
    "indexer_topk",
    "hc_split_sinkhorn",
    "hc_pre",
    "hc_post",
    "hc_head",
    "compress_pool",
    "pool_groups",
    "write_rows",
    "fp8_round_trip",
    "fp4_round_trip",
    "hadamard",
    "linear",
    "cross_entropy",
    "rms_norm",
    "rope_tail",
    "moe_experts",
    "route",
    "clamped_swiglu",
    "plan_window",
    "plan_groups",
    "plan_keep",
    "plan_entries",
    "select_rows",
    "attend_rows",
    "act_quant",
    "fp8_gemm",
    "fp4_gemm",
    "quantized_moe_experts",
    "fp8_linear",
    "fp4_linear",
    "int8_quant",
    "int8_gemm",
    "int8_linear",
    "int8_moe_experts",
    "gumbel_argmax",
    "uniform",
    "rejection_sample",
    "speculative_accept",
    "write_carry",
    "spec_advance",
    "read_carry",
    "token_logprobs",
    "muon_momentum",
    "muon_apply",
]
