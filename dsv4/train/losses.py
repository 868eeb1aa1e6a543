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

from .. import ops


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


IGNORE = -100  # a target that takes no part in a loss (cross_entropy's ignore_index)


def shifted_targets(tokens: torch.Tensor, shift: int, length: int) -> torch.Tensor:
    """[b, length] targets: position t's is tokens[:, t + shift] where that lies inside the window, IGNORE
    after it. The losses take their logits whole with these (a slice of the logits to the positions that
    have a target would copy them, and its backward pad the gradient back: a few GB a step at 64 x 1024
    tokens and a 4,096 vocabulary)."""
    b, s = tokens.shape
    out = tokens.new_full((b, length), IGNORE)
    n = max(0, min(length, s - shift))
    out[:, :n] = tokens[:, shift : shift + n]
    return out


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [b, s, V] fp32, tokens [b, s] -> mean CE of logits[:, :-1] against tokens[:, 1:]."""
    v = logits.size(-1)
    target = shifted_targets(tokens, 1, logits.size(1))
    return ops.cross_entropy(logits.reshape(-1, v).float(), target.reshape(-1), IGNORE)


def mtp_loss(mtp_logits: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor | None:
    """Depth k logits [b, s-1-k, V]: position t predicts tokens[t+k+2]; mean of the depths' mean CE."""
    s = tokens.size(1)
    losses = []
    for k, lg in enumerate(mtp_logits):
        if s - k - 2 <= 0:  # no position's target lies inside the window
            break
        v = lg.size(-1)
        target = shifted_targets(tokens, k + 2, lg.size(1))
        losses.append(ops.cross_entropy(lg.reshape(-1, v).float(), target.reshape(-1), IGNORE))
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
