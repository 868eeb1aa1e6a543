"""What a resume reads from a training checkpoint, checked before any of it is used.

A checkpoint's SHA-256 manifest proves its files are the ones written together, not that what they hold
makes sense: a crafted (or buggy) `state.json` with a valid manifest, or weights that went NaN before the
save, would otherwise reach the trainer. Here `state.json` is checked against one schema (every key, its
type and range: a negative step, a loader position past its data, a `loader` that is not an object are
each refused by name), and every floating-point tensor of the model and the optimizer state must be
finite (the first bad one is named, with its counts).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

_MAX_STEP = 2**53  # steps, epochs, window counts: far past any run, exact in a JSON double


def _int(lo: int = 0, hi: int = _MAX_STEP) -> Callable[[object], str | None]:
    def check(v: object) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an integer, got {type(v).__name__} {_short(v)}"
        if not lo <= v <= hi:
            return f"must be in [{lo}, {hi}], got {v}"
        return None

    return check


def _object(v: object) -> str | None:
    return None if isinstance(v, dict) else f"must be an object, got {type(v).__name__} {_short(v)}"


def _history(v: object) -> str | None:
    if not isinstance(v, list):
        return f"must be a list of metric rows, got {type(v).__name__}"
    if len(v) > 1_000_000:
        return f"holds {len(v)} rows (more than a run writes)"
    bad = next((i for i, row in enumerate(v) if not isinstance(row, dict)), None)
    return None if bad is None else f"row {bad} is {type(v[bad]).__name__}, not an object"


# key -> rule (None when the value is fine, else why not)
STATE_SCHEMA: dict[str, Callable[[object], str | None]] = {
    "step": _int(),
    "loader": _object,
    "train_config": _object,
    "model_config": _object,
    "history": _history,
}
LOADER_SCHEMA: dict[str, Callable[[object], str | None]] = {
    "epoch": _int(),
    "index": _int(),
    "seed": _int(0, 2**64),
    "n_windows": _int(1),
    "seq_len": _int(1),
    "batch_size": _int(1),
}


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def state_problem(state: object, ckpt: Path) -> str | None:
    """None when state.json's content fits STATE_SCHEMA, else what breaks it first (the key and the rule)."""
    if not isinstance(state, dict):
        return f"must hold an object, got {type(state).__name__}"
    for key, rule in STATE_SCHEMA.items():
        if key not in state:
            return f"'{key}' is missing"
        why = rule(state[key])
        if why:
            return f"'{key}' {why}"
    loader = state["loader"]
    for key, rule in LOADER_SCHEMA.items():
        if key not in loader:
            return f"'loader.{key}' is missing"
        why = rule(loader[key])
        if why:
            return f"'loader.{key}' {why}"
    if loader["index"] > loader["n_windows"]:
        return f"'loader.index' {loader['index']} is past the data's {loader['n_windows']} windows"
    name = ckpt.name
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != state["step"]:
        return f"'step' is {state['step']} but the checkpoint is {name}"
    return None


def nonfinite_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """None when every floating-point tensor is finite, else the first bad one (in name order) with counts."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return f"tensor '{name}' holds {nan} NaN and {inf} Inf values"
    return None
