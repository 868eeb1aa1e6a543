"""Capturing CUDA graphs safely: every capture in dsv4 goes through `capturing`.

While a graph is captured, CUDA forbids destroying another graph. Python's cycle collector can run at any
allocation and may free an object that holds an older `torch.cuda.CUDAGraph` (an engine that went out of
scope, say): its destructor then runs inside the capture, which CUDA refuses ("operation not permitted when
stream is capturing"), and the capture fails. torch no longer collects before a capture by default, so a
process that builds a second engine (a second `generate` call, a test) hit that at random. `capturing` keeps
the collector off for the duration of the capture; what it would have freed is freed after.

An op that synchronizes with the host (a data-dependent shape: `torch.where`, `nonzero`, a `.item()`) cannot
be captured; CUDA then says only that the capture was invalidated. `capturing` names the likely cause and the
way out (the reference backends of some ops are such ops: MoE dispatch, for one), and takes the CUDA
random generators out of the capture mode that the failed capture left them in.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


class GraphCaptureError(RuntimeError):
    """A step could not be captured in a CUDA graph (the message says why and what to do)."""


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool)` with Python's garbage collector held off while it captures."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except RuntimeError as e:  # torch.AcceleratorError is one
        if "captur" not in str(e):
            raise
        reset = _release_generators()
        raise GraphCaptureError(
            "capturing a CUDA graph failed: an op in the captured step synchronizes with the host (a reference "
            "backend forced with ops.use_backend, say: reference MoE dispatch is not capturable); run with "
            "--no-cuda-graph (EngineConfig(cuda_graphs=False)) or leave those ops on their GPU backends"
            + ("" if reset else "; this process's CUDA random generators could not be reset: start a new one")
        ) from e
    finally:
        if was_enabled:
            gc.enable()


def _release_generators() -> bool:
    """After a failed capture: the default CUDA generators out of capture mode, at the seed and offset they had.

    A capture puts the generators' state in capture mode and only a completed capture takes it out; after a
    failed one every random op of the process (a sampled token, a weight init) raised "Offset increment
    outside graph capture encountered unexpectedly". Each generator is given a fresh state holding its seed
    and offset (a state object that no capture has touched). -> whether that worked (the capture's own
    error is what the caller reports either way)."""
    try:
        for i in range(torch.cuda.device_count()):
            gen = torch.cuda.default_generators[i]
            fresh = torch.Generator(device=f"cuda:{i}")
            fresh.set_state(gen.get_state())
            gen.graphsafe_set_state(fresh.graphsafe_get_state())
    except RuntimeError:
        return False
    return True
