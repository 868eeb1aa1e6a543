"""Plain-torch reference of the training losses' cross entropy.

Part of `dsv4.ops.reference` (which re-exports every name here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import acc_dtype


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of the rows whose target is not `ignore_index` (NaN when every row is ignored).

    logits [N, V] fp32, target [N] int64 -> fp32 scalar (float64 inside under exact accumulation).
    Differentiable in logits: d loss / d logits = (softmax - one-hot of the target) / rows counted.
    """
    acc = acc_dtype()
    return F.cross_entropy(logits.to(acc), target, ignore_index=ignore_index).float()
