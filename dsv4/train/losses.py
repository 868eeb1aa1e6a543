"""V4 training losses on one packed batch.

- next-token cross-entropy: logits[:, t] predicts tokens[:, t+1];
- MTP: depth k's logits at position t predict tokens[:, t+k+2] (only positions with a target), mean over
  depths, weighted by `mtp_weight` (the report uses 0.3, then 0.1 late in training);
- Lightning Indexer: the model already returns KL(main attention || indexer) over the selected
  compressed entries summed over CSA layers; its inputs are detached inside the model, so this term
  trains only the indexer (weight `indexer_weight`);
- sequence-wise balance loss: already multiplied by alpha in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossParts:
    total: torch.Tensor
    lm: torch.Tensor
    mtp: torch.Tensor | None = None
    indexer: torch.Tensor | None = None
    balance: torch.Tensor | None = None
    dspark: torch.Tensor | None = None  # a DSpark draft's loss (dsv4.train.dspark_loss)
    dspark_tau: torch.Tensor | None = None  # its expected tokens per verify of a whole block

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parts that are present, by name (device tensors)."""
        return {
            k: v
            for k, v in (
                ("loss", self.total),
                ("lm", self.lm),
                ("mtp", self.mtp),
                ("indexer", self.indexer),
                ("balance", self.balance),
                ("dspark", self.dspark),
                ("dspark_tau", self.dspark_tau),
            )
            if v is not None
        }

    def floats(self) -> dict[str, float]:
        return {k: float(v.detach()) for k, v in self.tensors().items()}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [b, s, V] fp32, tokens [b, s] -> mean CE of logits[:, :-1] against tokens[:, 1:]."""
    v = logits.size(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1))


def mtp_loss(mtp_logits: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor | None:
    """Depth k logits [b, s-1-k, V]: position t predicts tokens[t+k+2]; mean of the depths' mean CE."""
    s = tokens.size(1)
    losses = []
    for k, lg in enumerate(mtp_logits):
        n = s - k - 2  # positions whose target lies inside the window
        if n <= 0:
            break
        v = lg.size(-1)
        losses.append(F.cross_entropy(lg[:, :n].reshape(-1, v).float(), tokens[:, k + 2 :].reshape(-1)))
    return torch.stack(losses).mean() if losses else None


def total_loss(out, tokens: torch.Tensor, mtp_weight: float = 0.3, indexer_weight: float = 1.0) -> LossParts:
    """Combine a ModelOutput's parts into the training objective."""
    lm = next_token_loss(out.logits, tokens)
    total = lm
    mtp = mtp_loss(out.mtp_logits, tokens) if out.mtp_logits else None
    if mtp is not None:
        total = total + mtp_weight * mtp
    if out.indexer_loss is not None:
        total = total + indexer_weight * out.indexer_loss
    if out.balance_loss is not None:
        total = total + out.balance_loss
    return LossParts(total, lm, mtp, out.indexer_loss, out.balance_loss)
