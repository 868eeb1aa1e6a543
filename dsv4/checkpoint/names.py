"""Tensor names of DeepSeek-V4 checkpoints and how they map onto each other.

Three name spaces:
- official: the official inference code's names (`layers.3.attn.wq_b.weight`, `...wq_b.scale`,
  `layers.3.ffn.experts.17.w1.weight`). The release checkpoint and the inference layout use them.
- model: this package's parameters. Identical to official, except routed experts are stacked per layer:
  `layers.3.ffn.experts.w1` [E, inter, dim] holds every `layers.3.ffn.experts.{j}.w1.weight`.
- aliases: what other writers call the same tensors: an optional `model.` prefix, `self_attn`/`mlp`,
  `weight_scale_inv`, `e_score_correction_bias` (release variants) and the Hugging Face transformers
  module names (`q_a_proj`, `attn_hc.fn`, `sinks`, `compressor.position_bias`, fused
  `experts.gate_up_proj` = cat(w1, w3) on dim 1, ...). `canonical()` maps any of them to official.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ModelConfig

# roles: how a tensor is stored and may be quantized
LINEAR = "linear"  # 2-D weight that the release stores as FP8 + block scale (or BF16 without one)
EXPERT = "expert"  # routed expert weight: FP8 or MXFP4 (+ scale), or plain float
DENSE = "dense"  # float weight that is never quantized (embeddings, head, norms, compressor, router)
F32 = "f32"  # fp32 parameters (mHC, sinks, ape, router bias)
INT = "int"  # integer table (tid2eid)


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    role: str


def _block_tensors(cfg: ModelConfig, layer_id: int) -> dict[str, Spec]:
    """One block's tensors, names relative to the block (`attn.wq_a.weight`, ...)."""
    d, h, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    mix, hcd = cfg.mix_hc, cfg.hc_mult * cfg.dim
    t: dict[str, Spec] = {
        "attn_norm.weight": Spec((d,), DENSE),
        "ffn_norm.weight": Spec((d,), DENSE),
        "hc_attn_fn": Spec((mix, hcd), F32),
        "hc_attn_base": Spec((mix,), F32),
        "hc_attn_scale": Spec((3,), F32),
        "hc_ffn_fn": Spec((mix, hcd), F32),
        "hc_ffn_base": Spec((mix,), F32),
        "hc_ffn_scale": Spec((3,), F32),
        "attn.attn_sink": Spec((h,), F32),
        "attn.wq_a.weight": Spec((cfg.q_lora_rank, d), LINEAR),
        "attn.q_norm.weight": Spec((cfg.q_lora_rank,), DENSE),
        "attn.wq_b.weight": Spec((h * hd, cfg.q_lora_rank), LINEAR),
        "attn.wkv.weight": Spec((hd, d), LINEAR),
        "attn.kv_norm.weight": Spec((hd,), DENSE),
        "attn.wo_a.weight": Spec((cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), LINEAR),
        "attn.wo_b.weight": Spec((d, cfg.o_groups * cfg.o_lora_rank), LINEAR),
    }
    ratio = cfg.compress_ratios[layer_id]
    if ratio:
        coff = 2 if ratio == 4 else 1
        t.update(_compressor("attn.compressor", cfg, ratio, coff, hd))
        if ratio == 4:
            ihd, ih = cfg.index_head_dim, cfg.index_n_heads
            t["attn.indexer.wq_b.weight"] = Spec((ih * ihd, cfg.q_lora_rank), LINEAR)
            t["attn.indexer.weights_proj.weight"] = Spec((ih, d), DENSE)
            t.update(_compressor("attn.indexer.compressor", cfg, ratio, coff, ihd))
    e, inter = cfg.n_routed_experts, cfg.moe_inter_dim
    t["ffn.gate.weight"] = Spec((e, d), DENSE)
    if layer_id < cfg.n_hash_layers:
        t["ffn.gate.tid2eid"] = Spec((cfg.vocab_size, cfg.n_activated_experts), INT)
    else:
        t["ffn.gate.bias"] = Spec((e,), F32)
    for j in range(e):
        t[f"ffn.experts.{j}.w1.weight"] = Spec((inter, d), EXPERT)
        t[f"ffn.experts.{j}.w2.weight"] = Spec((d, inter), EXPERT)
        t[f"ffn.experts.{j}.w3.weight"] = Spec((inter, d), EXPERT)
    if cfg.n_shared_experts:
        t["ffn.shared_experts.w1.weight"] = Spec((inter, d), LINEAR)
        t["ffn.shared_experts.w2.weight"] = Spec((d, inter), LINEAR)
        t["ffn.shared_experts.w3.weight"] = Spec((inter, d), LINEAR)
    return t


def block_tensors(cfg: ModelConfig, layer_id: int) -> dict[str, Spec]:
    """The tensors of block `layer_id` (main layers first, then MTP), names relative to the block."""
    return _block_tensors(cfg, layer_id)


def _compressor(prefix: str, cfg: ModelConfig, ratio: int, coff: int, hd: int) -> dict[str, Spec]:
    return {
        f"{prefix}.ape": Spec((ratio, coff * hd), F32),
        f"{prefix}.wkv.weight": Spec((coff * hd, cfg.dim), DENSE),
        f"{prefix}.wgate.weight": Spec((coff * hd, cfg.dim), DENSE),
        f"{prefix}.norm.weight": Spec((hd,), DENSE),
    }


def official_tensors(cfg: ModelConfig, mtp: bool = True) -> dict[str, Spec]:
    """Every tensor of the official layout for cfg (weights only; scales come from the storage format)."""
    d, hc = cfg.dim, cfg.hc_mult
    out: dict[str, Spec] = {"embed.weight": Spec((cfg.vocab_size, d), DENSE)}
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{k}": v for k, v in _block_tensors(cfg, i).items()})
    out["norm.weight"] = Spec((d,), DENSE)
    out["head.weight"] = Spec((cfg.vocab_size, d), DENSE)
    out["hc_head_fn"] = Spec((hc, hc * d), F32)
    out["hc_head_base"] = Spec((hc,), F32)
    out["hc_head_scale"] = Spec((1,), F32)
    if mtp and cfg.dspark:
        out.update(dspark_tensors(cfg))
    elif mtp:
        for k in range(cfg.n_mtp_layers):
            p = f"mtp.{k}"
            blk = _block_tensors(cfg, cfg.n_layers + k)
            blk.update(
                {
                    "e_proj.weight": Spec((d, d), LINEAR),
                    "h_proj.weight": Spec((d, d), LINEAR),
                    "enorm.weight": Spec((d,), DENSE),
                    "hnorm.weight": Spec((d,), DENSE),
                    "norm.weight": Spec((d,), DENSE),
                    "hc_head_fn": Spec((hc, hc * d), F32),
                    "hc_head_base": Spec((hc,), F32),
                    "hc_head_scale": Spec((1,), F32),
                }
            )
            out.update({f"{p}.{k2}": v for k2, v in blk.items()})
    return out


def dspark_tensors(cfg: ModelConfig) -> dict[str, Spec]:
    """{official name: Spec} of a DSpark draft under `mtp.*` (Flash-0731): every stage a window-only
    block; `main_proj` / `main_norm` on the first stage; the last stage's `norm`, HC head, Markov head
    (`markov_w1` [vocab, rank] an embedding, `markov_w2` [vocab, rank] a projection) and confidence head
    (`proj` [1, dim + rank], no bias). Embedding and head are the main model's."""
    d, hc, last, r = cfg.dim, cfg.hc_mult, cfg.n_mtp_layers - 1, cfg.dspark_markov_rank
    out: dict[str, Spec] = {}
    for k in range(cfg.n_mtp_layers):
        out.update({f"mtp.{k}.{n}": v for n, v in _block_tensors(cfg, cfg.n_layers + k).items()})
    out["mtp.0.main_proj.weight"] = Spec((d, d * len(cfg.dspark_target_layer_ids)), LINEAR)
    out["mtp.0.main_norm.weight"] = Spec((d,), DENSE)
    out[f"mtp.{last}.norm.weight"] = Spec((d,), DENSE)
    out[f"mtp.{last}.hc_head_fn"] = Spec((hc, hc * d), F32)
    out[f"mtp.{last}.hc_head_base"] = Spec((hc,), F32)
    out[f"mtp.{last}.hc_head_scale"] = Spec((1,), F32)
    out[f"mtp.{last}.markov_head.markov_w1.weight"] = Spec((cfg.vocab_size, r), DENSE)
    out[f"mtp.{last}.markov_head.markov_w2.weight"] = Spec((cfg.vocab_size, r), DENSE)
    out[f"mtp.{last}.confidence_head.proj.weight"] = Spec((1, d + r), DENSE)
    return out


# ------------------------------------------------------------------------------ official <-> model
_EXPERT_RE = re.compile(
    r"^(?P<p>(?:layers|mtp)\.\d+\.ffn\.experts)\.(?P<j>\d+)\.(?P<w>w[123])\.(?P<leaf>weight|scale)$"
)


def to_model(name: str) -> tuple[str, int | None]:
    """official name -> (model name, expert index or None). Scales map like their weights."""
    m = _EXPERT_RE.match(name)
    if m:
        base = f"{m['p']}.{m['w']}"
        return (base if m["leaf"] == "weight" else base + ".scale"), int(m["j"])
    return name, None


def to_official(model_name: str, expert: int | None = None) -> str:
    """model name (+ expert index for stacked experts) -> official name."""
    if expert is None:
        return model_name
    scale = model_name.endswith(".scale")
    base = model_name[: -len(".scale")] if scale else model_name
    p, w = base.rsplit(".", 1)
    return f"{p}.{expert}.{w}.{'scale' if scale else 'weight'}"


def scale_name(weight_name: str) -> str:
    """official weight name -> its block-scale name (`x.weight` -> `x.scale`)."""
    return weight_name[: -len(".weight")] + ".scale"


# ------------------------------------------------------------------------------ aliases -> official
# Hugging Face transformers module paths inside a block (after `self_attn`->`attn`, `mlp`->`ffn`)
_HF_MODULES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "attn.q_a_proj": "attn.wq_a",
    "attn.q_a_norm": "attn.q_norm",
    "attn.q_b_proj": "attn.wq_b",
    "attn.kv_proj": "attn.wkv",
    "attn.o_a_proj": "attn.wo_a",
    "attn.o_b_proj": "attn.wo_b",
    "attn.norm": "attn.kv_norm",  # transformers' original-format save writes kv_norm as attn.norm
    "attn.compressor.kv_proj": "attn.compressor.wkv",
    "attn.compressor.gate_proj": "attn.compressor.wgate",
    "attn.compressor.kv_norm": "attn.compressor.norm",
    "attn.compressor.indexer.kv_proj": "attn.indexer.compressor.wkv",
    "attn.compressor.indexer.gate_proj": "attn.indexer.compressor.wgate",
    "attn.compressor.indexer.kv_norm": "attn.indexer.compressor.norm",
    "attn.compressor.indexer.norm": "attn.indexer.compressor.norm",  # (same save, HF module path)
    "attn.compressor.indexer.q_b_proj": "attn.indexer.wq_b",
    "attn.compressor.indexer.scorer.weights_proj": "attn.indexer.weights_proj",
    "ffn.shared_experts.gate_proj": "ffn.shared_experts.w1",
    "ffn.shared_experts.down_proj": "ffn.shared_experts.w2",
    "ffn.shared_experts.up_proj": "ffn.shared_experts.w3",
}
# Hugging Face parameters without a `.weight` leaf inside a block
_HF_PARAMS = {
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "attn.sinks": "attn.attn_sink",
    "attn.compressor.position_bias": "attn.compressor.ape",
    "attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
}
_HF_TOP = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
# fused Hugging Face expert tensors: [E, 2*inter, dim] = cat(w1, w3) and [E, dim, inter] = w2
FUSED = {"ffn.experts.gate_up_proj": ("w1", "w3"), "ffn.experts.down_proj": ("w2",)}
_BLOCK_RE = re.compile(r"^(?P<p>(?:layers|mtp)\.\d+)\.(?P<rest>.+)$")
HF_MARKERS = (
    "embed_tokens",
    "lm_head",
    "input_layernorm",
    "attn_hc.",
    "gate_up_proj",
    "hc_head.hc_",
    ".sinks",
    "q_a_proj",
    "position_bias",
)


@dataclass(frozen=True)
class Canon:
    """What a stored tensor is: an official weight or scale, a fused HF expert tensor, or ignorable."""

    name: str  # official name (fused: `layers.i.ffn.experts.gate_up_proj`)
    kind: str  # "weight" | "scale" | "fused" | "ignored"
    parts: tuple[str, ...] = ()


def canonical(stored: str) -> Canon:
    """Map a stored tensor name in any supported layout to the official name space."""
    n = stored[len("model.") :] if stored.startswith("model.") else stored
    n = n.replace(".self_attn.", ".attn.").replace(".mlp.", ".ffn.")
    if n.endswith((".weight_scale_inv", ".weight_scale")):
        n = n[: n.rindex(".weight_scale")] + ".scale"
    n = n.replace(".e_score_correction_bias", ".bias")
    if n in _HF_TOP:
        return Canon(_HF_TOP[n], "weight")
    m = _BLOCK_RE.match(n)
    if not m:
        return Canon(n, "scale" if n.endswith(".scale") else "weight")
    p, rest = m["p"], m["rest"]
    if p.startswith("mtp.") and ("emb" in rest.split(".")[0] or rest in ("head.weight", "lm_head.weight")):
        return Canon(n, "ignored")  # the MTP block shares the main model's embedding and head
    if rest in FUSED:
        return Canon(f"{p}.{rest}", "fused", FUSED[rest])
    if rest in _HF_PARAMS:
        return Canon(f"{p}.{_HF_PARAMS[rest]}", "weight")
    module, _, leaf = rest.rpartition(".")
    if leaf in ("weight", "scale") and module in _HF_MODULES:
        rest = f"{_HF_MODULES[module]}.{leaf}"
    return Canon(f"{p}.{rest}", "scale" if leaf == "scale" else "weight")  # (hc_*_scale has no dot)


# ------------------------------------------------------------------------------ official -> HF names
def hf_name(official: str) -> str:
    """official name (not a routed expert) -> Hugging Face transformers parameter name."""
    inv_top = {v: k for k, v in _HF_TOP.items()}
    if official in inv_top:
        top = inv_top[official]
        return top if top == "lm_head.weight" else f"model.{top}"
    m = _BLOCK_RE.match(official)
    if not m:
        return f"model.{official}"
    p, rest = m["p"], m["rest"]
    inv_params = {v: k for k, v in _HF_PARAMS.items()}
    if rest in inv_params:
        rest = inv_params[rest]
    else:
        module, _, leaf = rest.rpartition(".")
        inv_mod = {v: k for k, v in _HF_MODULES.items() if k not in ("attn.norm", "attn.compressor.indexer.norm")}
        if module in inv_mod:
            rest = f"{inv_mod[module]}.{leaf}"
        if rest == "ffn.gate.bias":
            rest = "ffn.gate.e_score_correction_bias"
        if leaf == "scale":
            rest = rest[: -len("scale")] + "weight_scale_inv"
    rest = rest.replace("attn.", "self_attn.", 1) if rest.startswith("attn.") else rest
    rest = rest.replace("ffn.", "mlp.", 1) if rest.startswith("ffn.") else rest
    return f"model.{p}.{rest}"


# ------------------------------------------------------------------------------ model-parallel splits
# official converter: these are split across ranks (dim 0: column-parallel / vocab-parallel, dim 1:
# row-parallel); routed experts are distributed by index; everything else is replicated.
_SPLIT_DIM0 = ("attn.wq_b", "attn.wo_a", "attn.attn_sink", "attn.indexer.wq_b", "attn.indexer.weights_proj")


def split_dim(official: str) -> int | None:
    """The dimension the inference layout splits this tensor (or its scale) on, None = replicated."""
    base = official[: -len(".weight")] if official.endswith(".weight") else official
    base = base[: -len(".scale")] if base.endswith(".scale") else base
    if base in ("embed", "head"):
        return 0
    m = _BLOCK_RE.match(base)
    if not m:
        return None
    rest = m["rest"]
    if rest in _SPLIT_DIM0 or rest.startswith("markov_head."):  # the Markov head is vocab-parallel
        return 0
    if rest == "attn.wo_b":
        return 1
    return None


def expert_index(official: str) -> int | None:
    m = _EXPERT_RE.match(official)
    return int(m["j"]) if m else None
