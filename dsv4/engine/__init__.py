"""Runtime state around the model: the paged cache's bookkeeping, scheduling, sampling, CUDA graphs.

- `Engine` (engine.py): the step loop - schedule, launch, process - with continuous batching, chunked
  prefill, prefix caching, preemption and overlapped steps;
- `sequence.py` (request state), `scheduler.py` (admission, chunking, preemption), `batch.py` (a step's
  layout, ragged or bucketed), `runner.py` (device buffers, CUDA graphs per bucket, sampling, read-back),
  `output.py` (stops, outputs, text), `cache_manager.py` (pages, tables, prefix cache);
- `EngineClient` / `EngineProcess` (client.py, engine_process.py): the engine in its own process, for the
  HTTP server;
- `generate` / `complete` (offline.py): offline generation through the same engine (ids, or text with
  token healing: healing.py);
- `SamplingParams` (params.py, torch-free) / `Sampler` (sampling.py): per-request sampling with static
  shapes;
- `graphs.py`: CUDA-graph replay of fixed-shape prefill and lockstep decode (benchmarks).
"""

from __future__ import annotations

import importlib

# name -> module: loaded on first use (PEP 562), so that importing a torch-free part of the engine - the
# request state, the client side of the engine process, `SamplingParams` - does not load torch and the
# model code (the server's HTTP processes use only those). No module may be named like one of these
# names: importing it would set the package's attribute to the module (hence offline.py, not generate.py).
_LAZY = {
    "Engine": "engine",
    "EngineConfig": "config",
    "RequestError": "sequence",
    "StepOutput": "sequence",
    "complete": "offline",
    "generate": "offline",
    "Sampler": "sampling",
    "SamplingParams": "params",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
