"""Runtime state around the model: the paged cache's bookkeeping, scheduling, sampling, CUDA graphs.

- `Engine` (engine.py): continuous batching with chunked prefill, prefix caching, preemption;
- `AsyncEngine` (async_engine.py): the engine in its own thread, for the HTTP server;
- `generate` (generate.py): offline generation through the same engine;
- `SamplingParams` / `Sampler` (sampling.py): per-request sampling with static shapes;
- `graphs.py`: CUDA-graph replay of fixed-shape prefill and lockstep decode (benchmarks, `generate`).
"""

from .engine import Engine, EngineConfig, RequestError, StepOutput
from .generate import generate
from .sampling import Sampler, SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestError", "StepOutput", "generate", "Sampler", "SamplingParams"]
