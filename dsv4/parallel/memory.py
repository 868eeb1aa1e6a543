"""What one worker holds when a model is served on N of them (`dsv4 info`, `dsv4.parallel.serving`).

Per worker, from the config alone (`dsv4.memory` counts each part the same way for one device):
- weights: everything but the routed experts whole (replicated), plus 1/N of the routed experts -
  dequantized to the compute dtype, or kept as stored (FP8 / MXFP4 bytes and their block scales);
- KV cache: what the worker's engine allocates - the whole batch with replicated attention (every worker
  runs every sequence), ceil(batch / N) sequences with data-parallel attention;
- activations of one step (a prefill chunk): the single-device peak, plus with data-parallel attention the
  expert exchange (every worker's tokens gathered, the partial outputs and the rows sent back: fp32), and
  in the ordered (bit-exact) combine each token's k slots as rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..config import ModelConfig

USABLE_FRACTION = 0.92          # as dsv4.memory: the CUDA context, allocator slack and NCCL buffers take the rest


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(dequantized, kept quantized) bytes of all routed experts (every layer, MTP included): in the compute
    dtype, and as the release layout stores them (data + block scales; float experts in bf16)."""
    from ..checkpoint.layouts import expected_tensors

    a = torch.finfo(dtype).bits // 8
    per_layer = 3 * cfg.n_routed_experts * cfg.moe_inter_dim * cfg.dim
    deq = (cfg.n_layers + cfg.n_mtp_layers) * per_layer * a
    inventory = expected_tensors(cfg, "release", mtp=cfg.n_mtp_layers > 0)
    kept = 0
    for name, (shape, dt) in inventory.items():
        if ".ffn.experts." not in name:
            continue
        quantized = dt in ("F8_E4M3", "I8") or name.endswith(".scale")
        kept += math.prod(shape) * (_ST_BYTES[dt] if quantized else a)       # float experts: loaded in dtype
    return deq, kept


_ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


@dataclass
class RankMemory:
    world_size: int
    attention: str
    weights: int                # this worker's weights (kept quantized or dequantized, as asked)
    experts: int                # of which its routed experts
    cache: int
    activations: int
    exchange: int               # of which the expert exchange's buffers

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def rank_bytes(cfg: ModelConfig, world: int, *, context: int, batch: int, chunk: int,
               dtype: torch.dtype = torch.bfloat16, keep_quantized: bool = True, attention: str = "replicated",
               fused: bool = True, ordered: bool = False, prefix_caching: bool = True) -> RankMemory:
    """One worker's memory serving `batch` sequences of `context` positions in prefill chunks of `chunk`
    tokens on `world` workers (experts split by expert: `world` must divide the expert count)."""
    from ..memory import activation_bytes, cache_bytes, weight_bytes

    if cfg.n_routed_experts % world:
        raise ValueError(f"{cfg.n_routed_experts} routed experts cannot be split evenly over {world} ranks")
    a = torch.finfo(dtype).bits // 8
    w = weight_bytes(cfg, dtype)
    deq, kept = expert_bytes(cfg, dtype)
    total, experts = (w.kept_quantized, kept) if keep_quantized else (w.dequantized, deq)
    share = experts // world
    seqs = batch if attention == "replicated" else -(-batch // world)
    cache = cache_bytes(cfg, context, seqs, a, max_batch_tokens=chunk, prefix_caching=prefix_caching).total
    T, k, D = chunk, cfg.n_activated_experts, cfg.dim
    if attention == "replicated":
        exchange = T * k * D * (a + 4 + 4) if ordered else 0         # slot rows, per-slot outputs, sorted copy
    else:
        # every worker's tokens gathered (x, fp32 weights, int64 ids; padded to the largest count), the
        # fp32 partial outputs of them all and the rows sent back (per slot in the ordered combine)
        out = 4 * D * (k if ordered else 1)
        exchange = world * T * (D * a + k * 12) + 2 * world * T * out
        if ordered:
            exchange += world * T * k * D * (a + 4)                    # slot rows and the sorted copy
    act = activation_bytes(cfg, chunk, context, a, logits_rows=seqs, fused=fused) + exchange
    return RankMemory(world, attention, total - experts + share, share, cache, act, exchange)


def serving_gpus(cfg: ModelConfig, gpu_bytes: int, *, context: int, batch: int, chunk: int,
                 dtype: torch.dtype = torch.bfloat16, keep_quantized: bool = True, attention: str = "replicated",
                 max_world: int = 64) -> tuple[int, RankMemory] | None:
    """The fewest workers (dividing the expert count) whose per-worker memory fits one GPU of `gpu_bytes`
    (USABLE_FRACTION of it), and that memory; None when no count up to max_world fits."""
    for world in range(1, max_world + 1):
        if cfg.n_routed_experts % world:
            continue
        r = rank_bytes(cfg, world, context=context, batch=batch, chunk=chunk, dtype=dtype,
                       keep_quantized=keep_quantized, attention=attention)
        if r.total <= gpu_bytes * USABLE_FRACTION:
            return world, r
    return None


__all__ = ["RankMemory", "USABLE_FRACTION", "expert_bytes", "rank_bytes", "serving_gpus"]
