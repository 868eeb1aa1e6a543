"""Held-out loss in nats per token and bits per byte, and the completion evaluations, for one model.

Held-out documents are the ones `dsv4 train` keeps out of training for the same corpus and
`--held-out-pct` (`dsv4.train.data.is_held_out`, a hash of each file's name). Each is tokenized as
`BOS text EOS`, the documents are concatenated as in training, and the stream is scored in windows of
`seq_len + 1` tokens that overlap by one, so every token after the first is predicted exactly once (the
context restarts at each window). Bits per byte divide the same total by ln 2 and by the UTF-8 bytes of
the documents, so models with different tokenizers compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..train.data import is_held_out, read_text


@dataclass
class HeldOutLoss:
    documents: int
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes of the documents
    nats: float  # total cross-entropy

    @property
    def nats_per_token(self) -> float:
        return self.nats / max(1, self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / max(1, self.bytes)


def held_out_documents(docs: list[tuple[str, Path]], held_out_pct: float) -> list[tuple[str, Path]]:
    return [(name, p) for name, p in docs if is_held_out(name, held_out_pct)]


@torch.no_grad()
def held_out_loss(
    model,
    tokenizer,
    docs: list[tuple[str, Path]],
    seq_len: int = 512,
    batch_size: int = 8,
    max_tokens: int = 0,
    progress: bool = False,
) -> HeldOutLoss:
    """Score the documents (already the held-out ones) as one BOS..EOS stream. max_tokens > 0: only the
    documents that still fit in that many tokens, in order (whole documents, so the byte count stays exact;
    a quick look, biased to short files)."""
    device = next(model.parameters()).device
    stream: list[int] = []
    n_bytes = 0
    used = 0
    for _, p in docs:
        text = read_text(p)
        ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
        if max_tokens and len(stream) + len(ids) > max_tokens:
            continue
        stream += ids
        n_bytes += len(text.encode("utf-8"))
        used += 1
    if len(stream) < 2:
        raise UserError(f"no held-out document fits in {max_tokens} tokens: raise --token-budget")
    ids = torch.tensor(stream, dtype=torch.long)
    starts = list(range(0, max(1, ids.numel() - 1), seq_len))
    total, count = 0.0, 0
    from ..progress import bar

    steps = bar(len(starts), "held-out loss: windows", progress)
    for i in range(0, len(starts), batch_size):
        steps.update(len(starts[i : i + batch_size]))
        windows = [ids[s : s + seq_len + 1] for s in starts[i : i + batch_size]]
        full = [w for w in windows if w.numel() == seq_len + 1]
        rest = [w for w in windows if w.numel() != seq_len + 1 and w.numel() > 1]  # the ragged last one
        for group in ([torch.stack(full)] if full else []) + [w[None] for w in rest]:
            x = group.to(device)  # [b, L + 1]
            logits = model(x[:, :-1]).logits  # [b, L, vocab] fp32
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    steps.close()
    return HeldOutLoss(documents=used, tokens=count, bytes=n_bytes, nats=total)
