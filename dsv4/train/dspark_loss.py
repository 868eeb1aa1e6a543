"""Training a DSpark draft (`dsv4.model.dspark`) on the main model's own predictions.

Per sequence, `anchors` positions p are drawn without replacement among those with a next token
(0 <= p <= S - 2), as DeepSpec samples its anchors (`deepspec/modeling/dspark/common.py`,
`sample_anchor_positions`). Each anchor's block runs the draft with the main model's taps as context
(detached: the draft learns to read the main model, never changes it) and teacher-forced Markov inputs
(slot i's previous token is the true token x_{p+i}); slot i predicts x_{p+i+1}, which must lie inside the
sequence. With w_i = exp(-i / gamma) on the slots that have a target (DeepSpec's `loss_decay_gamma`):

- `ce`: the draft's cross-entropy against the data's next tokens;
- `l1`: sum |q - p| between the draft's distribution q and the main model's p at the same position (p
  detached; = 2 x total-variation distance, the draft's acceptance deficit);
- `confidence`: BCE of the confidence logit against the acceptance rate a_i = 1 - TV(q_i, p_i) (detached).

loss = ce_alpha * ce + l1_alpha * l1 + confidence_alpha * confidence, each a w-weighted mean (DeepSpec's
`compute_dspark_loss`; alphas 0.1 / 0.9 / 1.0 and gamma 4 are its `dspark_qwen3_*` configs'). Reported
alongside: `tau`, the expected tokens a verify of the whole block yields under these acceptance rates,
1 + sum_i prod_{j<=i} a_j (DeepSpec's `tau_probabilistic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DSparkLossConfig:
    anchors: int = 16
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    gamma: float = 4.0


@dataclass
class DSparkLoss:
    total: torch.Tensor  # the weighted objective (differentiable in the draft's parameters)
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    tau: torch.Tensor  # expected tokens per verify of a whole block (no gradient)


def sample_anchors(b: int, S: int, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[b, min(n, S - 1)] sorted anchor positions per row, drawn without replacement from 0 .. S - 2."""
    if S < 2:
        raise ValueError("a DSpark draft needs sequences of at least 2 tokens to train on")
    k = min(n, S - 1)
    rows = [torch.randperm(S - 1, generator=generator)[:k].sort().values for _ in range(b)]
    return torch.stack(rows).to(device)


def dspark_loss(
    model: nn.Module,
    tokens: torch.Tensor,
    taps: torch.Tensor,
    logits: torch.Tensor,
    anchors: torch.Tensor,
    cfg: DSparkLossConfig,
) -> DSparkLoss:
    """tokens [b, S]; taps [b, S, ...] and logits [b, S, vocab] of the main model's forward over them;
    anchors [b, A] -> the draft's losses (see the module docstring)."""
    draft = model.dspark
    B = draft.block_size
    b, S = tokens.shape
    dev = tokens.device
    blocks = draft.sequence_blocks(taps.detach(), tokens, anchors)  # N = b*A blocks
    slot = torch.arange(B, device=dev)
    label = anchors.unsqueeze(-1) + 1 + slot  # [b, A, B]
    valid = label < S
    rows = torch.arange(b, device=dev).view(b, 1, 1)
    target = tokens[rows, label.clamp(max=S - 1)]  # [b, A, B]
    prev = torch.cat([tokens[rows[..., 0], anchors].unsqueeze(-1), target[..., :-1]], -1)
    q_logits, conf = draft.heads(blocks, prev.flatten(0, 1))  # [N, B, V], [N, B]
    p_logits = logits.detach()[rows, (label - 1).clamp(max=S - 1)].flatten(0, 1).float()  # the main model's
    w = (valid * torch.exp(-slot / cfg.gamma)).flatten(0, 1).float()  # [N, B]
    denom = w.sum().clamp_min(1e-6)
    ce = (F.cross_entropy(q_logits.flatten(0, 1), target.flatten(), reduction="none").view_as(w) * w).sum() / denom
    dist = (q_logits.softmax(-1) - p_logits.softmax(-1)).abs().sum(-1)  # [N, B] = 2 TV
    l1 = (dist * w).sum() / denom
    accept = (1 - 0.5 * dist).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    confidence = (bce * w).sum() / denom
    total = cfg.ce_alpha * ce + cfg.l1_alpha * l1 + cfg.confidence_alpha * confidence
    with torch.no_grad():
        tau = 1 + (accept * valid.flatten(0, 1)).cumprod(-1).sum(-1).mean()
    return DSparkLoss(total, ce.detach(), l1.detach(), confidence.detach(), tau)


__all__ = ["DSparkLoss", "DSparkLossConfig", "dspark_loss", "sample_anchors"]
