"""Generation that notices non-finite logits instead of sampling from them.

The sampler takes the argmax of NaN logits as token 0, so a model whose weights overflow (a finite but
huge BF16 weight passes every load check) would "generate" token 0 forever and exit 0. `watch_logits`
hands the model a check (`DeepSeekV4.watching_logits`) for the duration of a generation, which sees every
logits tensor its incremental entry points (`append`, `draft`) return: on the CPU at once (NonFiniteLogits
is raised out of the step), on a GPU into a device flag read once at the end (no host synchronization per
step). The check adds to a counter the model owns (`DeepSeekV4.nonfinite_count`) in place, so a CUDA graph
captured inside the block checks every replay too (the engine's steps are graph replays: a check skipped
during capture would never run), and a graph replayed after the block writes to memory that still exists.
A watch compares the counter with its value at the start (nested watches see their own). `first_nonfinite_module`
then replays the sequence through the full-sequence forward with `dsv4 check nonfinite`'s hooks to name
the first module that produced NaN/Inf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..model import DeepSeekV4


class NonFiniteLogits(RuntimeError):
    """The model returned NaN/Inf logits during generation."""


class LogitsWatch:
    def __init__(self, model: DeepSeekV4):
        self.model = model
        device = model.embed.weight.device
        # on a GPU: the model's counter of steps with non-finite logits, and its value now (no sync)
        self.count = model.nonfinite_count(device) if device.type == "cuda" else None
        self.start = self.count.clone() if self.count is not None else None

    def seen(self) -> bool:
        """Whether any logits since the watch began were non-finite (reads the counter: one synchronization)."""
        return self.count is not None and bool(self.count > self.start)

    def _check(self, logits: torch.Tensor) -> None:
        if self.count is not None and logits.device == self.count.device:
            self.count.add_((~torch.isfinite(logits).all()).long())  # in place: no sync, graph-capturable
        elif not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits("the model returned non-finite logits")


@contextlib.contextmanager
def watch_logits(model: DeepSeekV4) -> Iterator[LogitsWatch]:
    """While the block runs, every `model.append` / `model.draft` result is checked (see the module doc)."""
    watch = LogitsWatch(model)
    with model.watching_logits(watch._check):
        yield watch


def first_nonfinite_module(model: DeepSeekV4, tokens: list[int]) -> str:
    """The `dsv4 check nonfinite` summary for this sequence (full-sequence forward, module and op hooks)."""
    from .nonfinite import find_nonfinite

    ids = torch.tensor([tokens], dtype=torch.long, device=model.embed.weight.device)
    report = find_nonfinite(model, ids, backward=False, aten=False)
    return report.summary() if not report.ok else "the full-sequence forward of these tokens stays finite"
