"""`dsv4 init`: a randomly initialized checkpoint of any config, in the release layout, written tensor by tensor.

What it is for: benchmarks, tests and runs of the real architectures (`flash`, `pro`, or any config with
`--override`) without the real weights - the role vLLM's dummy weights play. The directory is an ordinary
release checkpoint (sharded safetensors + index, config.json; FP8 E4M3 linears with E8M0 block scales
and MXFP4 experts when asked), written atomically and verified by reading it back like `dsv4 convert`'s
output, so `dsv4 inspect`, `load_pretrained` (per rank too) and every command taking `--model` accept it.

The values follow `DeepSeekV4.reset_parameters`'s distributions (linears N(0, 1/in), embedding N(0, 1),
norms 1, mHC mixing near identity, zero sinks, ape and router bias, a hash table of distinct experts per
token), each tensor drawn from its own generator seeded by (seed, tensor name): the same seed gives the
same bytes whatever the order or the shard size, but not the same numbers as `from_config(seed=...)`,
which draws the stacked model parameters from one generator. Weights stored quantized are drawn in their
storage format, without a quantization pass (which would dominate the run: about 2 s per 8M-value MXFP4
expert on a CPU core): FP8 linears and experts are N(0, 1/in) rounded to E4M3 under one power-of-two
scale per tensor that keeps 8 standard deviations in range; MXFP4 experts are uniformly random E2M1 codes
(rms 2.93) under one power-of-two scale per tensor, their rms within a factor sqrt(2) of 1/sqrt(in).

Memory: one tensor at a time (big ones drawn in row blocks straight into their storage dtype), so the
host holds about the largest tensor: Flash's embedding and head, 1.06 GB each in bf16 - never the model.

Drafts (`--draft`): "mtp" (the first release's MTP block, `n_mtp_layers` >= 1), "dspark" (Flash-0731's
DSpark draft, `ModelConfig.with_draft`: the release shards then hold it in `mtp.*`, the DSpark layout) or
"none". A draft is an entry of `DRAFTS` (a config change and the layout the checkpoint is written in).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import formats as fm
from ..config import ConfigError, ModelConfig
from ..errors import Unsupported, UserError
from .inventory import without_mtp
from .names import EXPERT, F32, INT, LINEAR, Spec, official_tensors
from .storage import Value
from .writer import save

BLOCK_ELEMENTS = 1 << 22  # a big tensor is drawn in row blocks of about this many fp32 values


@dataclass(frozen=True)
class Draft:
    """A draft `dsv4 init` can write: how it changes the config (the checkpoint holds `configure(cfg)`)
    and the `--to` targets of the layout it is written in."""

    name: str
    configure: Callable[[ModelConfig], ModelConfig]
    targets: tuple[str, ...] = ("bf16", "fp8")


def _with_mtp(cfg: ModelConfig) -> ModelConfig:
    if cfg.n_mtp_layers:
        return cfg
    return cfg.replace(n_mtp_layers=1, compress_ratios=(*cfg.compress_ratios[: cfg.n_layers], 0))


DRAFTS: dict[str, Draft] = {
    "mtp": Draft("mtp", _with_mtp),
    "none": Draft("none", without_mtp),
    "dspark": Draft("dspark", lambda cfg: cfg.with_draft("dspark")),
}
# drafts dsv4 recognizes in checkpoints but cannot write: asking for one is refused with this reason
NOT_WRITABLE: dict[str, str] = {}


def draft_names() -> tuple[str, ...]:
    return (*DRAFTS, *NOT_WRITABLE)


# ------------------------------------------------------------------------------------------ config
def parse_overrides(items: list[str]) -> dict:
    """`k=v` strings -> {ModelConfig field: value}; values read as JSON where they parse (4, 1.5, true,
    null, [4, 128, 0]), else as strings."""
    import json

    fields = set(ModelConfig.__dataclass_fields__)
    out: dict = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UserError(f"--override {item!r}: expected KEY=VALUE (a config field, e.g. n_layers=4)")
        if key not in fields or key == "name":
            raise UserError(f"--override {key}: not a config field (one of {', '.join(sorted(fields - {'name'}))})")
        if key in out:
            raise UserError(f"--override {key}: given twice ({key}={out[key]!r} and {item!r}): keep one")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def apply_overrides(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    """cfg with the overrides applied. Changing n_layers (or n_mtp_layers) without compress_ratios keeps the
    first n_layers main-layer ratios (and window-only MTP layers); n_hash_layers is capped at n_layers
    unless given."""
    kw = dict(overrides)
    n = kw.get("n_layers", cfg.n_layers)
    m = kw.get("n_mtp_layers", cfg.n_mtp_layers)
    if (
        "compress_ratios" not in kw
        and ("n_layers" in kw or "n_mtp_layers" in kw)
        and isinstance(n, int)
        and isinstance(m, int)
    ):
        main = cfg.compress_ratios[: cfg.n_layers]
        if n > len(main):
            raise UserError(
                f"--override n_layers={n}: the config has {len(main)} layers; give compress_ratios "
                f"for {n} layers and {m} MTP layers too"
            )
        kw["compress_ratios"] = (*main[:n], *(0,) * m)
    if "n_hash_layers" not in kw and isinstance(n, int):
        kw["n_hash_layers"] = min(cfg.n_hash_layers, n)
    try:
        return cfg.replace(**kw)
    except ConfigError as e:
        raise UserError(str(e)) from None


def init_config(cfg: ModelConfig, draft: str | None = None) -> ModelConfig:
    """The config the checkpoint holds: cfg with its draft as asked (None: as the config has it)."""
    if draft is None:
        return cfg
    if draft in NOT_WRITABLE:
        raise Unsupported(f"--draft {draft}: {NOT_WRITABLE[draft]}")
    if draft not in DRAFTS:
        raise UserError(f"--draft {draft}: one of {', '.join(draft_names())}")
    return DRAFTS[draft].configure(cfg)


# ------------------------------------------------------------------------------------------ values
def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std^2) in `dtype`, drawn in row blocks (never a float32 copy of a big tensor)."""
    out = torch.empty(shape, dtype=dtype)
    rows = out.view(shape[0], -1) if len(shape) > 1 else out.view(-1, 1)
    step = max(1, BLOCK_ELEMENTS // max(1, rows.size(1)))
    for i in range(0, rows.size(0), step):
        block = rows[i : i + step]
        block.copy_(torch.randn(block.shape, generator=gen).mul_(std))
    return out


def _hash_table(vocab: int, n_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[vocab, k] int32: k distinct experts per token (the top k of uniform draws), in row blocks."""
    out = torch.empty(vocab, k, dtype=torch.int32)
    step = max(1, BLOCK_ELEMENTS // n_experts)
    for i in range(0, vocab, step):
        j = min(vocab, i + step)
        out[i:j] = torch.rand(j - i, n_experts, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    return out


E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of uniformly random codes


def _pow2_byte(value: float) -> int:
    """The E8M0 byte of the power of two nearest `value` (in log scale)."""
    return 127 + round(math.log2(value))


def _fp8_value(shape: tuple[int, int], std: float, gen: torch.Generator) -> Value:
    """N(0, std^2) rounded to E4M3 under one power-of-two scale that holds 8 std (128x128 E8M0 scales)."""
    b = 127 + math.ceil(math.log2(8 * std / fm.FP8_MAX))
    inv = 2.0 ** (127 - b)
    out = torch.empty(shape, dtype=torch.uint8)
    step = max(1, BLOCK_ELEMENTS // shape[1])
    for i in range(0, shape[0], step):
        block = out[i : i + step]
        x = torch.randn(block.shape, generator=gen).mul_(std * inv).clamp_(-fm.FP8_MAX, fm.FP8_MAX)
        block.copy_(fm.e4m3_encode(x) if not fm.HAS_FP8 else x.to(torch.float8_e4m3fn).view(torch.uint8))
    scale = torch.full(fm.fp8_scale_shape(*shape), b, dtype=torch.uint8)
    return Value("fp8", fm.fp8_from_bytes(out), fm.e8m0_from_bytes(scale))


def _fp4_value(shape: tuple[int, int], std: float, gen: torch.Generator) -> Value:
    """Uniformly random E2M1 codes (two per byte) under one power-of-two scale: rms near std."""
    packed = torch.randint(0, 256, (shape[0], shape[1] // 2), dtype=torch.uint8, generator=gen)
    scale = torch.full((shape[0], shape[1] // fm.FP4_BLOCK), _pow2_byte(std / E2M1_RMS), dtype=torch.uint8)
    return Value("fp4", fm.packed_from_bytes(packed), fm.e8m0_from_bytes(scale))


def random_value(
    name: str, spec: Spec, cfg: ModelConfig, seed: int, to: str = "bf16", expert_dtype: str | None = None
) -> Value:
    """One official tensor's random initial value: float tensors in bf16 (fp32 for the F32 role); with
    to="fp8" the linears (and experts) as FP8, with expert_dtype="fp4" the experts as MXFP4."""
    from ..model.transformer import init_hc_base

    gen = _generator(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    dtype = torch.float32 if spec.role == F32 else torch.bfloat16
    if spec.role == EXPERT and expert_dtype == "fp4":
        return _fp4_value(spec.shape, spec.shape[-1] ** -0.5, gen)
    if spec.role in (LINEAR, EXPERT) and to == "fp8":
        return _fp8_value(spec.shape, spec.shape[-1] ** -0.5, gen)
    if spec.role == INT:
        return Value("int", _hash_table(spec.shape[0], cfg.n_routed_experts, spec.shape[1], gen))
    if name.endswith("norm.weight") or ("hc_" in leaf and leaf.endswith("_scale")):
        t = torch.ones(spec.shape, dtype=dtype)
    elif leaf in ("attn_sink", "ape", "bias"):
        t = torch.zeros(spec.shape, dtype=dtype)
    elif "hc_" in leaf and leaf.endswith("_base"):
        t = torch.empty(spec.shape, dtype=dtype)
        init_hc_base(t, cfg.hc_mult)
    elif "hc_" in leaf and leaf.endswith("_fn"):
        t = _normal(spec.shape, 0.02 / math.sqrt(spec.shape[1]), gen, dtype)
    elif name == "embed.weight":
        t = _normal(spec.shape, 1.0, gen, dtype)
    elif len(spec.shape) >= 2:
        t = _normal(spec.shape, spec.shape[-1] ** -0.5, gen, dtype)
    else:
        t = torch.zeros(spec.shape, dtype=dtype)
    return Value("float", t)


def random_values(
    cfg: ModelConfig, seed: int = 0, to: str = "bf16", expert_dtype: str | None = None
) -> Iterator[tuple[str, Value]]:
    """Every official tensor of cfg with a random value, one at a time (drawn when asked for)."""
    for name, spec in official_tensors(cfg).items():
        yield name, random_value(name, spec, cfg, seed, to, expert_dtype)


# ------------------------------------------------------------------------------------------ write
def init_checkpoint(
    dst: str | Path,
    cfg: ModelConfig,
    *,
    to: str | None = None,
    expert_dtype: str | None = None,
    seed: int = 0,
    draft: str | None = None,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write a random checkpoint of cfg to `dst` (which must not exist) in the release layout.

    to: "bf16" or "fp8" (FP8 linears; default: the config's dtype); expert_dtype: "fp4" for MXFP4 experts
    (default: the config's); draft: see `DRAFTS` (None: as the config has it). Atomic and verified
    (`dsv4.checkpoint.writer.save`). Returns dst."""
    cfg = init_config(cfg, draft)
    to = to or ("fp8" if cfg.dtype == "fp8" else "bf16")
    targets = DRAFTS[draft].targets if draft in DRAFTS else ("bf16", "fp8")
    if to not in targets:
        raise UserError(f"--to {to}: dsv4 init writes the release layout, --to one of {', '.join(targets)}")
    if expert_dtype not in (None, "fp4"):
        raise UserError(f"--expert-dtype {expert_dtype}: only fp4 (MXFP4 experts) can be asked for")
    expert_dtype = expert_dtype or cfg.expert_dtype
    if expert_dtype == "fp4" and cfg.dim % 32 + cfg.moe_inter_dim % 32:
        raise UserError(
            f"--expert-dtype fp4: MXFP4 needs dim and moe_inter_dim to be multiples of 32, got "
            f"{cfg.dim} and {cfg.moe_inter_dim}"
        )
    return save(
        random_values(cfg, seed, to, expert_dtype),
        cfg,
        dst,
        target=to,
        expert_dtype=expert_dtype,
        shard_bytes=shard_bytes,
    )


__all__ = [
    "DRAFTS",
    "Draft",
    "apply_overrides",
    "draft_names",
    "init_checkpoint",
    "init_config",
    "parse_overrides",
    "random_value",
    "random_values",
]
