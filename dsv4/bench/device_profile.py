"""The torch profiler's view of a function's device work: kernels by name and GPU time (`kernel_table`), and
where the device sat idle between them (`device_gaps`, `kernel_gaps`). Used by `dsv4 bench` and the
benchmark scripts' --profile."""

from __future__ import annotations

import torch


def _device_events(fn, calls: int) -> list:
    """The CUDA events (kernels, copies) of `calls` calls of fn under the torch profiler, after one untimed call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]


def device_gaps(intervals: list[tuple[float, float]], calls: int, short_us: float = 5.0) -> dict:
    """Where the device sat idle between the first event's start and the last one's end (intervals: (start,
    end) in us, overlapping ones merged), per call in ms: "span" (that window), "short" (the gaps under
    short_us: a graph's or a launch queue's spacing between kernels), "long" (the longer ones: the device
    waiting on the host) and "long_gaps" (how many)."""
    if not intervals:
        return {"span": 0.0, "short": 0.0, "long": 0.0, "long_gaps": 0.0}
    iv = sorted(intervals)
    short = long = 0.0
    n_long = 0
    end = iv[0][1]
    for a, b in iv[1:]:
        if a > end:
            gap = a - end
            if gap < short_us:
                short += gap
            else:
                long += gap
                n_long += 1
        end = max(end, b)
    span = end - iv[0][0]
    return {
        "span": round(span / calls / 1e3, 4),
        "short": round(short / calls / 1e3, 4),
        "long": round(long / calls / 1e3, 4),
        "long_gaps": round(n_long / calls, 2),
    }


def kernel_gaps(fn, calls: int = 3) -> tuple[float, float, list[tuple[str, float, float]], dict]:
    """`kernel_table`'s figures of `calls` calls of fn, and the device's idle time between them
    (`device_gaps`)."""
    kernels = _device_events(fn, calls)
    gaps = device_gaps([(e.time_range.start, e.time_range.end) for e in kernels], calls)
    return (*_kernel_rows(kernels, calls), gaps)


def kernel_table(fn, calls: int = 3) -> tuple[float, float, list[tuple[str, float, float]]]:
    """Profile `calls` calls of fn (after one untimed call): (GPU-busy ms per call, kernels per call,
    [(kernel name, ms per call, launches per call)] by GPU time)."""
    return _kernel_rows(_device_events(fn, calls), calls)


def _kernel_rows(kernels: list, calls: int) -> tuple[float, float, list[tuple[str, float, float]]]:
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((name, sum(t) / calls / 1e3, len(t) / calls) for name, t in by_name.items()), key=lambda r: -r[1])
    busy = sum(e.device_time for e in kernels) / calls / 1e3
    return busy, len(kernels) / calls, rows
