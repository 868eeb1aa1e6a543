"""What a practitioner watches: FLOPs/MFU, memory, mHC constraint violation, logs and the loss plot."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..errors import writing
from ..model.layers import recording

# dense bf16 peak (TFLOP/s) of known accelerators, for MFU; override with --peak-tflops
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}


# ------------------------------------------------------------------------------------------ FLOPs
def _block_matmul_params(cfg: ModelConfig, layer_id: int) -> int:
    """Weights one token multiplies through in one block (active experts only)."""
    d, h, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    n = d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd + d * hd  # wq_a, wq_b, wkv
    n += h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d  # wo_a (grouped), wo_b
    r = cfg.compress_ratios[layer_id]
    if r:
        coff = 2 if r == 4 else 1
        n += 2 * d * coff * hd  # compressor wkv, wgate
    if r == 4:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        n += cfg.q_lora_rank * ih * idim + d * ih + 2 * d * 2 * idim  # indexer
    n += d * cfg.n_routed_experts  # router
    n += (cfg.n_activated_experts + cfg.n_shared_experts) * 3 * d * cfg.moe_inter_dim
    n += 2 * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * d  # mHC mixes
    return n


def _attention_flops(cfg: ModelConfig, layer_id: int, s: int) -> float:
    """Forward FLOPs per token of QK^T and PV over the keys a query sees (averaged over positions)."""
    w = min(cfg.window_size, s)
    keys = w - w * (w - 1) / (2 * s)  # causal window
    r = cfg.compress_ratios[layer_id]
    if r == 4:
        keys += min(cfg.index_topk, s / (2 * r))
        keys_idx = s / (2 * r)  # indexer scoring
        extra = 2 * cfg.index_n_heads * cfg.index_head_dim * keys_idx
    elif r:
        keys += s / (2 * r)
        extra = 0.0
    else:
        extra = 0.0
    return 4 * cfg.n_heads * cfg.head_dim * keys + extra


def train_flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool = True) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) from the config's active weights."""
    ids = list(range(cfg.n_layers)) + (list(range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers)) if mtp else [])
    fwd = 0.0
    for i in ids:
        fwd += 2 * _block_matmul_params(cfg, i) + _attention_flops(cfg, i, seq_len)
    heads = 1 + (cfg.n_mtp_layers if mtp else 0)
    fwd += heads * 2 * cfg.dim * cfg.vocab_size
    if mtp:
        fwd += cfg.n_mtp_layers * 2 * 2 * cfg.dim * cfg.dim  # e_proj, h_proj
    return 3 * fwd


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for k, v in PEAK_TFLOPS.items():
        if k in name:
            return v
    return None


# ------------------------------------------------------------------------------------------ memory
def memory_estimate(model: nn.Module, optimizer_state_per_param: dict[str, int]) -> dict[str, float]:
    """Bytes (GiB) of weights, gradients and optimizer state before step 1 (docs/bugzoo.md Z21).

    optimizer_state_per_param: {param name: number of fp32 state tensors} (AdamW 2, Muon 1).
    """
    w = g = o = 0
    dtypes: dict[str, int] = {}
    for name, p in model.named_parameters():
        w += p.numel() * p.element_size()
        g += p.numel() * p.element_size() if p.requires_grad else 0
        o += p.numel() * 4 * optimizer_state_per_param.get(name, 0)
        key = str(p.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + p.numel()
    gib = 1024**3
    return {
        "weights_gib": w / gib,
        "grads_gib": g / gib,
        "optimizer_gib": o / gib,
        "total_gib": (w + g + o) / gib,
        "param_dtypes": dtypes,
    }


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)  # host peak RSS


# ------------------------------------------------------------------------------------------ mHC
@torch.no_grad()
def mhc_violation(model: nn.Module, tokens: torch.Tensor) -> float:
    """max |row or column sum - 1| of every mHC mixing matrix (comb) over a forward of `tokens`.

    The inputs of each hc_pre are captured with the stage recorder; comb is recomputed from them with
    the block's parameters through `ops.hc_split_sinkhorn`.
    """
    cfg = model.cfg
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str, t: torch.Tensor):
        if name == "embed" or name.endswith(("hc_attn_post", "hc_ffn_post")):
            seen[name] = t
        return None

    with recording(grab):
        model(tokens)
    x_prev = seen["embed"].unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
    worst = 0.0
    for i, layer in enumerate(model.layers):
        for kind, x in (("attn", x_prev), ("ffn", seen[f"layers.{i}.hc_attn_post"])):
            fn, scale, base = (_full(getattr(layer, f"hc_{kind}_{p}")) for p in ("fn", "scale", "base"))
            xf = x.flatten(-2).float()
            mixes = torch.nn.functional.linear(xf, fn.float()) * torch.rsqrt(
                xf.square().mean(-1, keepdim=True) + cfg.norm_eps
            )
            _, _, comb = ops.hc_split_sinkhorn(mixes, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
            worst = max(worst, float((comb.sum(-1) - 1).abs().max()), float((comb.sum(-2) - 1).abs().max()))
        x_prev = seen[f"layers.{i}.hc_ffn_post"]
    return worst


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter; a collective for DTensors."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ------------------------------------------------------------------------------------------ logs
class JsonlLog:
    """metrics.jsonl: one JSON object per line, one row per training step (plus start / end events)."""

    def __init__(self, path: str | Path | None, append: bool = False):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, row: dict) -> None:
        if self.path:
            with writing(self.path, kept="the rows of earlier steps are kept"), open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        """Every intact row of the log: the whole run, every stage of a resumed one (a torn last line is
        skipped)."""
        if not self.path or not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out

    def truncate_after(self, step: int) -> int:
        """Keep the log up to training step `step` and drop the rest (returns the rows dropped).

        A resumed run replays the steps after its checkpoint; their rows from the interrupted run go, so
        that every step has exactly one row. Everything from the first row of a later step on is dropped
        (with the evaluations and events that followed it), and so is a torn last line of a killed run.
        The file is replaced atomically: a crash here leaves the old log or the new one, never a mix.
        """
        if not self.path or not self.path.exists():
            return 0
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        kept: list[str] = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn write: nothing after it is trusted
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
                break
            kept.append(line)
        if len(kept) == len(lines):
            return 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(lines) - len(kept)


PLOT_UNAVAILABLE = "matplotlib is not installed (pip install 'dsv4[plot]')"


def plot_losses(rows: list[dict], path: str | Path) -> Path | None:
    """PNG of training loss parts and held-out loss against step (None when matplotlib is missing:
    PLOT_UNAVAILABLE says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    train = [r for r in rows if "lm" in r]
    for key in ("loss", "lm", "mtp"):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=f"train {key}", lw=1)
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out loss", lw=2)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
