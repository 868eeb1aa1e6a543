"""Runtime state around the model: the paged cache's bookkeeping, scheduling, sampling, CUDA graphs.

- `Engine` (engine.py): the step loop - schedule, launch, process - with continuous batching, chunked
  prefill, prefix caching, preemption and overlapped steps;
- `sequence.py` (request state), `scheduler.py` (admission, chunking, preemption), `batch.py` (a step's
  layout, ragged or bucketed), `runner.py` (device buffers, CUDA graphs per bucket, sampling, read-back),
  `output.py` (stops, outputs, text), `cache_manager.py` (pages, tables, prefix cache);
- `EngineClient` / `EngineProcess` (client.py, engine_process.py): the engine in its own process, for the
  HTTP server;
- `generate` / `complete` (generate.py): offline generation through the same engine (ids, or text with
  token healing: healing.py);
- `SamplingParams` / `Sampler` (sampling.py): per-request sampling with static shapes;
- `graphs.py`: CUDA-graph replay of fixed-shape prefill and lockstep decode (benchmarks).
"""

from .engine import Engine, EngineConfig
from .generate import complete, generate
from .sampling import Sampler, SamplingParams
from .sequence import RequestError, StepOutput

__all__ = ["Engine", "EngineConfig", "RequestError", "StepOutput", "complete", "generate", "Sampler", "SamplingParams"]
