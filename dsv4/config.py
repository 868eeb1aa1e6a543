"""ModelConfig: one dataclass for every DeepSeek-V4 variant.

Field names follow the official inference code's `config.json` (`dim`, `n_layers`, ...). `from_dict`
also reads the Hugging Face `config.json` keys (`hidden_size`, `num_hidden_layers`, `layer_types`,
`rope_scaling`, ...). Unknown keys and inconsistent values are rejected with a message naming the key.

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
    # numerics of the weights a checkpoint stores as FP8 / FP4: "w8a8" (official) or "w8a16"
    quant_mode: str = "w8a8"
    # the speculative draft under mtp.*: 0 = the first release's MTP block(s); > 0 = a DSpark draft of
    # n_mtp_layers window-only stages proposing this many tokens per step (Flash-0731: 5). The keys are the
    # official inference code's (`ModelArgs.dspark_*` of the 0731 release).
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0                  # the token filling the block after its anchor
    dspark_target_layer_ids: tuple[int, ...] = ()   # main layers whose outputs the draft reads
    dspark_markov_rank: int = 256                   # rank of the Markov head's token-transition bias
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        check_types(self)  # before anything reads a value: a string or NaN must not reach int() or math
        ratios = tuple(self.compress_ratios) or (0,) * (self.n_layers + self.n_mtp_layers)
        object.__setattr__(self, "compress_ratios", ratios)   # normalized once, at construction
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
        """How activations feeding an FP8 / FP4-stored weight are quantized: None (quant_mode "w8a16"), else
        "ue8m0" (power-of-two scales) or "fp32" (amax/448 scales) from scale_fmt."""
        if self.quant_mode == "w8a16":
            return None
        return "ue8m0" if self.scale_fmt == "ue8m0" else "fp32"

    @property
    def kv_scale_pow2(self) -> bool:
        """The FP8 KV round trip's scales: powers of two for scale_fmt "ue8m0", amax/448 otherwise."""
        return self.scale_fmt == "ue8m0"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_draft(self, kind: str, *, stages: int = 3, block_size: int = 5,
                   markov_rank: int | None = None) -> ModelConfig:
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
        return self.replace(n_mtp_layers=stages, compress_ratios=main + (0,) * stages, dspark_block_size=block_size,
                            dspark_noise_token_id=min(128799, self.vocab_size - 1), dspark_target_layer_ids=targets,
                            dspark_markov_rank=markov_rank or (256 if self.dim >= 1024 else self.dim // 4))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return d

    def dspark_json(self) -> dict[str, Any]:
        """The `dspark_*` keys of a config.json ({} for a model without a DSpark draft)."""
        if not self.dspark:
            return {}
        return {"dspark_block_size": self.dspark_block_size, "dspark_noise_token_id": self.dspark_noise_token_id,
                "dspark_target_layer_ids": list(self.dspark_target_layer_ids),
                "dspark_markov_rank": self.dspark_markov_rank}

    def to_inference_json(self) -> dict[str, Any]:
        """The official inference `config.json` keys."""
        d = self.to_dict()
        for k in ("name", "bos_token_id", "eos_token_id", "fp8_kv_sim", "fp4_indexer_sim", "quant_mode",
                  *(k for k in d if k.startswith("dspark_"))):
            d.pop(k)
        return {**d, **self.dspark_json()}

    def to_hf_json(self) -> dict[str, Any]:
        """Hugging Face `config.json` keys (as `DeepseekV4Config` reads them)."""
        heavy = sorted({r for r in self.compress_ratios[: self.n_layers] if r not in (0, 4)})
        if len(heavy) > 1:
            raise ConfigError(f"config key 'compress_ratios': a Hugging Face config has one heavy compression "
                              f"rate, this one has {heavy}")
        rate = heavy[0] if heavy else 128
        ratio_to_type = {0: "sliding_attention", 4: "compressed_sparse_attention", rate: "heavily_compressed_attention"}
        quant: dict[str, Any] = {}
        if rate != 128:
            quant["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": rate}
        if self.dtype == "fp8":
            quant["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                            "scale_fmt": self.scale_fmt, "weight_block_size": [128, 128]}
        if self.expert_dtype:
            quant["expert_dtype"] = self.expert_dtype
        return {**quant,
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim, "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size,
            "layer_types": [ratio_to_type[r] for r in self.compress_ratios[: self.n_layers]],
            "mlp_layer_types": ["hash_moe" if i < self.n_hash_layers else "moe" for i in range(self.n_layers)],
            "compress_rope_theta": self.compress_rope_theta, "rope_theta": self.rope_theta,
            "rope_scaling": {"type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                             "beta_slow": self.beta_slow,
                             "original_max_position_embeddings": self.original_seq_len},
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.n_activated_experts,
            "moe_intermediate_size": self.moe_inter_dim, "scoring_func": self.score_func,
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit,
            "norm_topk_prob": True, "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps, "rms_norm_eps": self.norm_eps,
            "num_nextn_predict_layers": self.n_mtp_layers, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": False, "hidden_act": "silu", **self.dspark_json(),
        }

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "custom",
                  overrides: dict[str, Any] | None = None) -> ModelConfig:
        """Read an official inference or Hugging Face config dict (auto-detected by its keys). overrides:
        fields set on top of the file's values before validation (e.g. the QAT simulations switched off)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        is_hf = "hidden_size" in raw or "num_hidden_layers" in raw or raw.get("model_type") == "deepseek_v4"
        try:
            kw = _from_hf(raw) if is_hf else _from_inference(raw)
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            if isinstance(e, ConfigError):
                raise
            # a value of the wrong type met a translation step (the schema names keys once translated)
            raise ConfigError(f"config has a value of the wrong type or shape ({type(e).__name__}: "
                              f"{str(e)[:120]})") from None
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
        path = Path(path)
        try:
            text = read_text(path)  # a regular file of bounded size: never blocks on a FIFO or device
        except CheckpointError as e:
            msg = str(e)
            raise ConfigError(f"{path}: no such config file" if msg.endswith("file not found") else msg) from None
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError and over-long integers
            raise ConfigError(f"{path}: not valid JSON ({str(e)[:200]})") from None
        return cls.from_dict(raw, name=path.parent.name or "custom", overrides=overrides)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset '{name}'; choose one of {sorted(PRESETS)}")
        return PRESETS[name]()


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}

# Official inference keys that do not change the math of this implementation.
_INFERENCE_IGNORED = {"max_batch_size"}

# Hugging Face key -> ModelConfig field
_HF_RENAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps", "sliding_window": "window_size", "num_hash_layers": "n_hash_layers",
    "num_nextn_predict_layers": "n_mtp_layers", "max_position_embeddings": "max_seq_len",
    "vocab_size": "vocab_size", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "head_dim": "head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "swiglu_limit": "swiglu_limit",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "expert_dtype": "expert_dtype",
    "dspark_block_size": "dspark_block_size", "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids", "dspark_markov_rank": "dspark_markov_rank",
}
# Hugging Face keys accepted without effect on the math, with the value they must have (None = any).
_HF_FIXED: dict[str, Any] = {
    "architectures": None, "model_type": None, "transformers_version": None, "torch_dtype": None,
    "dtype": None, "initializer_range": None, "use_cache": None, "attention_dropout": None,
    "topk_method": None, "output_router_logits": None, "router_aux_loss_coef": None, "pad_token_id": None,
    "router_jitter_noise": None, "_name_or_path": None,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "num_key_value_heads": 1,
    "norm_topk_prob": True, "tie_word_embeddings": False,
}
# transformers' rotary fraction when a config gives none: qk_rope_head_dim 64 of a 512-dim head
_HF_DEFAULT_ROTARY_FRACTION = 64 / 512


def _from_inference(raw: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _INFERENCE_IGNORED:
            continue
        if k == "scale_dtype":                 # the official code: E8M0 scale storage forces power-of-two scales
            if v not in ("fp8", "fp32"):
                raise ConfigError(f"config key 'scale_dtype': must be 'fp8' or 'fp32', got {v!r}")
            continue
        if k not in _FIELDS:
            raise ConfigError(f"unknown config key '{k}' (official inference config)")
        kw[k] = v
    if "compress_ratios" in kw:
        n_layers = _int_key(kw, "n_layers")
        _list_key(kw["compress_ratios"], "compress_ratios")
        kw.setdefault("n_mtp_layers", max(0, len(kw["compress_ratios"]) - n_layers))
    if kw.get("dtype") not in (None, "bf16", "fp8"):
        raise ConfigError(f"config key 'dtype': must be 'bf16' or 'fp8', got {kw['dtype']!r}")
    if raw.get("scale_dtype") == "fp8":
        kw["scale_fmt"] = "ue8m0"
    return kw


def _from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    layer_types = mlp_types = compress_ratios = rotary_fraction = None
    rates = dict(_HF_COMPRESS_RATES)
    nested_fractions: dict[str, float] = {}
    for k, v in raw.items():
        if k in _HF_RENAMES:
            kw[_HF_RENAMES[k]] = v
        elif k in _HF_FIXED:
            want = _HF_FIXED[k]
            if want is not None and v != want:
                raise ConfigError(f"config key '{k}': DeepSeek-V4 requires {want!r}, got {v!r}")
        elif k == "layer_types":
            layer_types = v
        elif k == "mlp_layer_types":
            mlp_types = v
        elif k == "compress_ratios":
            compress_ratios = v
        elif k == "compress_rates":
            rates.update(_read_rates(v))
        elif k == "partial_rotary_factor":
            rotary_fraction = v
        elif k == "rope_scaling":
            kw.update(_read_yarn(v, "rope_scaling"))
        elif k == "rope_parameters":
            for sub in ("main", "compress"):
                if isinstance(v, dict) and isinstance(v.get(sub), dict) and "partial_rotary_factor" in v[sub]:
                    nested_fractions[f"rope_parameters.{sub}"] = v[sub]["partial_rotary_factor"]
            if isinstance(v, dict) and isinstance(v.get("compress"), dict):
                kw.update(_read_yarn(v["compress"], "rope_parameters.compress"))
                if "rope_theta" in v["compress"]:
                    kw["compress_rope_theta"] = v["compress"]["rope_theta"]
                if isinstance(v.get("main"), dict) and "rope_theta" in v["main"]:
                    kw["rope_theta"] = v["main"]["rope_theta"]
            elif isinstance(v, dict):
                kw.update(_read_yarn(v, "rope_parameters"))
        elif k == "quantization_config":
            if not isinstance(v, dict):
                raise ConfigError("config key 'quantization_config': must be an object")
            if v.get("quant_method", "fp8") != "fp8" or v.get("weight_block_size", [128, 128]) != [128, 128]:
                raise ConfigError(f"config key 'quantization_config': only fp8 with 128x128 blocks, got {v}")
            kw["dtype"] = "fp8"
            kw["scale_fmt"] = v.get("scale_fmt")
        else:
            raise ConfigError(f"unknown config key '{k}' (Hugging Face config)")
    n_layers = _int_key(kw, "n_layers")
    n_mtp = _int_key(kw, "n_mtp_layers")
    _read_rotary(kw, rotary_fraction, nested_fractions)
    for key, v in (("layer_types", layer_types), ("mlp_layer_types", mlp_types), ("compress_ratios", compress_ratios)):
        if v is not None:
            _list_key(v, key)
    if layer_types is not None:
        bad = [t for t in layer_types if t not in LAYER_TYPE_TO_RATIO]
        if bad:
            raise ConfigError(f"config key 'layer_types': unknown entries {bad}")
        ratios = [rates[t] for t in layer_types]
        if compress_ratios is not None and list(compress_ratios[: len(ratios)]) != ratios:
            raise ConfigError("config keys 'layer_types' and 'compress_ratios' disagree")
        if len(ratios) != n_layers:
            raise ConfigError(f"config key 'layer_types': {len(ratios)} entries for num_hidden_layers={n_layers}")
        compress_ratios = ratios + ([] if compress_ratios is None else list(compress_ratios[len(ratios):]))
    if compress_ratios is not None:
        compress_ratios = list(compress_ratios)
        if len(compress_ratios) == n_layers:
            compress_ratios += [0] * n_mtp
        elif kw.get("dspark_block_size") and len(compress_ratios) > n_layers + n_mtp:
            # Flash-0731's config.json says num_nextn_predict_layers 1 and lists one window-only entry
            # per DSpark stage after the main layers: the entries count the stages
            kw["n_mtp_layers"] = len(compress_ratios) - n_layers
        kw["compress_ratios"] = compress_ratios
    if mlp_types is not None:
        bad = [t for t in mlp_types if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"config key 'mlp_layer_types': unknown entries {bad}")
        n_hash = sum(t == "hash_moe" for t in mlp_types)
        if list(mlp_types) != ["hash_moe"] * n_hash + ["moe"] * (len(mlp_types) - n_hash):
            raise ConfigError("config key 'mlp_layer_types': hash_moe layers must come first")
        if "n_hash_layers" in kw and kw["n_hash_layers"] != n_hash:
            raise ConfigError("config keys 'num_hash_layers' and 'mlp_layer_types' disagree")
        kw["n_hash_layers"] = n_hash
    if isinstance(kw.get("eos_token_id"), list):
        if not kw["eos_token_id"]:
            raise ConfigError("config key 'eos_token_id' = []: must be a token id or a non-empty list of them")
        kw["eos_token_id"] = kw["eos_token_id"][0]
    return kw


def _int_key(kw: dict[str, Any], field_name: str) -> int:
    """A field read during translation (before the schema runs): checked here so it cannot crash it."""
    v = kw.get(field_name, getattr(ModelConfig, field_name))
    problem = SCHEMA[field_name].problem(v)
    if problem:
        raise ConfigError(f"config key '{field_name}' = {v!r}: {problem}")
    return v


def _list_key(v: Any, key: str) -> None:
    if not isinstance(v, (list, tuple)) or len(v) > 4096:
        raise ConfigError(f"config key '{key}': must be a list (of at most 4096 entries), got {type(v).__name__}")
    if any(isinstance(x, (list, dict)) for x in v):
        raise ConfigError(f"config key '{key}': entries must be plain values, not lists or objects")


def _whole(v: Any) -> Any:
    """An integral float (32.0) as int; anything else unchanged, for the schema to judge."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v


_HF_COMPRESS_RATES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _read_rates(v: Any) -> dict[str, int]:
    """transformers' `compress_rates` {layer type: rate}: CSA is defined at rate 4 (overlapping windows and
    the Lightning Indexer); the heavy rate is free."""
    if not isinstance(v, dict):
        raise ConfigError("config key 'compress_rates': must be an object {layer type: rate}")
    out = {}
    for t, r in v.items():
        if t not in ("compressed_sparse_attention", "heavily_compressed_attention"):
            raise ConfigError(f"config key 'compress_rates': unknown layer type {t!r}")
        if not isinstance(r, int) or r < 2:
            raise ConfigError(f"config key 'compress_rates.{t}': must be an integer >= 2, got {r!r}")
        if t == "compressed_sparse_attention" and r != 4:
            raise ConfigError(f"config key 'compress_rates.{t}': DeepSeek-V4's compressed sparse attention "
                              f"is defined at rate 4 (overlapping windows, the indexer), got {r}")
        out[t] = r
    return out


def _read_rotary(kw: dict[str, Any], fraction: Any, nested: dict[str, float]) -> None:
    """RoPE dims of a Hugging Face config: `qk_rope_head_dim` when given, else int(head_dim *
    partial_rotary_factor) as transformers computes it (default 64/512); every stated form must agree."""
    head_dim = kw.get("head_dim", ModelConfig.head_dim)
    stated = {}
    if fraction is not None:
        stated["partial_rotary_factor"] = fraction
    stated.update(nested)
    dims = {}
    for key, f in stated.items():
        if not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(f"config key '{key}': must be a fraction in (0, 1], got {f!r}")
        dims[key] = int(head_dim * f)
    if "rope_head_dim" not in kw:
        kw["rope_head_dim"] = next(iter(dims.values()), int(head_dim * _HF_DEFAULT_ROTARY_FRACTION))
    for key, d in dims.items():
        if d != kw["rope_head_dim"]:
            raise ConfigError(f"config key '{key}': gives {d} RoPE dims of head_dim {head_dim}, but "
                              f"qk_rope_head_dim is {kw['rope_head_dim']}")


def _read_yarn(v: Any, key: str) -> dict[str, Any]:
    if v is None:
        return {"rope_factor": 1.0, "original_seq_len": 0}
    if not isinstance(v, dict):
        raise ConfigError(f"config key '{key}': must be an object")
    kind = v.get("type", v.get("rope_type", "yarn"))
    if kind not in ("yarn", "default"):
        raise ConfigError(f"config key '{key}': only 'yarn' scaling is defined for DeepSeek-V4, got {kind!r}")
    if kind == "default":
        return {"rope_factor": 1.0, "original_seq_len": 0}
    known = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "rope_theta", "partial_rotary_factor"}
    for k in v:
        if k not in known:
            raise ConfigError(f"unknown config key '{key}.{k}'")
    out = {}
    if "factor" in v:
        out["rope_factor"] = v["factor"]
    if "original_max_position_embeddings" in v:
        out["original_seq_len"] = _whole(v["original_max_position_embeddings"])
    if "beta_fast" in v:
        out["beta_fast"] = _whole(v["beta_fast"])
    if "beta_slow" in v:
        out["beta_slow"] = _whole(v["beta_slow"])
    return out


# ---------------------------------------------------------------------- presets
def _tiny() -> ModelConfig:
    # Under 5M parameters, every feature: window-only, CSA (ratio 4 + indexer), HCA (ratio 128),
    # a hash-routed layer, an MTP block. Window stays 128 so tests cross the real window size.
    return ModelConfig(
        name="tiny", vocab_size=1024, dim=128, n_layers=4, n_mtp_layers=1, n_hash_layers=1,
        n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        window_size=128, compress_ratios=(0, 4, 128, 4, 0),
        index_n_heads=4, index_head_dim=128, index_topk=8,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=64,
        route_scale=1.5, swiglu_limit=10.0, max_seq_len=4096,
    )


def _small() -> ModelConfig:
    return ModelConfig(
        name="small", vocab_size=32768, dim=1024, n_layers=8, n_mtp_layers=0, n_hash_layers=2,
        n_heads=16, head_dim=512, rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=256,
        window_size=128, compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4),
        index_n_heads=16, index_head_dim=128, index_topk=256,
        n_routed_experts=32, n_shared_experts=1, n_activated_experts=4, moe_inter_dim=512,
        route_scale=1.5, swiglu_limit=10.0, max_seq_len=65536,
    )


def _medium() -> ModelConfig:
    # One H200's training shape (between small and flash): 16 layers of flash's pattern (two window-only,
    # then CSA / HCA alternating), 64 routed experts with 6 active, V4's vocabulary, one MTP block; fp32
    # master weights, gradients and optimizer state plus checkpointed activations of 1 x 4096 tokens fit
    # one 141 GB GPU (`dsv4 info --preset medium`).
    return ModelConfig(
        name="medium", vocab_size=129280, dim=2048, n_layers=16, n_mtp_layers=1, n_hash_layers=2,
        n_heads=32, head_dim=512, rope_head_dim=64, q_lora_rank=768, o_groups=4, o_lora_rank=512,
        window_size=128, compress_ratios=(0, 0) + (4, 128) * 7 + (0,),
        index_n_heads=32, index_head_dim=128, index_topk=512,
        n_routed_experts=64, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=768,
        route_scale=1.5, swiglu_limit=10.0, max_seq_len=65536,
    )


def _flash() -> ModelConfig:
    return ModelConfig(
        name="flash", vocab_size=129280, dim=4096, n_layers=43, n_mtp_layers=1, n_hash_layers=3,
        n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        window_size=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4,) + (0,),
        index_n_heads=64, index_head_dim=128, index_topk=512,
        n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2048,
        route_scale=1.5, swiglu_limit=10.0, dtype="fp8", expert_dtype="fp4", scale_fmt="ue8m0",
    )


def _pro() -> ModelConfig:
    # Identical to the released DeepSeek-V4-Pro config.json.
    return ModelConfig(
        name="pro", vocab_size=129280, dim=7168, n_layers=61, n_mtp_layers=1, n_hash_layers=3,
        n_heads=128, head_dim=512, rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        window_size=128, compress_ratios=(128, 128) + (4, 128) * 29 + (4,) + (0,),
        index_n_heads=64, index_head_dim=128, index_topk=1024,
        n_routed_experts=384, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=3072,
        route_scale=2.5, swiglu_limit=10.0, dtype="fp8", expert_dtype="fp4", scale_fmt="ue8m0",
    )


PRESETS = {"tiny": _tiny, "small": _small, "medium": _medium, "flash": _flash, "pro": _pro}

__all__ = ["ModelConfig", "ConfigError", "PRESETS", "QUANT_MODES", "SCALE_FMTS", "SCORE_FUNCS"]
