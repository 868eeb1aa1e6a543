"""Inputs for checks: random, and structured - because some bugs only show on real structure (docs/bugzoo.md Z13).

- token sequences (random, fixed seed) with lengths on window / compression boundaries;
- sparse-attention inputs: random; RoPE'd q/kv captured from a real forward pass; peaked softmax (one key
  dominates, large logits); rows whose top-k is all padding (-1); window-only (no compressed keys);
- indexer inputs whose early queries see no complete compression group (all-padding top-k rows).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig

# Shrunk windows so that short sequences cross every boundary (window, CSA ratio 4, HCA ratio).
CHECK_WINDOW = 16
CHECK_HCA_RATIO = 16


def check_config(
    cfg: ModelConfig | str, window: int | None = CHECK_WINDOW, hca_ratio: int | None = CHECK_HCA_RATIO
) -> ModelConfig:
    """cfg with the window and the heavy compression ratio shrunk (None keeps them), for fast checks.

    A 40-token sequence then slides the window twice and completes groups of every compressed layer.
    """
    if isinstance(cfg, str):
        cfg = ModelConfig.preset(cfg)
    changes: dict = {}
    if window is not None and window < cfg.window_size:
        changes["window_size"] = window
    if hca_ratio is not None:
        ratios = tuple(hca_ratio if r > 4 else r for r in cfg.compress_ratios)
        if ratios != cfg.compress_ratios:
            changes["compress_ratios"] = ratios
    return cfg.replace(**changes) if changes else cfg


def random_tokens(
    cfg: ModelConfig, batch: int = 2, seq: int = 40, seed: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """[batch, seq] token ids; drawn on the CPU (the same ids on every device), then moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device or "cpu")


def boundary_lengths(cfg: ModelConfig) -> list[int]:
    """Sequence lengths just before, on and after each window and compression boundary."""
    out: set[int] = set()
    for edge in {cfg.window_size, *(r for r in cfg.compress_ratios if r)}:
        out.update({edge - 1, edge, edge + 1, 2 * edge})
    return sorted(n for n in out if n > 0)


# ------------------------------------------------------------------------------ sparse attention
def window_idx(s: int, window: int, b: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """[b, s, w] causal window indices (-1 = none), the window-only layout (no compressed keys)."""
    w = min(s, window)
    t = torch.arange(s, device=device).unsqueeze(1)
    idx = t - w + 1 + torch.arange(w, device=device)
    return torch.where(idx >= 0, idx, -1).unsqueeze(0).expand(b, -1, -1).contiguous()


def attention_inputs(
    kind: str,
    b: int = 1,
    s: int = 24,
    h: int = 4,
    d: int = 128,
    window: int = 8,
    n_comp: int = 0,
    seed: int = 0,
    stages: dict[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Inputs for `ops.sparse_attention(q, kv, sink, idx, scale)`.

    kind: "random" (unit normal), "peaked" (logits of tens: softmax close to one-hot), "roped" (q and kv
    of a real forward pass, taken from `stages` of a window-only layer), "padding" (half of the rows have
    no valid key at all). n_comp > 0 appends that many compressed keys visible to every query.
    Values are drawn on the CPU (the same numbers on every device), then moved to `device`; q and kv are
    `dtype`, the sink fp32.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "roped":
        if not stages:
            raise ValueError("roped inputs need the stages of a forward pass")
        q_name = next(n for n in stages if n.endswith(".attn.q"))
        q = stages[q_name].float()
        kv = stages[q_name[: -len(".q")] + ".kv"].float()
        b, s, h, d = q.shape
        q = q * 4.0  # sharper, like trained attention: peaked real structure
    else:
        q = torch.randn(b, s, h, d, generator=gen)
        kv = torch.randn(b, s, d, generator=gen)
        if kind == "peaked":  # logits with a spread of ~40: near one-hot softmax
            q = q * 8.0
            kv = kv * 5.0
    sink = torch.randn(h, generator=gen) * 0.5
    idx = window_idx(s, window, b)
    if n_comp:
        comp = torch.randn(b, n_comp, d, generator=gen).to(kv.device)  # roped kv lives where the stages do
        kv = torch.cat([kv, comp], 1)
        cidx = (torch.arange(n_comp) + s).view(1, 1, -1).expand(b, s, -1)
        idx = torch.cat([idx, cidx], -1)
    if kind == "padding":
        idx = idx.clone()
        idx[:, ::2] = -1
    dev = device or q.device
    return {"q": q.to(dev, dtype), "kv": kv.to(dev, dtype), "sink": sink.to(dev), "idx": idx.to(dev), "scale": d**-0.5}


# ------------------------------------------------------------------------------ indexer
def indexer_inputs(
    b: int = 1,
    s: int = 12,
    h: int = 4,
    d: int = 128,
    ratio: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Inputs for `ops.indexer_topk`: the first ratio-1 queries see no complete group (all-padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    n = s // ratio
    dev = device or "cpu"
    return {
        "q": torch.randn(b, s, h, d, generator=gen).to(dev, dtype),
        "k": torch.randn(b, n, d, generator=gen).to(dev, dtype),
        "weights": torch.randn(b, s, h, generator=gen).to(dev),
        "positions": torch.arange(s, device=dev),
        "ratio": ratio,
        "topk": n,
    }


def moe_inputs(
    cfg: ModelConfig,
    tokens: int = 16,
    scale: float = 1.0,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Inputs for `ops.moe_experts`; scale > 1 pushes the SwiGLU pre-activations past swiglu_limit.

    x and the expert weights are `dtype`, the routing weights fp32; drawn on the CPU, moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    e, k, dim, inter = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    x = torch.randn(tokens, dim, generator=gen) * scale
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)
    dev = device or "cpu"
    return {
        "x": x.to(dev, dtype),
        "weights": (w / w.sum(-1, keepdim=True)).to(dev),
        "indices": idx.to(dev),
        "w1": (torch.randn(e, inter, dim, generator=gen) * dim**-0.5).to(dev, dtype),
        "w2": (torch.randn(e, dim, inter, generator=gen) * inter**-0.5).to(dev, dtype),
        "w3": (torch.randn(e, inter, dim, generator=gen) * dim**-0.5).to(dev, dtype),
        "swiglu_limit": cfg.swiglu_limit,
    }


def upcast(inp: dict) -> dict:
    """The same inputs with every floating tensor in fp32 (for an fp32 reference of low-precision inputs)."""
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inp.items()}
