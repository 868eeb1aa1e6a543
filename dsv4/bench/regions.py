"""Device time by region of a step: which kernels ran inside the model's transformer blocks, inside its MTP
block, and around them (a diagnostic for CUDA, one profiled window, no spread; on the CPU the regions are
annotated, and there is no device kernel to count).

`region_table(step, steps, model)` profiles `steps` calls of `step` with forward hooks on the model's blocks
(`synced_regions`: the main model's blocks as one region, "layers", and each pass of an MTP block, "mtp")
that synchronize the device as a region begins and ends: every kernel then runs inside the window of the
region that launched it, and is counted there by its start time (`attribute`); kernels outside every window
are the step's "rest" (embedding, heads, acceptance, draws, input building). Each region also names its
largest kernels by device time, which says what its time is made of. The synchronizations serialize
the host with the device, so the step is run eagerly for this and its total is no timing of the graphed
step: the per-region kernel counts and device times are what it is for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

_PREFIX = "dsv4.region."
TOP = 8  # kernels named per region
TOP_NAME = 80  # characters of a kernel's name kept (C++ template names run to hundreds)


def attribute(
    spans: Sequence[tuple[str, float, float]],
    kernels: Sequence[tuple[float, float] | tuple[float, float, str]],
    steps: int,
    top: int = TOP,
) -> dict[str, dict]:
    """spans: (region, start, end) windows; kernels: (start, duration[, name]) of each kernel, on the spans'
    clock. -> {region: {"kernels": per step, "ms": device ms per step, "top": [[name, ms per step, calls per
    step], ...]}} with "rest" for the kernels of no window and "total" for all (durations in microseconds in,
    milliseconds out); "top" holds a region's `top` named kernels with the most device time (ties by name)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ordered = sorted(spans, key=lambda s: s[1])
    names = [*dict.fromkeys(s[0] for s in ordered), "rest", "total"]
    table = {name: {"kernels": 0.0, "ms": 0.0} for name in names}
    by_name: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for start, duration, *label in kernels:
        region = next((name for name, t0, t1 in ordered if t0 <= start <= t1), "rest")
        for key in (region, "total"):
            table[key]["kernels"] += 1
            table[key]["ms"] += duration / 1e3
            if label:
                acc = by_name[key].setdefault(label[0], [0.0, 0])
                acc[0] += duration / 1e3
                acc[1] += 1
    return {
        n: {
            "kernels": round(v["kernels"] / steps, 1),
            "ms": round(v["ms"] / steps, 4),
            "top": [
                [k[:TOP_NAME], round(ms / steps, 4), round(calls / steps, 1)]
                for k, (ms, calls) in sorted(by_name[n].items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
            ],
        }
        for n, v in table.items()
    }


@contextlib.contextmanager
def synced_regions(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, forward hooks (removed on exit) open a region as the model's first transformer block
    starts and close it as its last one ends ("layers"), and likewise around each MTP block ("mtp"): the
    device is synchronized at both ends and the region is a profiler annotation `dsv4.region.<name>`."""
    cuda = next(model.parameters()).is_cuda
    open_: list[torch.profiler.record_function] = []

    def begin(name: str) -> Callable:
        def hook(module, args) -> None:
            if cuda:
                torch.cuda.synchronize()
            open_.append(torch.profiler.record_function(_PREFIX + name))
            open_[-1].__enter__()

        return hook

    def end(module, args, output) -> None:
        if cuda:
            torch.cuda.synchronize()
        open_.pop().__exit__(None, None, None)

    layers = list(model.layers)
    handles = [layers[0].register_forward_pre_hook(begin("layers")), layers[-1].register_forward_hook(end)]
    for block in getattr(model, "mtp", []):
        handles += [block.register_forward_pre_hook(begin("mtp")), block.register_forward_hook(end)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_:  # a step that raised inside a region
            open_.pop().__exit__(None, None, None)


def region_table(step: Callable[[], object], steps: int, model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Profile `steps` calls of step with the model's regions synchronized: `attribute`'s table of the device's
    kernels (a model on the CPU has none: its table holds the regions' rows at zero)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(model.parameters()).is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with synced_regions(model):
        step()  # untimed: first-call work out of the window
        sync()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync()
    spans, kernels = split_events(prof.events())
    return attribute(spans, kernels, steps)


def split_events(events) -> tuple[list[tuple[str, float, float]], list[tuple[float, float, str]]]:
    """The profiler's events -> (the regions' host windows (name, start, end), the device events (start,
    duration, name)); the device-side copies of the regions' annotations are neither."""

    def on_device(e) -> bool:
        return str(getattr(e, "device_type", "")).endswith("CUDA")

    spans = [
        (e.name[len(_PREFIX) :], e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith(_PREFIX) and not on_device(e)
    ]
    kernels = [
        (e.time_range.start, e.time_range.end - e.time_range.start, e.name)
        for e in events
        if on_device(e) and not e.name.startswith(_PREFIX)
    ]
    return spans, kernels
