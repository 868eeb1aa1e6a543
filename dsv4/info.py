"""Model facts computed from a config alone (no weights are allocated): parameters, active parameters
per token, KV-cache bytes, per-token FLOPs, and what serving and training take in memory (`dsv4.memory`);
with `--measure`, the peak this CPU measures beside the estimate."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from . import argtypes
from .config import ModelConfig


@dataclass
class ModelInfo:
    name: str
    total_params: int  # backbone: embedding, layers, final norm/HC head, LM head
    mtp_params: int  # the MTP block(s), on top of the backbone
    active_params: int  # per token: backbone minus the routed experts a token does not use
    routed_expert_params: int
    embedding_params: int
    kv_bytes_per_token: float  # compressed entries + indexer keys, amortized per token (bf16)
    kv_fixed_bytes: int  # window ring buffers (independent of the context length)
    kv_bytes_1m: float  # at a 1,048,576-token context (bf16)
    kv_bytes_per_token_fp8: float  # FP8 storage: 448 e4m3 + 64 bf16 rope dims + E8M0 scales; FP4 indexer keys
    kv_bytes_1m_fp8: float
    flops_per_token: float  # forward matmul FLOPs per token (2 x active matmul params), no attention
    layers: int
    layer_kinds: dict

    def to_dict(self) -> dict:
        return asdict(self)


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by part, from a model built on the meta device (nothing allocated)."""
    from .model import DeepSeekV4

    model = DeepSeekV4(cfg, dtype=torch.bfloat16, device="meta")
    counts = {"backbone": 0, "mtp": 0, "routed": 0, "embedding": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("mtp."):
            counts["mtp"] += n
            continue
        counts["backbone"] += n
        if ".experts.w" in name:
            counts["routed"] += n
        if name in ("embed.weight", "head.weight"):
            counts["embedding"] += n
    return counts


def model_info(cfg: ModelConfig) -> ModelInfo:
    counts = count_parameters(cfg)
    per_expert = 3 * cfg.moe_inter_dim * cfg.dim
    inactive = cfg.n_layers * (cfg.n_routed_experts - cfg.n_activated_experts) * per_expert
    active = counts["backbone"] - inactive
    kinds = {"window_only": 0, "csa": 0, "hca": 0}
    per_token = per_token_fp8 = 0.0
    d, r = cfg.head_dim, cfg.rope_head_dim
    entry_fp8 = (d - r) + 2 * r + (d - r) // 64  # e4m3 nope + bf16 rope + one E8M0 byte per 64
    index_fp4 = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    for ratio in cfg.compress_ratios[: cfg.n_layers]:
        if ratio == 0:
            kinds["window_only"] += 1
            continue
        kinds["csa" if ratio == 4 else "hca"] += 1
        per_token += 2 * d / ratio
        per_token_fp8 += entry_fp8 / ratio
        if ratio == 4:
            per_token += 2 * cfg.index_head_dim / ratio
            per_token_fp8 += index_fp4 / ratio
    fixed = cfg.n_layers * cfg.window_size * d * 2
    fixed_fp8 = cfg.n_layers * cfg.window_size * entry_fp8
    one_m = 1 << 20
    return ModelInfo(
        name=cfg.name,
        total_params=counts["backbone"],
        mtp_params=counts["mtp"],
        active_params=active,
        routed_expert_params=counts["routed"],
        embedding_params=counts["embedding"],
        kv_bytes_per_token=per_token,
        kv_fixed_bytes=fixed,
        kv_bytes_1m=fixed + per_token * one_m,
        kv_bytes_per_token_fp8=per_token_fp8,
        kv_bytes_1m_fp8=fixed_fp8 + per_token_fp8 * one_m,
        flops_per_token=2.0 * (active - counts["embedding"] // 2),
        layers=cfg.n_layers,
        layer_kinds=kinds,
    )


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


# ------------------------------------------------------------------------------------------ memory
def add_memory_args(p) -> None:
    """`dsv4 info` flags for what serving and training take (estimates from `dsv4.memory`)."""
    g = p.add_argument_group("memory")
    count = argtypes.positive_int
    g.add_argument("--context", type=count, default=8192, help="positions per sequence for the KV cache (default 8192)")
    g.add_argument("--batch", type=count, default=1, help="sequences served at once (default 1)")
    g.add_argument(
        "--chunk",
        type=count,
        default=4096,
        help="prefill chunk: tokens per engine step (default 4096, serve's default on a GPU)",
    )
    g.add_argument(
        "--gpu-memory",
        default="141GB",
        help="memory of one GPU, with its unit: 141GB, 80GB, 139.8GiB ... (GB = 10^9 bytes; default 141GB: an H200)",
    )
    g.add_argument("--train-seq-len", type=count, default=4096, help="training tokens per sequence (default 4096)")
    g.add_argument("--train-batch", type=count, default=1, help="training sequences per rank (default 1)")
    g.add_argument(
        "--measure",
        action="store_true",
        help="also measure on this CPU (fp32, reference ops): one served sequence set and one training "
        "step at these settings, peak of torch's allocations beside the estimate (small models)",
    )


def memory_requirements(cfg: ModelConfig, args):
    from .errors import UserError
    from .memory import parse_size, requirements

    for flag in ("context", "batch", "chunk", "train_seq_len", "train_batch"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        gpu = parse_size(args.gpu_memory)
    except ValueError:
        raise UserError(f"--gpu-memory: not a size: '{args.gpu_memory}' (e.g. 141GB, 80GB, 139.8GiB)") from None
    if gpu <= 0:
        raise UserError("--gpu-memory must be positive")
    if gpu < 2**20:  # a bare number is bytes: '80' meant 80GB
        raise UserError(f"--gpu-memory {args.gpu_memory}: {gpu} bytes is no GPU's memory; give a unit (80GB, 139.8GiB)")
    return requirements(
        cfg,
        context=args.context,
        batch=args.batch,
        chunk=args.chunk,
        gpu_memory=gpu,
        train_batch=args.train_batch,
        train_seq_len=args.train_seq_len,
    )


PARALLEL_WORLDS = (2, 4, 8)  # the worker counts `dsv4 info` lists (those dividing the expert count)


def parallel_serving(cfg: ModelConfig, req) -> dict:
    """Serving on N GPUs with the routed experts split over them (`dsv4.parallel`): the fewest GPUs of the
    given size, kept quantized and dequantized, and each listed N's memory per GPU (`rank_bytes`)."""
    from .memory import rank_bytes, serving_gpus

    s = req.settings
    kw = {"context": s["context"], "batch": s["batch"], "chunk": s["chunk"]}
    out: dict = {"flags": "--tensor-parallel-size N --enable-expert-parallel", "fewest": {}, "per_gpu": {}}
    for kept in (True, False):
        found = serving_gpus(cfg, s["gpu_memory"], keep_quantized=kept, **kw)
        out["fewest"]["kept_quantized" if kept else "dequantized"] = (
            None if found is None else {"gpus": found[0], **found[1].to_dict()}
        )
    for n in PARALLEL_WORLDS:
        if cfg.n_routed_experts % n == 0:
            out["per_gpu"][n] = {
                "kept_quantized": rank_bytes(cfg, n, keep_quantized=True, **kw).total,
                "dequantized": rank_bytes(cfg, n, keep_quantized=False, **kw).total,
            }
    return out


def format_parallel(par: dict, gpu_memory: int) -> list[str]:
    gpu = f"{gpu_memory / 1e9:g} GB"

    def fewest(key: str, what: str) -> str:
        f = par["fewest"][key]
        if f is None:
            return f"{what}: does not fit"
        return (
            f"{what} {_gpus(f['gpus'])} ({_gb(f['total'])} per GPU: {_gb(f['weights'] - f['experts'])} "
            f"replicated weights + {_gb(f['experts'])} of routed experts, {_gb(f['splits'])} of kept bf16 "
            f"parts of the fp32 projections and mix weights, {_gb(f['cache'])} KV cache, "
            f"{_gb(f['activations'])} activations)"
        )

    lines = [
        f"    serving on N GPUs ({par['flags']}: the routed experts split over the N workers, everything else "
        f"and the KV cache on each): {fewest('kept_quantized', 'kept quantized')}, "
        f"{fewest('dequantized', 'dequantized')} of {gpu}"
    ]
    if par["per_gpu"]:
        ns = " / ".join(str(n) for n in par["per_gpu"])
        kept = " / ".join(_gb(v["kept_quantized"]).removesuffix(" GB") for v in par["per_gpu"].values())
        deq = " / ".join(_gb(v["dequantized"]).removesuffix(" GB") for v in par["per_gpu"].values())
        lines.append(f"    per GPU with N = {ns}: {kept} GB kept quantized, {deq} GB dequantized")
    return lines


def _gb(n: float) -> str:
    """Decimal units, as GPU memory is sold (141 GB)."""
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def format_memory(req) -> list[str]:
    s, w, c = req.settings, req.weights, req.cache
    gpu = f"{s['gpu_memory'] / 1e9:g} GB"
    fmt = ", ".join(f"{k} {_gb(v)}" for k, v in sorted(w.by_format.items(), key=lambda kv: -kv[1]))
    lines = [
        f"  memory (bf16; {s['batch']} x {s['context']} positions, prefill chunks of {s['chunk']} tokens; GPUs of "
        f"{gpu}, {s['usable_fraction']:.0%} usable):",
        f"    weights: {_gb(w.dequantized)} dequantized to bf16, {_gb(w.kept_quantized)} kept quantized "
        f"(--keep-quantized); on disk {_gb(w.stored)} in the release layout ({fmt})",
        f"    KV cache: {c.per_token:.0f} B per position ({req.cache_no_prefix.per_token:.0f} B with "
        f"--no-prefix-caching: no raw page tails) + {_gb(c.per_sequence_fixed)} per sequence (window pages, "
        f"compressor rows); {_gb(c.total)} for {s['batch']} x {s['context']}",
        f"    activations of one {s['chunk']}-token prefill chunk: {_gb(req.activation_peak_fused)} with the fused "
        f"CUDA kernels, {_gb(req.activation_peak)} with the reference ops (CPU)",
        f"    inference on a GPU: {_gb(req.inference_total)} dequantized, {_gb(req.inference_total_quantized)} kept "
        f"quantized (each with {_gb(req.splits)} of bf16 parts of the fp32 projections and mix weights, kept once "
        "split): "
        f"{_gpus(req.inference_gpus)} / {_gpus(req.inference_gpus_quantized)} of {gpu} by size alone "
        "(one device holds it all when 1; otherwise split as below)",
        f"    training (fp32 master weights and gradients, Muon momentum + AdamW moments): {_gb(req.train.weights)} + "
        f"{_gb(req.train.grads)} + {_gb(req.train.optimizer)}; bf16 weight copies under autocast "
        f"{_gb(req.train.dense_copies)} on every rank + {_gb(req.train.expert_copies)} of routed experts split "
        f"over the ranks (one process: all kept for the step, plus on a GPU the fp32 head's "
        f"{_gb(req.train.head_split)} bf16x3 split, which --head-precision bf16 does not keep)",
        f"    training activations per rank for {s['train_batch']} x {s['train_seq_len']} tokens at the peak (early "
        f"in backward): {_gb(req.train_activations)} ({_terms(req.train_terms)}), "
        f"{_gb(req.train_activations_ckpt)} with --activation-checkpointing ({_terms(req.train_terms_ckpt)})",
        f"    training GPUs of {gpu} (FSDP2 + expert parallelism): {_train_gpus(req.train_gpus)} without "
        f"checkpointing, {_train_gpus(req.train_gpus_ckpt)} with it",
    ]
    return lines


def _terms(terms: dict) -> str:
    """train_activation_terms by name: blocks' saved tensors, the heads' saved tensors, the logits gradient."""
    names = {"blocks": "blocks saved", "heads": "heads saved", "logits_grad": "logits gradient split"}
    return ", ".join(f"{names.get(k, k)} {_gb(v)}" for k, v in terms.items())


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def _train_gpus(n: int | None) -> str:
    return "does not fit at any rank count" if n is None else _gpus(n)


def measure_memory(cfg: ModelConfig, args, model_dir=None) -> list[dict]:
    """`--measure`: this CPU's measured peak beside the estimate at the same settings (fp32, reference ops)."""
    import torch

    from . import memory as mem
    from .errors import UserError

    est_weights = mem.weight_bytes(cfg, torch.float32).dequantized
    if est_weights > 4e9:
        raise UserError(
            f"--measure runs the model on this CPU: {cfg.name} has {_gb(est_weights)} of fp32 weights; "
            "measure tiny, small or a small checkpoint"
        )
    if model_dir is not None:
        from .checkpoint import load_pretrained

        model = load_pretrained(model_dir, dtype=torch.float32)
    else:
        from .model import DeepSeekV4

        model = DeepSeekV4.from_config(cfg, dtype=torch.float32).eval()
    ctx, b, chunk = args.context, args.batch, args.chunk
    inf = mem.measure_inference(model, ctx, b, chunk)
    est = (
        est_weights
        + mem.cache_bytes(cfg, ctx, b, 4, max_batch_tokens=chunk * b, prefix_caching=False).total
        + mem.activation_bytes(cfg, chunk * b, ctx, 4, logits_rows=b)
    )
    rows = [
        {
            "what": f"serving {b} x {ctx} (prefill chunks of {chunk}, 2 decode steps)",
            "measured": inf["peak"],
            "estimated": est,
        }
    ]
    for ckpt in (False, True):
        # the balance loss on (dsv4 train's default) both ways: checkpointing recomputes one block at a time
        m = mem.measure_training(cfg, args.train_batch, args.train_seq_len, ckpt, 1e-4)
        e = mem.train_step_estimate(cfg, args.train_batch, args.train_seq_len, ckpt)
        what = "with checkpointing" if ckpt else "without checkpointing"
        rows.append(
            {
                "what": f"one training step {args.train_batch} x {args.train_seq_len} {what}",
                "measured": m["peak"],
                "estimated": e,
            }
        )
    return rows


def format_measured(rows: list[dict]) -> list[str]:
    return ["  measured on this CPU (fp32, reference ops; peak of torch's allocations):"] + [
        f"    {r['what']}: {_gb(r['measured'])} measured, {_gb(r['estimated'])} estimated "
        f"({r['estimated'] / r['measured'] - 1:+.0%})"
        for r in rows
    ]
