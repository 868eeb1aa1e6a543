"""Token sampling with static shapes (no boolean-mask indexing, BUGZOO Z23)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [n, vocab] fp32 -> token ids [n]. temperature 0 = greedy (argmax)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} (in (0, 1]), "
                         f"top_k={top_k} (>= 0)")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
