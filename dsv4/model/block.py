"""Transformer block with manifold-constrained hyper-connections (mHC), and the MTP block.

The residual stream holds hc_mult copies [b, s, hc, dim]. Around each sublayer, `hc_pre` mixes the
copies into the sublayer input (weights from a Sinkhorn-projected mix) and `hc_post` writes the output
back into every copy: copy_j = post_j * f(x) + sum_i comb[i, j] * copy_i.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from .. import ops
from ..config import ModelConfig
from .attention import Attention
from .layers import Linear, RMSNorm, record
from .moe import MoE
from .paged import LayerPool, Plan


class Block(nn.Module):
    """One layer: mHC around attention, then mHC around the MoE.

    `activation_checkpointing` (off by default; `DeepSeekV4.set_options` sets it): while gradients are
    enabled, the block keeps only its inputs for backward and recomputes its forward there
    (`torch.utils.checkpoint`, non-reentrant). The loss and gradients are the same; the memory of the
    block's intermediates is traded for a second forward.
    """

    activation_checkpointing: bool = False
    attention_cls: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.attn = self.attention_cls(cfg, layer_id)
        self.ffn = MoE(cfg, layer_id)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix, hc_dim = cfg.mix_hc, cfg.hc_mult * cfg.dim
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, hc_dim, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, hc_dim, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.stage = f"layers.{layer_id}"

    def _hc_pre(self, x: torch.Tensor, fn, scale, base):
        c = self.cfg
        return ops.hc_pre(x, fn, scale, base, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        token_ids: torch.Tensor,
        plan: Plan | None = None,
        pool: LayerPool | None = None,
        *,
        with_losses: bool = False,
        indexer_loss: bool = False,
        balance_alpha: float = 0.0,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [b, s, hc, dim]. Without a plan: the whole sequence at `positions`; with one: an incremental
        step on the paged pool (positions come from the plan).

        with_losses (training): -> (x, losses), losses holding this block's auxiliary losses that are on
        ("indexer": the Lightning Indexer's KL when indexer_loss, "balance": the sequence-wise balance loss
        when balance_alpha > 0; 0-dim tensors, in training mode only). They leave the block through its
        output, and what to compute comes in as arguments: the modules keep no per-call state, so a
        recomputation in backward under activation checkpointing writes nothing onto them, and nothing
        outside the backward keeps a recomputed block's activations alive."""
        if (indexer_loss or balance_alpha > 0) and not with_losses:
            raise ValueError("indexer_loss / balance_alpha need with_losses=True (the losses leave through the output)")
        if self.activation_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                self._forward,
                x,
                positions,
                token_ids,
                plan,
                pool,
                with_losses,
                indexer_loss,
                balance_alpha,
                use_reentrant=False,
            )
        return self._forward(x, positions, token_ids, plan, pool, with_losses, indexer_loss, balance_alpha)

    def _forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        token_ids: torch.Tensor,
        plan: Plan | None,
        pool: LayerPool | None,
        with_losses: bool = False,
        indexer_loss: bool = False,
        balance_alpha: float = 0.0,
    ):
        losses: dict[str, torch.Tensor] | None = {} if with_losses else None  # made here: a
        if plan is None:  # recomputation's own
            out = self._mix(
                x, lambda h: self.attn(h, positions, losses, indexer_loss), token_ids, losses, balance_alpha
            )
        else:
            out = self._mix(x, lambda h: self.attn.append(h, plan, pool), token_ids, losses, balance_alpha)
        return (out, losses) if with_losses else out

    def _mix(
        self,
        x: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        token_ids: torch.Tensor,
        losses: dict[str, torch.Tensor] | None = None,
        balance_alpha: float = 0.0,
    ) -> torch.Tensor:
        """mHC around `attend` (normalized sublayer input [b, s, dim] -> output), then around the MoE
        (which puts its balance loss into `losses` when balance_alpha > 0)."""
        residual = x
        h, post, comb = self._hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        h = record(f"{self.stage}.hc_attn_pre", h)
        h = attend(self.attn_norm(h))
        x = record(f"{self.stage}.hc_attn_post", ops.hc_post(h, residual, post, comb))

        residual = x
        h, post, comb = self._hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        h = record(f"{self.stage}.hc_ffn_pre", h)
        h = self.ffn(self.ffn_norm(h), token_ids, losses, balance_alpha)
        return record(f"{self.stage}.hc_ffn_post", ops.hc_post(h, residual, post, comb))


def hc_head(x: torch.Tensor, fn, scale, base, cfg: ModelConfig) -> torch.Tensor:
    return ops.hc_head(x, fn, scale, base, cfg.norm_eps, cfg.hc_eps)


class MTPBlock(Block):
    """Multi-token prediction: combines the main model's hidden state at t with the embedding of token
    t+1 and runs a window-only block; its own HC head and norm, the main model's embedding and head."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.e_proj = Linear(cfg.dim, cfg.dim)
        self.h_proj = Linear(cfg.dim, cfg.dim)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.stage = f"mtp.{layer_id - cfg.n_layers}"

    def combine(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [b, s, hc, dim] hidden of the previous depth, e [b, s, dim] next-token embedding."""
        return self.e_proj(self.enorm(e)).unsqueeze(2) + self.h_proj(self.hnorm(h))
