"""Model facts computed from a config alone (no weights are allocated): parameters, active parameters
per token, KV-cache bytes, per-token FLOPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import ModelConfig


@dataclass
class ModelInfo:
    name: str
    total_params: int              # backbone: embedding, layers, final norm/HC head, LM head
    mtp_params: int                # the MTP block(s), on top of the backbone
    active_params: int             # per token: backbone minus the routed experts a token does not use
    routed_expert_params: int
    embedding_params: int
    kv_bytes_per_token: float      # compressed entries + indexer keys, amortized per token (bf16)
    kv_fixed_bytes: int            # window ring buffers (independent of the context length)
    kv_bytes_1m: float             # at a 1,048,576-token context (bf16)
    kv_bytes_per_token_fp8: float  # FP8 storage: 448 e4m3 + 64 bf16 rope dims + E8M0 scales; FP4 indexer keys
    kv_bytes_1m_fp8: float
    flops_per_token: float         # forward matmul FLOPs per token (2 x active matmul params), no attention
    layers: int
    layer_kinds: dict

    def to_dict(self) -> dict:
        return asdict(self)


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by part, from a model built on the meta device (nothing allocated)."""
    from .model import DeepSeekV4

    model = DeepSeekV4(cfg, dtype=torch.bfloat16, device="meta")
    counts = {"backbone": 0, "mtp": 0, "routed": 0, "embedding": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("mtp."):
            counts["mtp"] += n
            continue
        counts["backbone"] += n
        if ".experts.w" in name:
            counts["routed"] += n
        if name in ("embed.weight", "head.weight"):
            counts["embedding"] += n
    return counts


def model_info(cfg: ModelConfig) -> ModelInfo:
    counts = count_parameters(cfg)
    per_expert = 3 * cfg.moe_inter_dim * cfg.dim
    inactive = cfg.n_layers * (cfg.n_routed_experts - cfg.n_activated_experts) * per_expert
    active = counts["backbone"] - inactive
    kinds = {"window_only": 0, "csa": 0, "hca": 0}
    per_token = per_token_fp8 = 0.0
    d, r = cfg.head_dim, cfg.rope_head_dim
    entry_fp8 = (d - r) + 2 * r + (d - r) // 64             # e4m3 nope + bf16 rope + one E8M0 byte per 64
    index_fp4 = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    for ratio in cfg.compress_ratios[: cfg.n_layers]:
        if ratio == 0:
            kinds["window_only"] += 1
            continue
        kinds["csa" if ratio == 4 else "hca"] += 1
        per_token += 2 * d / ratio
        per_token_fp8 += entry_fp8 / ratio
        if ratio == 4:
            per_token += 2 * cfg.index_head_dim / ratio
            per_token_fp8 += index_fp4 / ratio
    fixed = cfg.n_layers * cfg.window_size * d * 2
    fixed_fp8 = cfg.n_layers * cfg.window_size * entry_fp8
    one_m = 1 << 20
    return ModelInfo(
        name=cfg.name, total_params=counts["backbone"], mtp_params=counts["mtp"], active_params=active,
        routed_expert_params=counts["routed"], embedding_params=counts["embedding"],
        kv_bytes_per_token=per_token, kv_fixed_bytes=fixed, kv_bytes_1m=fixed + per_token * one_m,
        kv_bytes_per_token_fp8=per_token_fp8, kv_bytes_1m_fp8=fixed_fp8 + per_token_fp8 * one_m,
        flops_per_token=2.0 * (active - counts["embedding"] // 2), layers=cfg.n_layers, layer_kinds=kinds)


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"
