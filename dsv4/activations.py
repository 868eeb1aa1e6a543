"""Activation bytes of an inference step: the transient tensors of one step of T tokens, per layer and
for the whole model (`dsv4.memory` builds its estimates on these; the engine sizes its default step of
prompts alone with them). Arithmetic on the config only: this module imports nothing of the model."""

from __future__ import annotations

from .config import ModelConfig

FUSED_INDEXER_ENTRIES = 64 * 2**20  # the Triton indexer scores at most this many [rows, entries] at a time


def layer_step_bytes(cfg: ModelConfig, ratio: int, T: int, context: int, a: int, fused: bool = False) -> int:
    """Peak transient bytes inside one layer for a step of T tokens over a `context`-position cache: the
    attention's and the MoE's intermediates do not live at the same time (inference frees each)."""
    return max(layer_parts(cfg, ratio, T, context, a, fused))


def layer_parts(cfg: ModelConfig, ratio: int, T: int, context: int, a: int, fused: bool = False) -> tuple[int, int]:
    """(attention, MoE) intermediate bytes of one layer for a step of T tokens over a `context`-position cache.

    fused=False: the reference ops (what a CPU runs): gathered keys, fp32 scores and the indexer's
    [T, heads, entries] products exist in memory. fused=True: the Triton kernels (CUDA), which keep scores
    in registers and score the indexer in bounded chunks (fp32 scores, then a sort: values + int64 ids)."""
    D, H, d = cfg.dim, cfg.n_heads, cfg.head_dim
    keys = min(cfg.window_size, context) + (
        min(cfg.index_topk, context // 4) if ratio == 4 else context // ratio if ratio else 0
    )
    attn = T * (cfg.q_lora_rank + 3 * H * d) * a  # qr, q, o and its inverse-rope copy
    if fused:
        attn += T * H * 4 + T * keys * 8  # lse; the key index list (int64)
    else:
        attn += T * keys * d * 4 + 3 * T * H * (keys + 1) * 4  # gathered keys; scores + sink, probabilities
    if ratio == 4:
        entries = context // 4
        attn += T * cfg.index_n_heads * cfg.index_head_dim * a
        if fused:
            attn += min(T * entries, FUSED_INDEXER_ENTRIES) * (4 + 4 + 8)
        else:  # relu(q . k) [T, heads, entries] and its weighted copy
            attn += 2 * T * cfg.index_n_heads * entries * 4
    k, inter = cfg.n_activated_experts, cfg.moe_inter_dim
    moe = (
        T * cfg.n_routed_experts * 4  # router scores
        + T * D * 4  # routed output (fp32)
        + 4 * T * k * inter * a // max(1, min(k, cfg.n_routed_experts))  # one expert's tokens at a time
        + 3 * T * inter * a * cfg.n_shared_experts
    )  # shared expert
    return attn, moe


def activation_bytes(
    cfg: ModelConfig, tokens: int, context: int, dtype_bytes: int = 2, logits_rows: int = 1, fused: bool = False
) -> int:
    """Peak activation bytes of one inference step of `tokens` tokens (a prefill chunk, or a decode batch)."""
    T, a = tokens, dtype_bytes
    streams = 3 * T * cfg.hc_mult * cfg.dim * a + T * cfg.hc_mult * cfg.dim * 4  # in, out, residual; fp32 mix
    layer = max(layer_step_bytes(cfg, r, T, context, a, fused) for r in cfg.compress_ratios[: cfg.n_layers])
    return streams + layer + logits_rows * cfg.vocab_size * 4


__all__ = ["FUSED_INDEXER_ENTRIES", "activation_bytes", "layer_parts", "layer_step_bytes"]
