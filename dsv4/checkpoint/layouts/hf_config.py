"""The Hugging Face `config.json` (`DeepseekV4Config`'s keys): the config half of the Hugging Face layout.

`dsv4.config` knows ModelConfig's own fields and the official inference keys only; the keys of other
formats are translated where the format lives. `read_config` reads a config dict of any format (a Hugging
Face one is recognized by `hidden_size`, `num_hidden_layers` or `model_type: deepseek_v4`) and
`read_config_file` a config.json: what every command's --config, checkpoint directory and trainer use.
`to_hf_json` writes the keys back (the hf layout's writer, the transformers comparisons).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import (
    LAYER_TYPE_TO_RATIO,
    ConfigError,
    ModelConfig,
    int_key,
    is_hf_config,
    list_key,
    read_config_json,
    translating,
    whole,
)


def read_config(raw: Any, name: str = "custom", overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A config dict of any format (official inference keys, ModelConfig's fields, or Hugging Face keys)."""
    if is_hf_config(raw):
        return ModelConfig.from_fields(translating(from_hf, raw), name, overrides)
    return ModelConfig.from_dict(raw, name, overrides)


def read_config_file(path: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A config.json of any format; the config is named after its directory."""
    path = Path(path)
    return read_config(read_config_json(path), name=path.parent.name or "custom", overrides=overrides)


# Hugging Face key -> ModelConfig field
_HF_RENAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "num_hash_layers": "n_hash_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "max_position_embeddings": "max_seq_len",
    "vocab_size": "vocab_size",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "head_dim": "head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "compress_rope_theta": "compress_rope_theta",
    "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "swiglu_limit": "swiglu_limit",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "expert_dtype": "expert_dtype",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
}
# Hugging Face keys accepted without effect on the math, with the value they must have (None = any).


# Hugging Face keys accepted without effect on the math, with the value they must have (None = any).
_HF_FIXED: dict[str, Any] = {
    "architectures": None,
    "model_type": None,
    "transformers_version": None,
    "torch_dtype": None,
    "dtype": None,
    "initializer_range": None,
    "use_cache": None,
    "attention_dropout": None,
    "topk_method": None,
    "output_router_logits": None,
    "router_aux_loss_coef": None,
    "pad_token_id": None,
    "router_jitter_noise": None,
    "_name_or_path": None,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
# transformers' rotary fraction when a config gives none: qk_rope_head_dim 64 of a 512-dim head


# transformers' rotary fraction when a config gives none: qk_rope_head_dim 64 of a 512-dim head
_HF_DEFAULT_ROTARY_FRACTION = 64 / 512


def from_hf(raw: dict[str, Any]) -> dict[str, Any]:
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
    n_layers = int_key(kw, "n_layers")
    n_mtp = int_key(kw, "n_mtp_layers")
    _read_rotary(kw, rotary_fraction, nested_fractions)
    for key, v in (("layer_types", layer_types), ("mlp_layer_types", mlp_types), ("compress_ratios", compress_ratios)):
        if v is not None:
            list_key(v, key)
    if layer_types is not None:
        bad = [t for t in layer_types if t not in LAYER_TYPE_TO_RATIO]
        if bad:
            raise ConfigError(f"config key 'layer_types': unknown entries {bad}")
        ratios = [rates[t] for t in layer_types]
        if compress_ratios is not None and list(compress_ratios[: len(ratios)]) != ratios:
            raise ConfigError("config keys 'layer_types' and 'compress_ratios' disagree")
        if len(ratios) != n_layers:
            raise ConfigError(f"config key 'layer_types': {len(ratios)} entries for num_hidden_layers={n_layers}")
        compress_ratios = ratios + ([] if compress_ratios is None else list(compress_ratios[len(ratios) :]))
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
            raise ConfigError(
                f"config key 'compress_rates.{t}': DeepSeek-V4's compressed sparse attention "
                f"is defined at rate 4 (overlapping windows, the indexer), got {r}"
            )
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
            raise ConfigError(
                f"config key '{key}': gives {d} RoPE dims of head_dim {head_dim}, but "
                f"qk_rope_head_dim is {kw['rope_head_dim']}"
            )


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
    known = {
        "type",
        "rope_type",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "rope_theta",
        "partial_rotary_factor",
    }
    for k in v:
        if k not in known:
            raise ConfigError(f"unknown config key '{key}.{k}'")
    out = {}
    if "factor" in v:
        out["rope_factor"] = v["factor"]
    if "original_max_position_embeddings" in v:
        out["original_seq_len"] = whole(v["original_max_position_embeddings"])
    if "beta_fast" in v:
        out["beta_fast"] = whole(v["beta_fast"])
    if "beta_slow" in v:
        out["beta_slow"] = whole(v["beta_slow"])
    return out


# ---------------------------------------------------------------------- presets


def to_hf_json(cfg: ModelConfig) -> dict[str, Any]:
    """Hugging Face `config.json` keys (as `DeepseekV4Config` reads them)."""
    heavy = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r not in (0, 4)})
    if len(heavy) > 1:
        raise ConfigError(
            f"config key 'compress_ratios': a Hugging Face config has one heavy compression rate, this one has {heavy}"
        )
    rate = heavy[0] if heavy else 128
    ratio_to_type = {0: "sliding_attention", 4: "compressed_sparse_attention", rate: "heavily_compressed_attention"}
    quant: dict[str, Any] = {}
    if rate != 128:
        quant["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": rate}
    if cfg.dtype == "fp8":
        quant["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": cfg.scale_fmt,
            "weight_block_size": [128, 128],
        }
    if cfg.expert_dtype:
        quant["expert_dtype"] = cfg.expert_dtype
    return {
        **quant,
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.window_size,
        "layer_types": [ratio_to_type[r] for r in cfg.compress_ratios[: cfg.n_layers]],
        "mlp_layer_types": ["hash_moe" if i < cfg.n_hash_layers else "moe" for i in range(cfg.n_layers)],
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {
            "type": "yarn",
            "factor": cfg.rope_factor,
            "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow,
            "original_max_position_embeddings": cfg.original_seq_len,
        },
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.n_activated_experts,
        "moe_intermediate_size": cfg.moe_inter_dim,
        "scoring_func": cfg.score_func,
        "routed_scaling_factor": cfg.route_scale,
        "swiglu_limit": cfg.swiglu_limit,
        "norm_topk_prob": True,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.norm_eps,
        "num_nextn_predict_layers": cfg.n_mtp_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        **cfg.dspark_json(),
    }


# ------------------------------------------------------------------ readers
