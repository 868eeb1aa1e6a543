"""The engine's settings (`dsv4 serve`'s engine options name them: `dsv4.serve.startup.EngineSpec`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    max_seqs: int = 32  # sequences running at once
    max_model_len: int | None = None  # prompt + output limit (default: the model's, at most 8192)
    max_batch_tokens: int | None = None  # tokens per step, decodes + prompt chunks (default: 2048 on a GPU,
    # at least max_seqs + 512; 512 on a CPU)
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
