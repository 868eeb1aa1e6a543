"""ModelConfig: one dataclass for every DeepSeek-V4 variant.

Field names follow the official inference code's `config.json` (`dim`, `n_layers`, ...), which `from_dict`
reads. The keys of other formats are translated where the format lives: the Hugging Face `config.json`
(`hidden_size`, `num_hidden_layers`, `layer_types`, `rope_scaling`, ...) by the hf layout
(`dsv4.checkpoint.read_config`). Unknown keys and inconsistent values are rejected with a message naming
the key.

A ModelConfig is frozen: every module of a model reads the one it was built with, so a change is a new
config (`replace`) applied before the model is built, never an edit of a built model's config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_schema import QUANT_MODES, SCALE_FMTS, SCHEMA, SCORE_FUNCS, ConfigError, check, check_types
from .errors import CheckpointError
from .safe_paths import read_text

LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_mtp_layers: int = 1
    n_hash_layers: int = 3
    # attention
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one entry per layer, then one per MTP layer (0 = window only, 4 = CSA, 128 = HCA)
    compress_ratios: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    # rope: window-only layers use rope_theta without YaRN; compressed layers compress_rope_theta + YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    # lightning indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # manifold-constrained hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # tokens and lengths
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_seq_len: int = 1048576
    # quantization-aware-training simulations (on in the released models)
    fp8_kv_sim: bool = True
    fp4_indexer_sim: bool = True
    # storage formats of a released checkpoint (dtype "fp8": FP8 linears, expert_dtype "fp4": MXFP4 experts)
    dtype: str = "bf16"
    expert_dtype: str | None = None
    # activation (and FP8 KV) scales: "ue8m0" = powers of two, None = amax/448 in fp32 (the official default
    # is "ue8m0"; a config says null to get fp32 scales)
    scale_fmt: str | None = "ue8m0"
    # numerics of the weights a checkpoint stores as FP8 / FP4: "w8a8" (official), "w8a16", or "int8" (those
    # weights requantized to per-row INT8 at load, INT8 activations per token: dsv4.model.int8)
    quant_mode: str = "w8a8"
    # the speculative draft under mtp.*: 0 = the first release's MTP block(s); > 0 = a DSpark draft of
    # n_mtp_layers window-only stages proposing this many tokens per step (Flash-0731: 5). The keys are the
    # official inference code's (`ModelArgs.dspark_*` of the 0731 release).
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0  # the token filling the block after its anchor
    dspark_target_layer_ids: tuple[int, ...] = ()  # main layers whose outputs the draft reads
    dspark_markov_rank: int = 256  # rank of the Markov head's token-transition bias
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        check_types(self)  # before anything reads a value: a string or NaN must not reach int() or math
        ratios = tuple(self.compress_ratios) or (0,) * (self.n_layers + self.n_mtp_layers)
        object.__setattr__(self, "compress_ratios", ratios)  # normalized once, at construction
        if isinstance(self.dspark_target_layer_ids, list):
            object.__setattr__(self, "dspark_target_layer_ids", tuple(self.dspark_target_layer_ids))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field against `SCHEMA` (type and range) and then `RELATIONS` (how fields depend on
        each other); the first violation raises ConfigError naming the key, the value and the rule."""
        check(self)

    # ------------------------------------------------------------------ derived
    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def dspark(self) -> bool:
        """Whether the MTP layers are a DSpark draft (else the first release's MTP blocks)."""
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    @property
    def act_format(self) -> str | None:
        """How activations feeding an FP8 / FP4-stored weight are quantized to FP8: None (quant_mode "w8a16",
        and "int8", whose modules quantize to INT8 themselves), else
        "ue8m0" (power-of-two scales) or "fp32" (amax/448 scales) from scale_fmt."""
        if self.quant_mode in ("w8a16", "int8"):  # int8: those weights are INT8 modules (dsv4.model.int8)
            return None
        return "ue8m0" if self.scale_fmt == "ue8m0" else "fp32"

    @property
    def kv_scale_pow2(self) -> bool:
        """The FP8 KV round trip's scales: powers of two for scale_fmt "ue8m0", amax/448 otherwise."""
        return self.scale_fmt == "ue8m0"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_draft(
        self, kind: str, *, stages: int = 3, block_size: int = 5, markov_rank: int | None = None
    ) -> ModelConfig:
        """This config with another speculative draft after the main layers: "none"; "mtp" (the first
        release's single MTP block); "dspark" (Flash-0731's DSpark draft: `stages` window-only stages over
        the last three main layers' outputs, a block of `block_size` tokens; the noise token is Flash-0731's
        128799 where the vocabulary has it, else the last token id; Markov rank 256, or dim / 4 for models
        narrower than 1024)."""
        main = tuple(self.compress_ratios[: self.n_layers])
        plain = dict(dspark_block_size=0, dspark_noise_token_id=0, dspark_target_layer_ids=())
        if kind == "none":
            return self.replace(n_mtp_layers=0, compress_ratios=main, **plain)
        if kind == "mtp":
            return self.replace(n_mtp_layers=1, compress_ratios=main + (0,), **plain)
        if kind != "dspark":
            raise ConfigError(f"draft must be 'none', 'mtp' or 'dspark', got {kind!r}")
        targets = tuple(range(max(0, self.n_layers - 3), self.n_layers))
        return self.replace(
            n_mtp_layers=stages,
            compress_ratios=main + (0,) * stages,
            dspark_block_size=block_size,
            dspark_noise_token_id=min(128799, self.vocab_size - 1),
            dspark_target_layer_ids=targets,
            dspark_markov_rank=markov_rank or (256 if self.dim >= 1024 else self.dim // 4),
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return d

    def dspark_json(self) -> dict[str, Any]:
        """The `dspark_*` keys of a config.json ({} for a model without a DSpark draft)."""
        if not self.dspark:
            return {}
        return {
            "dspark_block_size": self.dspark_block_size,
            "dspark_noise_token_id": self.dspark_noise_token_id,
            "dspark_target_layer_ids": list(self.dspark_target_layer_ids),
            "dspark_markov_rank": self.dspark_markov_rank,
        }

    def to_inference_json(self) -> dict[str, Any]:
        """The official inference `config.json` keys."""
        d = self.to_dict()
        for k in (
            "name",
            "bos_token_id",
            "eos_token_id",
            "fp8_kv_sim",
            "fp4_indexer_sim",
            "quant_mode",
            *(k for k in d if k.startswith("dspark_")),
        ):
            d.pop(k)
        return {**d, **self.dspark_json()}

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], name: str = "custom", overrides: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Read an official inference config dict (or ModelConfig's own fields). overrides: fields set on top
        of the file's values before validation (e.g. the QAT simulations switched off). The keys of other
        formats are read where the format lives: a Hugging Face config by `dsv4.checkpoint.read_config`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        if is_hf_config(raw):
            raise ConfigError(
                "a Hugging Face config (hidden_size, num_hidden_layers, ...): read it with "
                "dsv4.checkpoint.read_config, as every command's --config does"
            )
        return cls.from_fields(translating(_from_inference, raw), name, overrides)

    @classmethod
    def from_fields(
        cls, kw: dict[str, Any], name: str = "custom", overrides: dict[str, Any] | None = None
    ) -> ModelConfig:
        """ModelConfig's fields (as a format's reader translated them), overrides on top, validated."""
        kw = dict(kw)
        for k, v in (overrides or {}).items():
            if k not in _FIELDS:
                raise ConfigError(f"unknown config field '{k}'")
            kw[k] = v
        kw.setdefault("name", name)
        try:
            return cls(**kw)
        except TypeError as e:  # pragma: no cover - defensive: all keys were checked above
            raise ConfigError(str(e)) from None

    @classmethod
    def from_json(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """An official inference config.json (any format: `dsv4.checkpoint.read_config_file`)."""
        path = Path(path)
        return cls.from_dict(read_config_json(path), name=path.parent.name or "custom", overrides=overrides)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset '{name}'; choose one of {sorted(PRESETS)}")
        return PRESETS[name]()


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def is_hf_config(raw: Any) -> bool:
    """Whether a config dict is a Hugging Face one, by its keys (the hf layout translates those)."""
    return isinstance(raw, dict) and (
        "hidden_size" in raw or "num_hidden_layers" in raw or raw.get("model_type") == "deepseek_v4"
    )


def translating(read, raw: dict[str, Any]) -> dict[str, Any]:
    """`read(raw)` (a format's key translation -> ModelConfig fields), with a value of the wrong type or
    shape reported as a ConfigError (the schema names keys once translated)."""
    try:
        return read(raw)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"config has a value of the wrong type or shape ({type(e).__name__}: {str(e)[:120]})"
        ) from None


def read_config_json(path: Path) -> Any:
    """The parsed JSON of a config file, or a ConfigError that says why not."""
    try:
        text = read_text(path)  # a regular file of bounded size: never blocks on a FIFO or device
    except CheckpointError as e:
        msg = str(e)
        raise ConfigError(f"{path}: no such config file" if msg.endswith("file not found") else msg) from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError and over-long integers
        raise ConfigError(f"{path}: not valid JSON ({str(e)[:200]})") from None


# Official inference keys that do not change the math of this implementation.
_INFERENCE_IGNORED = {"max_batch_size"}


def _from_inference(raw: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _INFERENCE_IGNORED:
            continue
        if k == "scale_dtype":  # the official code: E8M0 scale storage forces power-of-two scales
            if v not in ("fp8", "fp32"):
                raise ConfigError(f"config key 'scale_dtype': must be 'fp8' or 'fp32', got {v!r}")
            continue
        if k not in _FIELDS:
            raise ConfigError(f"unknown config key '{k}' (official inference config)")
        kw[k] = v
    if "compress_ratios" in kw:
        n_layers = int_key(kw, "n_layers")
        list_key(kw["compress_ratios"], "compress_ratios")
        kw.setdefault("n_mtp_layers", max(0, len(kw["compress_ratios"]) - n_layers))
    if kw.get("dtype") not in (None, "bf16", "fp8"):
        raise ConfigError(f"config key 'dtype': must be 'bf16' or 'fp8', got {kw['dtype']!r}")
    if raw.get("scale_dtype") == "fp8":
        kw["scale_fmt"] = "ue8m0"
    return kw


def int_key(kw: dict[str, Any], field_name: str) -> int:
    """A field read during translation (before the schema runs): checked here so it cannot crash it."""
    v = kw.get(field_name, getattr(ModelConfig, field_name))
    problem = SCHEMA[field_name].problem(v)
    if problem:
        raise ConfigError(f"config key '{field_name}' = {v!r}: {problem}")
    return v


def list_key(v: Any, key: str) -> None:
    if not isinstance(v, (list, tuple)) or len(v) > 4096:
        raise ConfigError(f"config key '{key}': must be a list (of at most 4096 entries), got {type(v).__name__}")
    if any(isinstance(x, (list, dict)) for x in v):
        raise ConfigError(f"config key '{key}': entries must be plain values, not lists or objects")


def whole(v: Any) -> Any:
    """An integral float (32.0) as int; anything else unchanged, for the schema to judge."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v


def _tiny() -> ModelConfig:
    # Under 5M parameters, every feature: window-only, CSA (ratio 4 + indexer), HCA (ratio 128),
    # a hash-routed layer, an MTP block. Window stays 128 so tests cross the real window size.
    return ModelConfig(
        name="tiny",
        vocab_size=1024,
        dim=128,
        n_layers=4,
        n_mtp_layers=1,
        n_hash_layers=1,
        n_heads=4,
        head_dim=128,
        rope_head_dim=64,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        window_size=128,
        compress_ratios=(0, 4, 128, 4, 0),
        index_n_heads=4,
        index_head_dim=128,
        index_topk=8,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_inter_dim=64,
        route_scale=1.5,
        swiglu_limit=10.0,
        max_seq_len=4096,
    )


def _small() -> ModelConfig:
    return ModelConfig(
        name="small",
        vocab_size=32768,
        dim=1024,
        n_layers=8,
        n_mtp_layers=0,
        n_hash_layers=2,
        n_heads=16,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=256,
        window_size=128,
        compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4),
        index_n_heads=16,
        index_head_dim=128,
        index_topk=256,
        n_routed_experts=32,
        n_shared_experts=1,
        n_activated_experts=4,
        moe_inter_dim=512,
        route_scale=1.5,
        swiglu_limit=10.0,
        max_seq_len=65536,
    )


def _medium() -> ModelConfig:
    # One H200's training shape (between small and flash): 16 layers of flash's pattern (two window-only,
    # then CSA / HCA alternating), 64 routed experts with 6 active, V4's vocabulary, one MTP block; fp32
    # master weights, gradients and optimizer state plus checkpointed activations of 1 x 4096 tokens fit
    # one 141 GB GPU (`dsv4 info --preset medium`).
    return ModelConfig(
        name="medium",
        vocab_size=129280,
        dim=2048,
        n_layers=16,
        n_mtp_layers=1,
        n_hash_layers=2,
        n_heads=32,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=768,
        o_groups=4,
        o_lora_rank=512,
        window_size=128,
        compress_ratios=(0, 0) + (4, 128) * 7 + (0,),
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=64,
        n_shared_experts=1,
        n_activated_experts=6,
        moe_inter_dim=768,
        route_scale=1.5,
        swiglu_limit=10.0,
        max_seq_len=65536,
    )


def _flash() -> ModelConfig:
    return ModelConfig(
        name="flash",
        vocab_size=129280,
        dim=4096,
        n_layers=43,
        n_mtp_layers=1,
        n_hash_layers=3,
        n_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        window_size=128,
        compress_ratios=(0, 0) + (4, 128) * 20 + (4,) + (0,),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=6,
        moe_inter_dim=2048,
        route_scale=1.5,
        swiglu_limit=10.0,
        dtype="fp8",
        expert_dtype="fp4",
        scale_fmt="ue8m0",
    )


def _pro() -> ModelConfig:
    # Identical to the released DeepSeek-V4-Pro config.json.
    return ModelConfig(
        name="pro",
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_mtp_layers=1,
        n_hash_layers=3,
        n_heads=128,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        window_size=128,
        compress_ratios=(128, 128) + (4, 128) * 29 + (4,) + (0,),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=1024,
        n_routed_experts=384,
        n_shared_experts=1,
        n_activated_experts=6,
        moe_inter_dim=3072,
        route_scale=2.5,
        swiglu_limit=10.0,
        dtype="fp8",
        expert_dtype="fp4",
        scale_fmt="ue8m0",
    )


PRESETS = {"tiny": _tiny, "small": _small, "medium": _medium, "flash": _flash, "pro": _pro}

__all__ = ["ModelConfig", "ConfigError", "PRESETS", "QUANT_MODES", "SCALE_FMTS", "SCORE_FUNCS"]
