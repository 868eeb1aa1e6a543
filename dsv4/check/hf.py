"""Adapter: run Hugging Face transformers' `DeepseekV4ForCausalLM` on a dsv4 model's weights.

`runner(model)` builds the transformers model from the dsv4 config, copies every weight over (names via
`dsv4.checkpoint.names.hf_name`, routed experts fused into `gate_up_proj` = cat(w1, w3)), and returns a
callable tokens -> (logits, stages) whose stages carry dsv4 stage names, taken with forward hooks:
embed, per layer hc_attn_pre / hc_ffn_pre (the collapsed mHC inputs), attn.compressed_kv,
attn.indexer.topk, attn.out, ffn.router_indices / router_weights, ffn.out, hc_ffn_post, head.logits.

Semantic differences between transformers (5.x) and the official model that matter for a comparison:
- transformers simulates no quantization-aware training: no FP8 round trip on the KV non-RoPE dims, no
  FP4 round trip in the Lightning Indexer and no Hadamard rotation there (the rotation alone does not
  change the scores: it is orthogonal). The dsv4 side must run with `fp8_kv_sim=False` and
  `fp4_indexer_sim=False` to agree; `dsv4 check compare --external hf` does that and says so.
- one compression rate per layer type (`compress_rates`), MTP blocks are not built.
- routing order: top-k experts come unsorted (`sorted=False`); the adapter orders them by weight (dsv4
  orders them by biased score; equal while the selection bias is zero).
transformers is optional: without it, `runner` raises UserError with the install hint.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.layouts.hf_config import to_hf_json
from ..errors import UserError
from .capture import Stages


def _require_transformers():
    try:
        import transformers
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError:
        raise UserError(
            "the Hugging Face adapter needs transformers with DeepSeek-V4 support (`pip install 'transformers>=5.5'`)"
        ) from None
    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


def hf_config(cfg):
    """A transformers DeepseekV4Config equivalent to a dsv4 ModelConfig (no MTP)."""
    _, DeepseekV4Config, _ = _require_transformers()
    heavy = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r and r != 4})
    if len(heavy) > 1:
        raise UserError(f"transformers allows one heavy compression rate, the config has {heavy}")
    raw = to_hf_json(cfg) if not heavy or heavy == [128] else None
    if raw is None:  # a shrunk check config: set the rates explicitly
        raw = to_hf_json(cfg.replace(compress_ratios=tuple(128 if r > 4 else r for r in cfg.compress_ratios)))
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    raw["num_nextn_predict_layers"] = 0
    raw["compress_rates"] = {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": heavy[0] if heavy else 128,
    }
    raw["max_position_embeddings"] = max(raw.get("max_position_embeddings", 0), cfg.original_seq_len)
    hc = DeepseekV4Config(**raw)
    hc._attn_implementation = "eager"
    return hc


@torch.no_grad()
def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """dsv4 state dict (main model, no MTP) -> transformers parameter names (the HF layout's `to_hf`)."""
    from ..checkpoint.layouts.hf import HFLayout

    return HFLayout.to_hf(model.state_dict())


def build_hf_model(model: nn.Module) -> nn.Module:
    """transformers DeepseekV4ForCausalLM (fp32, eval) holding model's weights."""
    _, _, DeepseekV4ForCausalLM = _require_transformers()
    hc = hf_config(model.cfg)
    with torch.random.fork_rng():  # its random init is overwritten; keep the caller's RNG
        hf = DeepseekV4ForCausalLM(hc).float().eval()
    sd = hf_state_dict(model)
    own = hf.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise UserError(
            f"weight mapping to transformers incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise UserError(f"transformers tensor '{k}' has shape {list(own[k].shape)}, dsv4 gives {list(v.shape)}")
    hf.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)
    return hf


class HFRunner:
    """tokens -> (logits, stages with dsv4 names). `force` = dsv4 stages whose indexer top-k to impose."""

    def __init__(self, hf: nn.Module):
        self.hf = hf
        self.stages: Stages = {}
        self.force: Stages | None = None
        self.flips: dict[str, float] = {}
        self._hooks()

    def _put(self, name: str, t: torch.Tensor) -> None:
        self.stages[name] = t.detach().clone()

    def _hooks(self) -> None:
        m = self.hf.model
        m.embed_tokens.register_forward_hook(lambda mod, i, o: self._put("embed", o))
        for i, layer in enumerate(m.layers):
            p = f"layers.{i}"
            layer.input_layernorm.register_forward_hook(lambda mod, inp, o, p=p: self._put(f"{p}.hc_attn_pre", inp[0]))
            layer.post_attention_layernorm.register_forward_hook(
                lambda mod, inp, o, p=p: self._put(f"{p}.hc_ffn_pre", inp[0])
            )
            layer.self_attn.register_forward_hook(lambda mod, inp, o, p=p: self._put(f"{p}.attn.out", o[0]))
            comp = layer.self_attn.compressor
            if comp is not None:
                comp.register_forward_hook(
                    lambda mod, inp, o, p=p: self._put(f"{p}.attn.compressed_kv", o[0].squeeze(1))
                )
                if hasattr(comp, "indexer"):
                    comp.indexer.register_forward_hook(lambda mod, inp, o, p=p: self._indexer(p, o))
            layer.mlp.gate.register_forward_hook(
                lambda mod, inp, o, p=p: self._router(p, o, hashed=hasattr(mod, "tid2eid"))
            )
            layer.mlp.register_forward_hook(lambda mod, inp, o, p=p: self._put(f"{p}.ffn.out", o))
            layer.register_forward_hook(lambda mod, inp, o, p=p: self._put(f"{p}.hc_ffn_post", o))

    def _indexer(self, p: str, out: torch.Tensor) -> torch.Tensor | None:
        name = f"{p}.attn.indexer.topk"
        self._put(name, out)
        want = (self.force or {}).get(name)
        if want is not None and want.shape == out.shape:
            return want.to(out.dtype)
        return None

    def _router(self, p: str, out, hashed: bool) -> None:
        _, weights, indices = out
        if hashed:  # table order, as in dsv4
            self._put(f"{p}.ffn.router_indices", indices)
            self._put(f"{p}.ffn.router_weights", weights)
            return
        order = torch.sort(weights, dim=-1, descending=True, stable=True).indices
        self._put(f"{p}.ffn.router_indices", indices.gather(-1, order))
        self._put(f"{p}.ffn.router_weights", weights.gather(-1, order))

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Stages]:
        self.stages = {}
        logits = self.hf(input_ids=tokens.long(), use_cache=False).logits.float()
        self.stages["head.logits"] = logits.detach().clone()
        return logits, dict(self.stages)


def runner(model: nn.Module) -> HFRunner:
    """`--external hf`: transformers' DeepseekV4ForCausalLM on this model's weights."""
    if model.cfg.fp8_kv_sim or model.cfg.fp4_indexer_sim:
        raise UserError(
            "transformers' DeepSeek-V4 simulates no FP8 KV / FP4 indexer quantization: build the "
            "dsv4 side with fp8_kv_sim=False and fp4_indexer_sim=False"
        )
    return HFRunner(build_hf_model(model))
