"""The engine's settings (`dsv4 serve`'s engine options name them: `dsv4.serve.startup.EngineSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import activation_bytes
from .scheduler import SchedulerConfig

# a step of prompts alone takes up to this many tokens by default (at most 4 x max_batch_tokens) where a
# GPU's steps are bucketed
PREFILL_TOKENS = 8192


@dataclass
class EngineConfig:
    max_seqs: int = 32  # sequences running at once
    max_model_len: int | None = None  # prompt + output limit (default: the model's, at most 8192)
    max_batch_tokens: int | None = None  # tokens per step, decodes + prompt chunks (default: 2048 on a GPU,
    # at least max_seqs + 512; 512 on a CPU)
    max_prefill_tokens: int | None = None  # tokens per step when no sequence is decoding (a burst of
    # prompts; default where a GPU's steps are bucketed: 8192 or 4 x max_batch_tokens if less, halved while
    # such a step's activations would take over 5% of the device's memory; elsewhere max_batch_tokens)
    chunk_len: int | None = None  # prompt chunks fill slots of this many tokens (default: 64 where
    # steps are padded to buckets, else 1)
    page_size: int | None = None  # positions per page (default: see default_page_size)
    cache_pages: int | None = None  # compressed pages (default: every running sequence at full length)
    window_pages: int | None = None  # window pages (default: the window of every sequence, twice)
    prefix_caching: bool = True
    deterministic: bool = False  # batch-invariant numbers (float64 accumulation on the reference)
    cuda_graphs: bool = True  # replay every step from a CUDA graph of its bucket (CUDA only)
    pad_steps: bool = False  # bucketed (padded) steps also without graphs (tests)
    overlap: bool | None = None  # launch a step before reading the last one's tokens (default:
    # on CUDA, where the device runs while the host does bookkeeping)
    max_n: int = 16  # choices per request
    speculative: int = 0  # draft tokens per step, K (0: off): from the MTP block, or at
    # most K from a DSpark draft (K <= its block size)
    speculative_threshold: float = 0.0  # DSpark: verify the drafts whose survival probability (the
    # confidence head's) is >= this; 0 = always K

    def resolve(self, cfg, device: torch.device, graphs: bool, padded: bool) -> None:
        """Fill in the defaults that depend on the model and the device (the engine calls it on its copy)."""
        on_gpu = device.type == "cuda"
        if self.max_seqs < 1 or (self.max_batch_tokens is not None and self.max_batch_tokens < 1):
            raise ValueError("max_seqs and max_batch_tokens must be >= 1")
        if self.max_batch_tokens is None:
            self.max_batch_tokens = max(2048, self.max_seqs + 512) if on_gpu else 512
        if self.chunk_len is None:
            self.chunk_len = 64 if (graphs or padded) else 1
        self.chunk_len = max(1, min(self.chunk_len, self.max_batch_tokens))
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.max_batch_tokens:
            raise ValueError(
                f"max_prefill_tokens ({self.max_prefill_tokens}) must be at least max_batch_tokens "
                f"({self.max_batch_tokens}): a step of prompts alone may always take a full step's budget"
            )
        if self.max_prefill_tokens is None:  # where a GPU's steps are bucketed (its graphs, or padded eagerly)
            self.max_prefill_tokens = self.max_batch_tokens
            if on_gpu and (graphs or padded):
                most = min(PREFILL_TOKENS, 4 * self.max_batch_tokens)
                self.max_prefill_tokens = max(self.max_batch_tokens, default_prefill_tokens(cfg, device, most))

    def scheduler_config(self, max_model_len: int, runner) -> SchedulerConfig:
        """The scheduler's settings: padded steps take chunk slot counts that the runner has buckets for
        (where the budget bounds a step's chunks), a step of prompts alone the prefill buckets' too."""
        pad = runner.pad
        sizes, prefill_sizes = (tuple(runner.slot_sizes), tuple(runner.prefill_sizes)) if pad else ((), ())
        prefill = self.max_prefill_tokens if (prefill_sizes or not pad) else 0
        return SchedulerConfig(
            self.max_seqs,
            max_model_len,
            self.max_batch_tokens,
            self.chunk_len,
            self.prefix_caching,
            sizes,
            max_prefill_tokens=prefill,
            prefill_slot_sizes=prefill_sizes,
            resume_decoding=bool(self.speculative),
            draft_lookahead=self.speculative + 1 if runner.mtp else 0,  # (the next drafts' MTP rows)
        )


def default_prefill_tokens(cfg, device: torch.device, most: int) -> int:
    """`most`, halved while one such step's activations (`dsv4.activations.activation_bytes`, the fused
    kernels' peak, for a burst of new prompts) would take more than 5% of the device's memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    n = most
    while n > 512 and activation_bytes(cfg, n, cfg.window_size, logits_rows=0, fused=True) > total // 20:
        n //= 2
    return n
