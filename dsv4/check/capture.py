"""Stage capture: the named intermediate tensors of one run, in the order the model produced them.

The model offers every stage to `dsv4.model.layers.record(name, tensor)` (embedding, per layer the mHC
inputs/outputs, q, kv, compressed kv, indexer top-k, attention core and output, router indices and
weights, routed/shared expert outputs, MoE output, head logits). `capturing()` keeps detached copies of
them without changing any number the model computes; `inject=` optionally replaces a stage on its way
through (how `dsv4 check` plants a corrupted stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..model.layers import recording

Stages = dict[str, torch.Tensor]
Injector = Callable[[str, torch.Tensor], "torch.Tensor | None"]


class StageCapture:
    """Recorder: stores a detached copy of each stage; a repeated name gets a `#k` suffix (decode steps)."""

    def __init__(self, keep: Callable[[str], bool] | None = None, inject: Injector | None = None):
        self.stages: Stages = {}
        self.keep = keep
        self.inject = inject

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        out = None
        if self.inject is not None:
            out = self.inject(name, tensor)
            if out is not None:
                tensor = out
        if self.keep is None or self.keep(name):
            key, k = name, 1
            while key in self.stages:
                key = f"{name}#{k}"
                k += 1
            self.stages[key] = tensor.detach().clone()
        return out


@contextlib.contextmanager
def capturing(keep: Callable[[str], bool] | None = None, inject: Injector | None = None) -> Iterator[StageCapture]:
    """`with capturing() as cap: model(tokens)` -> `cap.stages` {name: tensor} in production order."""
    cap = StageCapture(keep, inject)
    with recording(cap):
        yield cap


def capture(
    fn: Callable[[], object], keep: Callable[[str], bool] | None = None, inject: Injector | None = None
) -> tuple[object, Stages]:
    """Run fn() with stage capture -> (its result, stages)."""
    with capturing(keep, inject) as cap:
        result = fn()
    return result, cap.stages


def layer_of(stage: str) -> str:
    """The module a stage belongs to: `layers.2.attn.q` -> `layers.2`, `mtp.0.ffn.out` -> `mtp.0`."""
    parts = stage.split("#")[0].split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]
