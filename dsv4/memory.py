"""What running and training a model takes in memory: estimates from the config, and a measurement to check them.

Estimates need no weights (a model on the meta device gives the parameter shapes). They follow what the
code stores, not a generic transformer formula:

- weights: the model's parameters and buffers in the compute dtype (FP8 / FP4 checkpoint weights
  dequantized at load), or with `keep_quantized` the FP8 linears and FP8 / MXFP4 experts left as stored
  (data + block scales), every other tensor as loaded; on disk: the release layout's bytes.
- KV cache: exactly what `Engine` allocates for `max_seqs` sequences of `max_model_len` positions
  (`dsv4.model.paged.PagedKVCache`): per layer the window pages and compressed entries in the compute
  dtype, CSA indexer keys in the compute dtype, the compressors' pending rows (fp32 rings per sequence)
  and, with prefix caching, each compressed page's last raw group (fp32).
- activations of one step of T tokens (a prefill chunk), as the reference ops compute it: the hidden
  streams, then the largest of one layer's attention (gathered keys, fp32 scores and probabilities, the
  CSA indexer's [T, heads, entries] fp32 scores) or its MoE (router scores, each routed token's expert
  hidden, the shared expert), plus the logits of the rows that want them. The fused GPU kernels do not
  materialize the score tensors, so on a GPU this is an upper bound.
- training: fp32 master weights, fp32 gradients, optimizer state as `dsv4.train.optim.MuonAdamW` keeps it
  (Muon: one fp32 momentum per hidden matrix; AdamW: two fp32 moments for the rest), the bf16 copies of the
  weights that bf16 autocast casts (`TrainState.copies`), and what is alive at the step's peak, early in
  the backward (`train_activation_terms`): the tensors every block saved for its backward, counted from
  what each op and fused autograd Function saves (`train_layer_saved`; with `activation_checkpointing`
  only each block's input), the heads' saved tensors (fp32 log-softmax over the vocabulary) and the first
  head projection's backward splitting the fp32 logits gradient into bf16 parts. The optimizer step's
  temporaries come after the backward has freed every activation: Muon's Newton-Schulz iterates every
  matrix of one shape at once (`MuonPlan`, up to 2^27 elements a batch; as fp32 on a CPU), so with many
  stacked experts they can exceed the backward's activations and set the step's peak (`muon_step_bytes`;
  a 57M-parameter model with 16 experts x 8 layers, 2 x 256 tokens with checkpointing on the CPU: 1.33 GB
  measured, 0.91 GB estimated from the activations alone, 1.31 GB with the larger of the two). The CPU
  measurement's estimate (`dsv4 info --measure`) and the GPU counts take the larger (on a GPU the
  iterates stay bf16; on one of W expert-parallel ranks the expert stacks are 1/W). The
  CPU reference path (fp32, no autocast) is estimated by the older
  per-layer model in `train_activation_bytes(fused=False)`.

Parallelism dsv4 supports: inference on one device or on N workers with the routed experts split over
them (`rank_bytes`, `serving_gpus`); training with FSDP2 (dense weights, gradients and
optimizer state sharded over W ranks) plus expert parallelism (routed experts split over the same W ranks;
W must divide the expert count). A rank also holds one block's gathered weights while FSDP runs it.

`measure_inference` / `measure_training` measure the peak of torch's CPU allocations: the bytes live when
the measurement starts plus the largest running sum of the allocation events torch's profiler records
(`profile_memory=True`, every allocation and free, in time order) during the step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch

from .activations import activation_bytes, layer_parts, layer_step_bytes
from .config import ModelConfig

GB = 10**9
GIB = 2**30
# the share of a GPU's memory tensors can use: the CUDA context, allocator slack and NCCL buffers take the rest
USABLE_FRACTION = 0.92


# ------------------------------------------------------------------------------------------ weights
@dataclass
class WeightBytes:
    params: int  # parameters (backbone + MTP)
    dequantized: int  # in memory, every float weight in the compute dtype (fp32-by-design kept)
    kept_quantized: int  # in memory with keep_quantized: FP8 / FP4 weights as stored
    stored: int  # on disk in the release layout (config's dtype / expert_dtype)
    by_format: dict  # stored bytes by safetensors dtype
    # bf16 parts a GPU engine keeps once split (`ops.keep_splits`): 6 bytes per fp32 element of the fp32
    # projections (head, compressors; bf16x3 runs from 2 rows of bf16 activations, so 0 in other dtypes),
    # and the mHC mix weights' (`hc_fn_split_bytes`); an upper bound: a weight is split at its first call
    splits: int = 0


def hc_fn_split_bytes(mix: int, k: int, hc: int) -> int:
    """The bf16 parts a GPU engine keeps of one mHC mix weight [mix, k] (`dsv4.ops.triton.mhc_fn.make_split`'s
    tensors): three parts of the pre | post columns, padded to a 16-wide tile, and of the hc x hc comb columns
    (the head's weight, with hc rows, has only the first)."""
    cols = max(16, 1 << (2 * hc - 1).bit_length()) + (0 if mix == hc else hc * hc)
    return 3 * 2 * k * cols


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> WeightBytes:
    w = _weight_bytes(cfg, dtype)
    return replace(w, by_format=dict(w.by_format))


@functools.lru_cache(maxsize=16)  # a config's inventory is millions of names at Pro's size: count it once
def _weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> WeightBytes:
    from .checkpoint.layouts import expected_tensors
    from .model import DeepSeekV4

    model = DeepSeekV4(cfg, dtype=dtype, device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    in_memory = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(p.numel() for p in model.parameters())
    inventory = expected_tensors(cfg, "release", mtp=cfg.n_mtp_layers > 0)
    by_format: dict[str, int] = {}
    quant_logical = quant_stored = 0
    for name, (shape, st_dtype) in inventory.items():
        n = math.prod(shape) * _ST_BYTES[st_dtype]
        by_format[st_dtype] = by_format.get(st_dtype, 0) + n
        if st_dtype in ("F8_E4M3", "I8") or name.endswith(("weight_scale_inv", ".scale")):
            quant_stored += n
            if not name.endswith(("weight_scale_inv", ".scale")):
                quant_logical += math.prod(shape) * (2 if st_dtype == "I8" else 1)
    kept = in_memory - quant_logical * torch.finfo(dtype).bits // 8 + quant_stored
    splits = 0
    if dtype == torch.bfloat16:
        splits = sum(
            6 * p.numel() if name.endswith(".weight") else hc_fn_split_bytes(*p.shape, cfg.hc_mult)
            for name, p in model.named_parameters()
            if p.dtype == torch.float32 and p.dim() == 2 and name.endswith((".weight", "_fn"))
        )
    return WeightBytes(params, in_memory, kept, sum(by_format.values()), by_format, splits)


_ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


# ------------------------------------------------------------------------------------------ KV cache
@dataclass
class CacheBytes:
    total: int  # what Engine allocates for max_seqs x max_model_len
    per_token: float  # marginal bytes per cached position of one sequence (compressed entries,
    # indexer keys, page tails)
    per_sequence_fixed: int  # window pages and compressor rings of one running sequence


def engine_cache_layout(
    cfg: ModelConfig, max_seqs: int, max_model_len: int, max_batch_tokens: int = 4096, prefix_caching: bool = True
):
    """The CacheLayout `Engine` builds from these settings (its defaults: page size, pages per sequence)."""
    from .model.paged import CacheLayout, default_page_size

    P = default_page_size(cfg)
    n_c = max_seqs * math.ceil(max_model_len / P)
    n_w = 2 * max_seqs * (math.ceil((cfg.window_size + max_batch_tokens) / P) + 1)
    return CacheLayout.for_model(cfg, n_w + 1, n_c + 1, max_seqs, max_model_len, P, page_tails=prefix_caching)


def layout_bytes(cfg: ModelConfig, layout, dtype_bytes: int) -> int:
    """Bytes of `PagedKVCache(cfg, layout, ...)` without allocating it (its tensors, reserved rows included)."""
    from .model.paged import RING_BASE, overlap

    P, total = layout.page_size, 0
    for ratio in cfg.compress_ratios:
        n_ent = layout.n_comp_pages * (P // ratio) if ratio else 0
        total += (layout.n_window_pages * P + n_ent) * cfg.head_dim * dtype_bytes
        if not ratio:
            continue
        widths = [(2 if overlap(ratio) else 1) * cfg.head_dim]
        tails = [layout.page_tails and overlap(ratio)]
        if ratio == 4:
            total += n_ent * cfg.index_head_dim * dtype_bytes
            widths.append(2 * cfg.index_head_dim)
            tails.append(layout.page_tails)
        for width, tail in zip(widths, tails):
            total += 2 * (RING_BASE + layout.n_states * layout.ring_len(ratio)) * width * 4  # kv + score, fp32
            if tail:
                total += 2 * layout.n_comp_pages * ratio * width * 4
    return total


def cache_bytes(
    cfg: ModelConfig,
    context: int,
    batch: int,
    dtype_bytes: int = 2,
    max_batch_tokens: int = 4096,
    prefix_caching: bool = True,
) -> CacheBytes:
    total = layout_bytes(cfg, engine_cache_layout(cfg, batch, context, max_batch_tokens, prefix_caching), dtype_bytes)
    one = layout_bytes(cfg, engine_cache_layout(cfg, 1, context, max_batch_tokens, prefix_caching), dtype_bytes)
    two = layout_bytes(cfg, engine_cache_layout(cfg, 1, 2 * context, max_batch_tokens, prefix_caching), dtype_bytes)
    per_token = (two - one) / context
    return CacheBytes(total, per_token, int(one - per_token * context))


# ------------------------------------------------------------------------------------------ activations
def train_activation_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    checkpointing: bool = False,
    dtype_bytes: int = 2,
    mtp: bool = True,
    fused: bool = False,
) -> int:
    """Activation bytes at a training step's peak. fused=True: the GPU path (bf16 autocast, the Triton
    kernels), the sum of `train_activation_terms`. fused=False: the reference ops (a CPU, fp32): what the
    forward saved, plus the backward's working set for one layer (each fp32 attention tensor it saved gets a
    gradient of its size: the layer's forward transient once more); with checkpointing only each block's
    input is saved, and one layer is recomputed at a time."""
    if fused:
        return sum(train_activation_terms(cfg, batch, seq_len, checkpointing, dtype_bytes, mtp).values())
    T, a = batch * seq_len, dtype_bytes
    L = cfg.n_layers + (cfg.n_mtp_layers if mtp else 0)
    stream = T * cfg.hc_mult * cfg.dim * a

    def transient(ratio: int) -> int:
        return layer_step_bytes(cfg, ratio, seq_len, seq_len, a) * batch

    def saved(ratio: int) -> int:
        # a layer's intermediates: streams and mHC mixes, the attention's and the MoE's (both kept for the
        # backward; the sequence is its own context), the LoRA / output projections and each routed token's
        # expert input and hidden
        return (
            4 * stream
            + sum(layer_parts(cfg, ratio, seq_len, seq_len, a)) * batch
            + T * (cfg.q_lora_rank + cfg.o_groups * cfg.o_lora_rank + 2 * cfg.dim) * a
            + T * cfg.n_activated_experts * (cfg.dim + 3 * cfg.moe_inter_dim) * a
        )

    ratios = list(cfg.compress_ratios[:L])
    logits = T * cfg.vocab_size * 4 * 2 * (1 + (cfg.n_mtp_layers if mtp else 0))  # logits + log-softmax
    backward = max(transient(r) for r in ratios)
    if checkpointing:
        return L * stream + max(saved(r) for r in ratios) + backward + logits
    return sum(saved(r) for r in ratios) + backward + logits


def train_layer_saved(cfg: ModelConfig, ratio: int, batch: int, seq_len: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one block saves for its backward on the GPU path (bf16 autocast, fp32 master weights, the
    Triton kernels), by what saves them. Per token unless said otherwise; a = the compute dtype's bytes.

    - mhc: twice per block (before attention, before the MoE), `_HcPre` saves the residual stream
      [hc, dim] (also `_HcPost`'s residual: one storage), the fp32 mixes [(2 + hc) hc] and rsqrt; `_HcPost`
      saves post [hc] and comb [hc, hc] (fp32) and the sublayer output [dim]; the sublayer's RMSNorm saves
      its input [dim].
    - attention: the normed input [dim] (wq_a, wkv, the compressors, the indexer's head weights); wq_a's
      output and qr [q_lora_rank] each; wq_b's output (the query norm's input) and the roped query
      [heads, head_dim] each; wkv's output [head_dim]; the keys `_SparseAttention` reads (this sequence's
      kv plus its compressed entries, [head_dim] each), its output o and o's low half `o_lo` [heads,
      head_dim] each, lse [heads] fp32 and the key index list (int64: window + selected entries per
      query; window-only layers share one [seq, window] list across the batch); the output after the
      inverse rope, as the O-LoRA einsum's grouped copy [heads, head_dim], and wo_a's output [o_groups,
      o_lora_rank] (wo_b's input).
    - compressors: `_CompressPool` saves each compressor's kv and gate-score rows in fp32 ([2 head_dim]
      each with ratio 4's overlapping windows, [head_dim] otherwise); per compressed entry its pooled
      value before the norm [head_dim]; ratio 4 also the indexer's own.
    - indexer (ratio 4): its roped query [index_heads, index_head_dim] and fp32 head weights (saved by
      `_IndexerScores`); its fp32 scores over every entry [seq / 4] (the loss's gather keeps them), the
      loss's gather index (int64), log-softmax (fp32) and masks over the top-k entries.
    - router: fp32 logits and scores [experts] (softplus, sqrt), the chosen indices (int64) and weights.
    - moe: the normed input [dim] (the gate/up kernel gathers its rows and keeps it, not the rows); each
      routed slot (token x top-k): the clamped SwiGLU's gate and up [inter] in their dtype and its routing
      weight (fp32; the Triton kernel's backward recomputes the rest), the weighted hidden [inter] (w2's
      input) and the plan's int64 slot order and token ids; the shared expert the same gate, up and hidden
      per token.
    """
    b, s, a = batch, seq_len, dtype_bytes
    T = b * s
    D, H, d, hc, E, k, inter = (
        cfg.dim,
        cfg.n_heads,
        cfg.head_dim,
        cfg.hc_mult,
        cfg.n_routed_experts,
        cfg.n_activated_experts,
        cfg.moe_inter_dim,
    )
    w = min(cfg.window_size, s)
    n = s // ratio if ratio else 0
    mhc = 2 * T * (hc * D * a + ((2 + hc) * hc + 1 + hc + hc * hc) * 4 + 2 * D * a)
    if ratio == 4:
        picked = min(cfg.index_topk, n)
    else:
        picked = n
    idx = T * (w + picked) * 8 if ratio else s * w * 8
    attn = (
        T * (D + 2 * cfg.q_lora_rank + 2 * H * d + d) * a
        + b * (s + n) * d * a
        + T * (2 * H * d * a + H * 4)
        + idx
        + T * (H * d + cfg.o_groups * cfg.o_lora_rank) * a
    )
    coff = 2 if ratio == 4 else 1
    comp = b * n * d * a + T * 2 * coff * d * 4 if ratio else 0
    indexer = 0
    if ratio == 4:
        comp += b * n * cfg.index_head_dim * a + T * 2 * 2 * cfg.index_head_dim * 4
        indexer = (
            T * (cfg.index_n_heads * cfg.index_head_dim * a + cfg.index_n_heads * 4 + picked * (8 + 4 + 3)) + T * n * 4
        )
    router = T * (2 * E * 4 + k * (8 + 4) + 8)
    swiglu = 2 * inter * a  # gate and up, what the SwiGLU kernel's backward reads
    moe = T * D * a + T * k * (swiglu + inter * a + 8 + 8 + 4) + T * cfg.n_shared_experts * (swiglu + inter * a)
    return {"mhc": mhc, "attention": attn, "compressors": comp, "indexer": indexer, "router": router, "moe": moe}


def train_activation_terms(
    cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool = False, dtype_bytes: int = 2, mtp: bool = True
) -> dict[str, int]:
    """What is alive at a GPU training step's peak besides the weights, gradients and optimizer state (and
    the bf16 weight copies, `TrainState.copies`), by name. The peak is early in the backward, in the
    first head's projection backward (the last MTP head's, or the main head's without MTP):

    - blocks: every block's `train_layer_saved` (with checkpointing: each block's input stream, the only
      tensor a checkpointed block saves; a block is recomputed later, when the heads' tensors are gone).
    - heads: per head (the main one and each MTP block's), the Triton hc_head's input stream [hc, dim]
      and its fp32 mixes [hc] and RMS scale, the final norm's input and output [dim] and the fp32 logits
      [vocab] that the cross entropy keeps; each MTP block's combine: the fp32 embedding and its bf16 cast
      [dim], the hidden norm's input and output [hc, dim].
    - logits_grad: the head projection's backward (`linear_fp32`'s bf16x3 backend) splits the fp32 logits
      gradient [vocab] (which takes the place of that head's freed logits) into three bf16 parts:
      bf16 hi, fp32 rest, bf16 mid, its fp32 upcast and fp32 remainder coexist, 16 bytes per vocab entry.
    """
    b, s, a = batch, seq_len, dtype_bytes
    T = b * s
    D, hc, V = cfg.dim, cfg.hc_mult, cfg.vocab_size
    n_mtp = cfg.n_mtp_layers if mtp else 0
    ratios = list(cfg.compress_ratios[: cfg.n_layers + n_mtp])
    if checkpointing:
        blocks = len(ratios) * T * hc * D * a
    else:
        blocks = sum(sum(train_layer_saved(cfg, r, b, s, a).values()) for r in ratios)
    head = T * (hc * D * a + (hc + 1) * 4 + 2 * D * a + V * 4)
    combine = T * (D * 4 + D * a + 2 * hc * D * a)
    return {"blocks": blocks, "heads": (1 + n_mtp) * head + n_mtp * combine, "logits_grad": T * V * 16}


# ------------------------------------------------------------------------------------------ training state
@dataclass
class TrainState:
    weights: int  # fp32 master weights
    grads: int  # fp32
    optimizer: int  # Muon momentum + AdamW moments, fp32
    expert_share: float  # fraction of the three above in routed experts (expert parallelism splits it)
    largest_block: int  # fp32 bytes of the largest block (what FSDP gathers to run it)
    dense_copies: int = 0  # bf16 copies of the weights bf16 autocast casts (every `Linear` computed in
    # bf16): kept in autocast's cache for the whole forward and saved for the
    # backward by the matmuls, on every rank (FSDP2 gathers them whole)
    expert_copies: int = 0  # the routed experts' bf16 copies (`Experts.forward` casts them each step,
    # the grouped GEMMs save them): split over the expert-parallel ranks
    expert_copies_block: int = 0  # the largest block's share of expert_copies
    head_split: int = 0  # the fp32 head's bf16x3 split one process keeps for a step (`dsv4.train.casts`)

    def copies(self, world: int = 1, checkpointing: bool = False) -> int:
        """bf16 weight copies alive at the training peak on one of `world` ranks. One process keeps every
        routed expert's copy and the head's split for the whole step (`dsv4.train.casts`); on several ranks
        the experts are cast at each use and, with checkpointing, only one block's exist at a time (the
        blocks save nothing; autocast's cache of the dense ones lasts to the end of the forward, where every
        block's input is saved as well)."""
        experts = self.expert_copies_block if checkpointing and world > 1 else self.expert_copies
        return self.dense_copies + experts // world + (self.head_split if world == 1 else 0)


def train_state_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> TrainState:
    from .model import DeepSeekV4
    from .model.layers import Linear
    from .train.optim import uses_muon

    model = DeepSeekV4(cfg, dtype=torch.float32, device="meta")
    w = opt = experts = 0
    for name, p in model.named_parameters():
        n = p.numel() * 4
        w += n
        opt += n * (1 if uses_muon(name, p) else 2)
        if ".experts.w" in name:
            experts += n * (1 + 1 + 1)
    blocks = [*model.layers, *model.mtp]
    dense_block = max(
        sum(p.numel() * 4 for n, p in b.named_parameters() if ".experts.w" not in f".{n}") for b in blocks
    )
    # which weights autocast casts: those a bf16 model holds in bf16 and runs through F.linear / einsum
    # (`Linear`; the compressors' fp32 projections, the router and the head go through linear_fp32)
    low = torch.finfo(dtype).bits // 8
    ref = DeepSeekV4(cfg, dtype=dtype, device="meta")
    dense = sum(m.weight.numel() for m in ref.modules() if isinstance(m, Linear) and m.weight.dtype == dtype)
    per_block = [
        sum(p.numel() for n, p in b.named_parameters() if ".experts.w" in f".{n}") for b in [*ref.layers, *ref.mtp]
    ]
    head = cfg.vocab_size * cfg.dim * 3 * 2  # [V, 3 dim] bf16
    return TrainState(
        w, w, opt, experts / (w + w + opt), dense_block, dense * low, sum(per_block) * low, max(per_block) * low, head
    )


@functools.lru_cache(maxsize=16)
def _muon_shapes(cfg: ModelConfig) -> dict[tuple[int, int], tuple[tuple[int, bool], ...]]:
    """{(rows, cols): ((matrices of one tensor, stacked routed experts?), ...)} of the Muon-stepped weights."""
    from .model import DeepSeekV4
    from .train.optim import uses_muon

    model = DeepSeekV4(cfg, dtype=torch.float32, device="meta")
    by_shape: dict[tuple[int, int], list[tuple[int, bool]]] = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2 and uses_muon(name, p):
            rows, cols = p.shape[-2:]
            by_shape.setdefault((rows, cols), []).append((p.numel() // (rows * cols), ".experts.w" in name))
    return {k: tuple(v) for k, v in by_shape.items()}


def muon_step_bytes(cfg: ModelConfig, cpu: bool, expert_shards: int = 1) -> int:
    """The largest Newton-Schulz working set of one optimizer step: `MuonPlan` iterates every matrix of one
    shape at once (whole tensors, up to `OptimConfig.ns_batch_elems` a batch), so the step's temporaries scale with a
    shape group, not with one matrix. Per batch of P elements and Q = (matrices x min(rows, cols)^2) Gram
    elements: the bf16 update, iterate and result (2 bytes each per element) and the Gram and inner products
    (bf16 on a GPU: 6P + 4Q bytes); a CPU multiplies fp32 copies (`ns_iteration`: + an fp32 iterate and
    product, fp32 Gram and inner: 14P + 8Q). It comes after the backward has freed the activations, so the
    step's peak holds the larger of the two (`train_step_estimate`). On one of `expert_shards`
    expert-parallel ranks each stacked routed-expert tensor holds 1/expert_shards of its experts (FSDP2's
    row shards of the other matrices are gathered whole for Newton-Schulz, `sharded_muon_step`)."""
    from .train.muon_batched import chunk_runs
    from .train.optim import OptimConfig

    worst = 0
    for (rows, cols), tensors in _muon_shapes(cfg).items():
        sizes = [n // expert_shards if expert else n for n, expert in tensors]
        side = min(rows, cols)
        for run in chunk_runs(sizes, rows, cols, OptimConfig().ns_batch_elems):
            n = sum(sizes[run.start : run.stop])
            P, Q = n * rows * cols, n * side * side
            worst = max(worst, 14 * P + 8 * Q if cpu else 6 * P + 4 * Q)
    return worst


def train_step_estimate(cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool) -> int:
    """The peak of one fp32 training step on a CPU as `measure_training` runs it: weights, gradients and
    optimizer state, plus the larger of the backward's activations and the optimizer step's Newton-Schulz
    working set."""
    st = train_state_bytes(cfg)
    acts = train_activation_bytes(cfg, batch, seq_len, checkpointing, 4)
    return st.weights + st.grads + st.optimizer + max(acts, muon_step_bytes(cfg, cpu=True))


# ------------------------------------------------------------------------------------------ GPU counts
def parse_size(text: str) -> int:
    """'141GB' / '80GiB' / '24G' / a number of bytes -> bytes (GB = 10^9, GiB = 2^30, G = 10^9)."""
    t = text.strip().upper().replace(" ", "")
    number, mult = t, 1
    for suffix, m in (("GIB", GIB), ("GB", GB), ("G", GB), ("MIB", 2**20), ("MB", 10**6), ("TB", 10**12), ("B", 1)):
        if t.endswith(suffix):
            number, mult = t[: -len(suffix)], m
            break
    value = float(number) * mult
    if not math.isfinite(value):  # ('inf', '1e400GB': no size)
        raise ValueError(f"not a finite size: {text!r}")
    return int(value)


def inference_gpus(need: int, gpu_bytes: int) -> int:
    """GPUs needed to hold `need` bytes by size alone (`serving_gpus`: how dsv4 splits a model over them)."""
    return max(1, math.ceil(need / (gpu_bytes * USABLE_FRACTION)))


def training_gpus(
    cfg: ModelConfig,
    state: TrainState,
    activations: int,
    gpu_bytes: int,
    max_world: int = 4096,
    checkpointing: bool = False,
) -> int | None:
    """The fewest ranks W (dividing the expert count) for which FSDP2 + expert parallelism fits each GPU:
    a 1/W share of the fp32 state, the bf16 weight copies (`TrainState.copies`), the larger of the
    activations and the optimizer step's Newton-Schulz working set on that rank (`muon_step_bytes`), and
    one gathered block beyond the own shard."""
    total = state.weights + state.grads + state.optimizer
    for world in range(1, max_world + 1):
        if cfg.n_routed_experts % world:
            continue
        peak = max(activations, muon_step_bytes(cfg, cpu=False, expert_shards=world))
        per_rank = total / world + state.copies(world, checkpointing) + peak + (state.largest_block if world > 1 else 0)
        if per_rank <= gpu_bytes * USABLE_FRACTION:
            return world
    return None


# ------------------------------------------------------------------------------------------ N workers
# Serving on N workers with the routed experts split over them (`dsv4.parallel`), per worker:
# - weights: everything but the routed experts whole (replicated), plus 1/N of the routed experts -
#   dequantized to the compute dtype, or kept as stored (FP8 / MXFP4 bytes and their block scales);
# - KV cache: what the worker's engine allocates - the whole batch with replicated attention (every worker
#   runs every sequence), ceil(batch / N) sequences with data-parallel attention;
# - activations of one step (a prefill chunk): the single-device peak, plus with data-parallel attention
#   the expert exchange (every worker's tokens gathered, the partial outputs and the rows sent back: fp32),
#   and in the ordered (bit-exact) combine each token's k slots as rows.


@functools.lru_cache(maxsize=16)
def expert_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(dequantized, kept quantized) bytes of all routed experts (every layer, MTP included): in the compute
    dtype, and as the release layout stores them (data + block scales; float experts in bf16)."""
    from .checkpoint.layouts import expected_tensors

    a = torch.finfo(dtype).bits // 8
    per_layer = 3 * cfg.n_routed_experts * cfg.moe_inter_dim * cfg.dim
    deq = (cfg.n_layers + cfg.n_mtp_layers) * per_layer * a
    inventory = expected_tensors(cfg, "release", mtp=cfg.n_mtp_layers > 0)
    kept = 0
    for name, (shape, dt) in inventory.items():
        if ".ffn.experts." not in name:
            continue
        quantized = dt in ("F8_E4M3", "I8") or name.endswith(".scale")
        kept += math.prod(shape) * (_ST_BYTES[dt] if quantized else a)  # float experts: loaded in dtype
    return deq, kept


@dataclass
class RankMemory:
    world_size: int
    attention: str
    weights: int  # this worker's weights (kept quantized or dequantized, as asked)
    experts: int  # of which its routed experts
    cache: int
    activations: int
    exchange: int  # of which the expert exchange's buffers
    splits: int = 0  # the fp32 projections' bf16 parts kept on a GPU (`WeightBytes.splits`; 0 for the CPU path)

    @property
    def total(self) -> int:
        return self.weights + self.splits + self.cache + self.activations

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def rank_bytes(
    cfg: ModelConfig,
    world: int,
    *,
    context: int,
    batch: int,
    chunk: int,
    dtype: torch.dtype = torch.bfloat16,
    keep_quantized: bool = True,
    attention: str = "replicated",
    fused: bool = True,
    ordered: bool = False,
    prefix_caching: bool = True,
) -> RankMemory:
    """One worker's memory serving `batch` sequences of `context` positions in prefill chunks of `chunk`
    tokens on `world` workers (experts split by expert: `world` must divide the expert count)."""
    if cfg.n_routed_experts % world:
        raise ValueError(f"{cfg.n_routed_experts} routed experts cannot be split evenly over {world} ranks")
    a = torch.finfo(dtype).bits // 8
    w = weight_bytes(cfg, dtype)
    deq, kept = expert_bytes(cfg, dtype)
    total, experts = (w.kept_quantized, kept) if keep_quantized else (w.dequantized, deq)
    share = experts // world
    seqs = batch if attention == "replicated" else -(-batch // world)
    cache = cache_bytes(cfg, context, seqs, a, max_batch_tokens=chunk, prefix_caching=prefix_caching).total
    T, k, D = chunk, cfg.n_activated_experts, cfg.dim
    if attention == "replicated":
        exchange = T * k * D * (a + 4 + 4) if ordered else 0  # slot rows, per-slot outputs, sorted copy
    else:
        # every worker's tokens gathered (x, fp32 weights, int64 ids; padded to the largest count), the
        # fp32 partial outputs of them all and the rows sent back (per slot in the ordered combine)
        out = 4 * D * (k if ordered else 1)
        exchange = world * T * (D * a + k * 12) + 2 * world * T * out
        if ordered:
            exchange += world * T * k * D * (a + 4)  # slot rows and the sorted copy
    act = activation_bytes(cfg, chunk, context, a, logits_rows=seqs, fused=fused) + exchange
    splits = w.splits if fused else 0
    return RankMemory(world, attention, total - experts + share, share, cache, act, exchange, splits)


def serving_gpus(
    cfg: ModelConfig,
    gpu_bytes: int,
    *,
    context: int,
    batch: int,
    chunk: int,
    dtype: torch.dtype = torch.bfloat16,
    keep_quantized: bool = True,
    attention: str = "replicated",
    max_world: int = 64,
) -> tuple[int, RankMemory] | None:
    """The fewest workers (dividing the expert count) whose per-worker memory fits one GPU of `gpu_bytes`
    (USABLE_FRACTION of it), and that memory; None when no count up to max_world fits."""
    for world in range(1, max_world + 1):
        if cfg.n_routed_experts % world:
            continue
        r = rank_bytes(
            cfg,
            world,
            context=context,
            batch=batch,
            chunk=chunk,
            dtype=dtype,
            keep_quantized=keep_quantized,
            attention=attention,
        )
        if r.total <= gpu_bytes * USABLE_FRACTION:
            return world, r
    return None


# ------------------------------------------------------------------------------------------ report
@dataclass
class Requirements:
    weights: WeightBytes
    cache: CacheBytes  # as `dsv4 serve` allocates it (prefix caching on)
    cache_no_prefix: CacheBytes  # with --no-prefix-caching (no fp32 raw tail per compressed page)
    activation_peak: int  # one prefill chunk, reference ops (a CPU)
    activation_peak_fused: int  # the same with the fused CUDA kernels
    inference_total: int  # on a GPU: weights dequantized + kept splits + cache + fused activation peak
    inference_total_quantized: int  # the same with keep_quantized weights
    inference_gpus: int  # GPUs that would hold inference_total (dsv4 serves on one)
    inference_gpus_quantized: int  # (both totals include `splits`)
    train: TrainState
    train_activations: int  # per rank, fused kernels, no checkpointing (sum of train_terms)
    train_activations_ckpt: int
    train_gpus: int | None  # fewest FSDP2 + expert-parallel ranks (None: does not fit at any count)
    train_gpus_ckpt: int | None
    settings: dict
    train_terms: dict | None = None  # train_activation_terms without / with checkpointing
    train_terms_ckpt: dict | None = None
    splits: int = 0  # the fp32 projections' bf16 parts a GPU engine keeps (`WeightBytes.splits`)

    def to_dict(self) -> dict:
        return asdict(self)


def requirements(
    cfg: ModelConfig,
    *,
    context: int = 8192,
    batch: int = 1,
    chunk: int = 4096,
    gpu_memory: int = 141 * GB,
    dtype: torch.dtype = torch.bfloat16,
    train_batch: int = 1,
    train_seq_len: int = 4096,
) -> Requirements:
    """Everything `dsv4 info` reports about memory, for serving `batch` sequences of `context` positions in
    prefill chunks of `chunk` tokens, and training `train_batch` x `train_seq_len` tokens per rank."""
    a = torch.finfo(dtype).bits // 8
    w = weight_bytes(cfg, dtype)
    cache = cache_bytes(cfg, context, batch, a, max_batch_tokens=chunk)
    cache_no_prefix = cache_bytes(cfg, context, batch, a, max_batch_tokens=chunk, prefix_caching=False)
    act = activation_bytes(cfg, chunk, context, a, logits_rows=batch)
    act_fused = activation_bytes(cfg, chunk, context, a, logits_rows=batch, fused=True)
    splits = w.splits
    inf = w.dequantized + splits + cache.total + act_fused
    inf_q = w.kept_quantized + splits + cache.total + act_fused
    st = train_state_bytes(cfg)
    terms = train_activation_terms(cfg, train_batch, train_seq_len, False, a)
    terms_ckpt = train_activation_terms(cfg, train_batch, train_seq_len, True, a)
    ta, tc = sum(terms.values()), sum(terms_ckpt.values())
    return Requirements(
        w,
        cache,
        cache_no_prefix,
        act,
        act_fused,
        inf,
        inf_q,
        inference_gpus(inf, gpu_memory),
        inference_gpus(inf_q, gpu_memory),
        st,
        ta,
        tc,
        training_gpus(cfg, st, ta, gpu_memory),
        training_gpus(cfg, st, tc, gpu_memory, checkpointing=True),
        {
            "context": context,
            "batch": batch,
            "chunk": chunk,
            "gpu_memory": gpu_memory,
            "dtype": str(dtype),
            "train_batch": train_batch,
            "train_seq_len": train_seq_len,
            "usable_fraction": USABLE_FRACTION,
        },
        terms,
        terms_ckpt,
        splits,
    )


# ------------------------------------------------------------------------------------------ measurement
def allocation_peak(fn) -> tuple[object, int]:
    """(fn(), the largest running sum of torch's CPU allocation events while it ran, in bytes)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # frees of earlier garbage inside the window would lower the running sum
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return result, peak


def _tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def measure_inference(model, context: int, batch: int, chunk: int, decode_steps: int = 2) -> dict:
    """Peak CPU allocations of serving `batch` prompts of `context - decode_steps` tokens in prefill chunks
    of `chunk` tokens, then `decode_steps` decode steps, through `Engine` (cache allocation included)."""
    from .engine import Engine, EngineConfig, SamplingParams

    cfg = model.cfg
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(context - decode_steps)]

    def run():
        engine = Engine(
            model,
            EngineConfig(
                max_seqs=batch,
                max_model_len=context,
                max_batch_tokens=chunk * batch,
                prefix_caching=False,
                cuda_graphs=False,
            ),
        )
        for i in range(batch):
            engine.add_request(
                str(i), prompt, SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True)
            )
        while engine.has_work():
            engine.step()
        return engine.cache.nbytes()

    weights = _tensor_bytes(model)
    cache, peak = allocation_peak(run)
    return {"weights": weights, "cache": cache, "activation_peak": peak - cache, "peak": weights + peak}


def measure_training(
    cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool = False, balance_alpha: float = 1e-4
) -> dict:
    """Peak CPU allocations of one training step (forward with MTP and indexer losses, backward, MuonAdamW
    step) of an fp32 model, as `dsv4 train` runs it on a CPU (balance_alpha: its default)."""
    from .model import DeepSeekV4
    from .train.losses import total_loss
    from .train.optim import MuonAdamW, OptimConfig

    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).train()
    model.set_options(activation_checkpointing=checkpointing)
    opt = MuonAdamW(model, OptimConfig())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        out = model(tokens, mtp=cfg.n_mtp_layers > 0 and not cfg.dspark, indexer_loss=True, balance_alpha=balance_alpha)
        total_loss(out, tokens).total.backward()
        opt.step()

    weights = _tensor_bytes(model)
    _, peak = allocation_peak(step)
    return {"weights": weights, "peak": weights + peak}
