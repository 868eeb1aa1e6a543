"""Parallelism over torch.distributed, applied as passes over a built model (see README: "Serving across
devices"): expert parallelism shared by training and serving (`expert`), the serving pass and the pieces a
worker runs per step (`serving`), and joining the worker group with a collective timeout (`workers`). What a
worker holds in memory is `dsv4.memory.rank_bytes`; `python3 -m dsv4.bench.parallel` compares N workers
with one process.

The split, and why it suits V4
------------------------------
Routed experts are split by expert over the N workers (expert parallelism: worker r holds experts
[r*E/N, (r+1)*E/N) of every MoE layer); everything else - attention with its compressors and indexer, the
shared expert, embedding, head, mHC - stays whole on every worker, and so does each worker's paged cache.
Attention then runs either replicated (every worker runs every sequence; the MoE layers sum the workers'
expert outputs with one all-reduce) or data-parallel (each worker runs its own sequences; the MoE layers
gather every worker's tokens and send each its rows back), the arrangement vLLM and SGLang serve
DeepSeek's MLA models with ("DP attention + EP"). Not tensor-parallel attention heads, because of what V4's
attention is:

- one KV head of 512 dims shared by all 64 (Flash) or 128 (Pro) query heads, and compressed caches built
  from it (CSA entries and indexer keys, HCA entries, the compressors' pending rows): splitting the query
  heads leaves every worker holding and reading the whole KV cache, so the cache and its reads - what grows
  with the batch and the context, and what a decode step is bound by - do not shrink. Only data-parallel
  attention divides them; replicated attention keeps them whole too, in exchange for the simplest step;
- the Lightning Indexer's top-k needs the sum over all its 64 heads, so head-split indexers would add an
  all-reduce of [tokens, entries] scores before every CSA layer's top-k, besides the one after `wo_b`;
- the weights that a head split would divide are small next to the experts: Flash's attention, shared
  expert, embedding and head are 10.7 GB of its 161 GB kept quantized, so splitting the experts alone
  brings Flash to 2 GPUs of 141 GB (`dsv4 info` prints the per-worker figure). The price shows on Pro:
  its 32.6 GB replicated per worker make it 12 GPUs of 141 GB (8 of 180 GB), where splitting attention
  as well would fit 8; that pass is not written.

Replicated attention is the simplest to drive (one scheduler, every worker runs the scheduler's step and
computes the same logits); data-parallel attention divides the attention work and the KV cache by N as
well, and needs the scheduler to place each sequence on one worker. Either way all workers must run the
same number of `append` / `draft` calls per step, since every MoE layer is a collective.

The API
-------
`init_workers` / `shutdown_workers` (workers), `load_pretrained(..., rank=, world_size=)` (each worker
reads only its experts), `parallelize_for_serving` (the pass), `broadcast_step` and `idle_inputs` (per
step); `dsv4.memory.rank_bytes` / `serving_gpus` (memory per worker).
"""

from .expert import ExpertParallel, expert_range, held, is_expert_param, moe_layers, ordered_sum, shard_experts
from .serving import ATTENTION, ServingLayout, broadcast_step, idle_inputs, parallelize_for_serving, serving_layout
from .workers import DEFAULT_TIMEOUT_S, Workers, free_port, init_workers, shutdown_workers

__all__ = [
    "ATTENTION",
    "DEFAULT_TIMEOUT_S",
    "ExpertParallel",
    "ServingLayout",
    "Workers",
    "broadcast_step",
    "expert_range",
    "free_port",
    "held",
    "idle_inputs",
    "init_workers",
    "is_expert_param",
    "moe_layers",
    "ordered_sum",
    "parallelize_for_serving",
    "serving_layout",
    "shard_experts",
    "shutdown_workers",
]
