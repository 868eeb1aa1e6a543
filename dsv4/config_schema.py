"""The declared schema of ModelConfig: a type and range for every key, then the relations between keys.

Every way a config is made (our config.json, the official inference config.json, a Hugging Face
config.json after translation, a preset, `ModelConfig(...)` or `.replace(...)`) ends in
`ModelConfig.__post_init__`, which applies this schema, so validation lives here and only here.

Ranges do two jobs. They refuse values that compute garbage (a negative or NaN epsilon, a RoPE base
of 1 or NaN, a non-integer size) and they bound the work and memory a config can ask for: the upper
limits are generous multiples of the largest released model (DeepSeek-V4-Pro: dim 7168, 61 layers,
384 experts, 1M positions), so no real config is refused while a config of a billion layers or a
million Sinkhorn iterations per token is. `MAX_PARAMETERS` caps the total size the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# how weights stored as FP8 / FP4 compute: "w8a8" = the official numerics (every activation feeding such a
# weight is quantized to FP8 per token in blocks of 128), "w8a16" = activations kept in the model dtype,
# "int8" = those weights (from any storage) requantized to per-row INT8, activations to INT8 per token
QUANT_MODES = ("w8a8", "w8a16", "int8")
SCALE_FMTS = (None, "ue8m0")


class ConfigError(ValueError):
    """A config value is unknown, missing or inconsistent; the message names the key."""


K = 1024
M = K * K
# about six times DeepSeek-V4-Pro's 1.6T parameters: anything above is a typo or an attack
MAX_PARAMETERS = 10**13


@dataclass(frozen=True)
class Int:
    lo: int
    hi: int

    def problem(self, v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"must be an integer, got {type(v).__name__}"
        if not self.lo <= v <= self.hi:
            return f"must be an integer in [{self.lo}, {self.hi}]"
        return None


@dataclass(frozen=True)
class Float:
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is not allowed (e.g. eps > 0)

    def problem(self, v: Any) -> str | None:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return f"must be a number, got {type(v).__name__}"
        if not math.isfinite(v):
            return "must be a finite number"
        if v < self.lo or (self.lo_open and v == self.lo) or v > self.hi:
            return f"must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
        return None


@dataclass(frozen=True)
class Bool:
    def problem(self, v: Any) -> str | None:
        return None if isinstance(v, bool) else f"must be true or false, got {type(v).__name__}"


@dataclass(frozen=True)
class Choice:
    values: tuple

    def problem(self, v: Any) -> str | None:
        ok = any(v is c if c is None else (type(v) is type(c) and v == c) for c in self.values)
        return None if ok else f"must be one of {list(self.values)}"


@dataclass(frozen=True)
class IntList:
    item: Int
    max_len: int

    def problem(self, v: Any) -> str | None:
        if not isinstance(v, (list, tuple)):
            return f"must be a list of integers, got {type(v).__name__}"
        if len(v) > self.max_len:
            return f"must have at most {self.max_len} entries"
        if any(self.item.problem(x) for x in v):
            return f"entries must be integers in [{self.item.lo}, {self.item.hi}]"
        return None


@dataclass(frozen=True)
class Text:
    def problem(self, v: Any) -> str | None:
        return None if isinstance(v, str) and len(v) <= 256 else "must be a string of at most 256 characters"


SCHEMA: dict[str, Any] = {
    "vocab_size": Int(1, 2 * M),
    "dim": Int(1, 64 * K),
    "n_layers": Int(1, 1024),
    "n_mtp_layers": Int(0, 16),
    "n_hash_layers": Int(0, 1024),
    "n_heads": Int(1, 4 * K),
    "head_dim": Int(1, 8 * K),
    "rope_head_dim": Int(2, 8 * K),
    "q_lora_rank": Int(1, 64 * K),
    "o_groups": Int(1, 4 * K),
    "o_lora_rank": Int(1, 64 * K),
    "window_size": Int(1, M),
    "compress_ratios": IntList(Int(0, 64 * K), 1024 + 16),
    "norm_eps": Float(0.0, 1.0, lo_open=True),
    "rope_theta": Float(1.0, 1e12, lo_open=True),
    "compress_rope_theta": Float(1.0, 1e12, lo_open=True),
    "rope_factor": Float(1.0, 1e6),
    "original_seq_len": Int(0, 1 << 30),
    "beta_fast": Int(1, 64 * K),
    "beta_slow": Int(1, 64 * K),
    "index_n_heads": Int(1, 4 * K),
    "index_head_dim": Int(1, 8 * K),
    "index_topk": Int(1, M),
    "n_routed_experts": Int(1, 64 * K),
    "n_shared_experts": Int(0, 1),
    "n_activated_experts": Int(1, 64 * K),
    "moe_inter_dim": Int(1, M),
    "score_func": Choice(SCORE_FUNCS),
    "route_scale": Float(0.0, 1e6, lo_open=True),
    "swiglu_limit": Float(0.0, 1e6),
    "hc_mult": Int(1, 64),
    "hc_sinkhorn_iters": Int(1, 1000),
    "hc_eps": Float(0.0, 1.0, lo_open=True),
    "bos_token_id": Int(0, 2 * M),
    "eos_token_id": Int(0, 2 * M),
    "max_seq_len": Int(1, 1 << 24),
    "fp8_kv_sim": Bool(),
    "fp4_indexer_sim": Bool(),
    "dtype": Choice(("bf16", "fp8")),
    "expert_dtype": Choice((None, "fp8", "fp4")),
    "scale_fmt": Choice(SCALE_FMTS),
    "quant_mode": Choice(QUANT_MODES),
    "dspark_block_size": Int(0, 64),
    "dspark_noise_token_id": Int(0, 2 * M),
    "dspark_target_layer_ids": IntList(Int(0, 1023), 64),
    "dspark_markov_rank": Int(1, 64 * K),
    "name": Text(),
}


def approx_parameters(c: Any) -> int:
    """Parameters of a config, in closed form to within a few percent (embeddings, attention, experts)."""
    layers = c.n_layers + c.n_mtp_layers
    draft = (
        c.dim * c.dim * len(c.dspark_target_layer_ids) + 2 * c.vocab_size * c.dspark_markov_rank
        if c.dspark_block_size
        else 0
    )
    attn = (
        c.dim * c.q_lora_rank
        + c.q_lora_rank * c.n_heads * c.head_dim
        + c.dim * c.head_dim
        + c.n_heads * c.head_dim * c.o_lora_rank // max(c.o_groups, 1)
        + c.o_groups * c.o_lora_rank * c.dim
    )
    experts = (c.n_routed_experts + c.n_shared_experts) * 3 * c.dim * c.moe_inter_dim
    return 2 * c.vocab_size * c.dim + layers * (attn + experts + c.n_routed_experts * c.dim) + draft


def _nope_ok(c: Any) -> bool:
    return (c.head_dim - c.rope_head_dim) % 64 == 0


# (key the message names, rule in words, holds(config)) - checked in order once every field is in range
RELATIONS: list[tuple[str, Callable[[Any], str], Callable[[Any], bool]]] = [
    ("n_hash_layers", lambda c: f"must be <= n_layers ({c.n_layers})", lambda c: c.n_hash_layers <= c.n_layers),
    (
        "compress_ratios",
        lambda c: f"needs n_layers + n_mtp_layers = {c.n_layers + c.n_mtp_layers} entries",
        lambda c: len(c.compress_ratios) == c.n_layers + c.n_mtp_layers,
    ),
    ("compress_ratios", lambda c: "entries must be 0 or >= 2", lambda c: all(r != 1 for r in c.compress_ratios)),
    (
        "compress_ratios",
        lambda c: "MTP layers (the entries after n_layers) must be window-only (0)",
        lambda c: all(r == 0 for r in c.compress_ratios[c.n_layers :]),
    ),
    (
        "rope_head_dim",
        lambda c: f"must be even and <= head_dim ({c.head_dim})",
        lambda c: c.rope_head_dim <= c.head_dim and c.rope_head_dim % 2 == 0,
    ),
    (
        "fp8_kv_sim",
        lambda c: (
            f"the FP8 KV simulation quantizes the head_dim - rope_head_dim = {c.head_dim - c.rope_head_dim} non-RoPE "
            f"dims in blocks of 64, and {c.head_dim - c.rope_head_dim} is not a multiple of 64; switch the "
            "simulation off (fp8_kv_sim=False, as transformers runs) or use other dims"
        ),
        lambda c: not c.fp8_kv_sim or _nope_ok(c),
    ),
    (
        "o_groups",
        lambda c: f"n_heads={c.n_heads} must be divisible by o_groups={c.o_groups}",
        lambda c: c.n_heads % c.o_groups == 0,
    ),
    (
        "n_activated_experts",
        lambda c: f"must be <= n_routed_experts ({c.n_routed_experts})",
        lambda c: c.n_activated_experts <= c.n_routed_experts,
    ),
    (
        "index_head_dim",
        lambda c: f"must be at least rope_head_dim={c.rope_head_dim} (the indexer's RoPE dims)",
        lambda c: c.index_head_dim >= c.rope_head_dim,
    ),
    (
        "fp4_indexer_sim",
        lambda c: (
            f"the FP4 indexer simulation rotates the index_head_dim = {c.index_head_dim} dims with a Hadamard "
            "transform (a power of two) and quantizes them in blocks of 32; switch the simulation off "
            "(fp4_indexer_sim=False, as transformers runs) or use a power of two >= 32"
        ),
        lambda c: (
            not c.fp4_indexer_sim or (c.index_head_dim & (c.index_head_dim - 1) == 0 and c.index_head_dim % 32 == 0)
        ),
    ),
    (
        "bos_token_id",
        lambda c: f"must be a token id < vocab_size ({c.vocab_size})",
        lambda c: c.bos_token_id < c.vocab_size,
    ),
    (
        "eos_token_id",
        lambda c: f"must be a token id < vocab_size ({c.vocab_size})",
        lambda c: c.eos_token_id < c.vocab_size,
    ),
    (
        "dspark_target_layer_ids",
        lambda c: (
            f"a DSpark draft (dspark_block_size > 0) reads the outputs of main "
            f"layers: give a non-empty, increasing list of layer indices below "
            f"n_layers ({c.n_layers})"
        ),
        lambda c: (
            not c.dspark_block_size
            or (
                len(c.dspark_target_layer_ids) > 0
                and all(0 <= i < c.n_layers for i in c.dspark_target_layer_ids)
                and list(c.dspark_target_layer_ids) == sorted(set(c.dspark_target_layer_ids))
            )
        ),
    ),
    (
        "dspark_noise_token_id",
        lambda c: f"must be a token id < vocab_size ({c.vocab_size})",
        lambda c: not c.dspark_block_size or c.dspark_noise_token_id < c.vocab_size,
    ),
    (
        "dim",
        lambda c: (
            f"the config describes about {approx_parameters(c):.3g} parameters, more than the "
            f"limit of {MAX_PARAMETERS:.0e}; check the sizes (dim, n_layers, n_routed_experts, "
            "moe_inter_dim, vocab_size)"
        ),
        lambda c: approx_parameters(c) <= MAX_PARAMETERS,
    ),
]


def _fail(key: str, value: Any, rule: str) -> None:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ConfigError(f"config key '{key}' = {shown}: {rule}")


def check_types(c: Any) -> None:
    """Every field's type and range (`SCHEMA`)."""
    for key, rule in SCHEMA.items():
        value = getattr(c, key)
        p = rule.problem(value)
        if p:
            _fail(key, value, p)


def check(c: Any) -> None:
    """`SCHEMA`, then `RELATIONS`; raises ConfigError for the first violation."""
    check_types(c)
    for key, rule, holds in RELATIONS:
        if not holds(c):
            _fail(key, getattr(c, key), rule(c))


__all__ = [
    "ConfigError",
    "QUANT_MODES",
    "SCALE_FMTS",
    "SCORE_FUNCS",
    "SCHEMA",
    "RELATIONS",
    "MAX_PARAMETERS",
    "approx_parameters",
    "check",
    "check_types",
]
