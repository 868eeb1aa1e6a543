"""Checkpoints written by Hugging Face transformers load with transformers' semantics and its logits.

transformers simulates no quantization-aware training, so an "hf"-layout directory loads with both QAT
simulations off; and any configuration transformers accepts loads, including dimensions those simulations
could not block (a 16-dim rotary slice of a 128-dim head, the default rotary fraction 64/512; an indexer
head as wide as the rotary slice). Plain `load_pretrained(DIR)`: no flags (the default dtype: fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.checkpoint import load_pretrained, read_config, to_hf_json
from dsv4.config import ConfigError, ModelConfig

transformers = pytest.importorskip("transformers", reason="optional dependency 'transformers' not installed")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM", allow_module_level=True)

BASE = dict(
    vocab_size=256,
    hidden_size=128,
    moe_intermediate_size=64,
    num_attention_heads=4,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    index_n_heads=4,
    index_topk=16,
    sliding_window=8,
    max_position_embeddings=4096,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    num_hidden_layers=3,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
)

CONFIGS = {
    # transformers' default rotary fraction: 128 * 64/512 = 16 rotary dims, 112 non-rotary (not 64-blockable)
    "default-rotary-fraction": dict(head_dim=128, index_head_dim=64),
    # the indexer head exactly as wide as the rotary slice
    "index-dim-equals-rope": dict(head_dim=128, partial_rotary_factor=0.5, index_head_dim=64),
    # a non-power-of-two indexer head (no Hadamard / FP4 blocks needed without the simulation), YaRN rope
    "odd-indexer-yarn": dict(
        head_dim=64,
        partial_rotary_factor=0.25,
        index_head_dim=48,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 256,
        },
    ),
}


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Weights with unit-scale activations (transformers' init is std 0.02 and zero sinks / biases / hash
    table, which would make a weak comparison)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(b.size(0))]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.01 * torch.randn(b.shape, generator=g))


def hf_checkpoint(tmp_path, name: str):
    cfg = transformers.DeepseekV4Config(**BASE, **CONFIGS[name])
    with torch.random.fork_rng():
        hf = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    randomize(hf, seed=len(name))
    d = tmp_path / name
    hf.save_pretrained(d)
    return hf, d


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_checkpoint_loads_plainly_and_matches_its_logits(tmp_path, name):
    hf, d = hf_checkpoint(tmp_path, name)
    model = load_pretrained(d)
    cfg = model.cfg
    assert model.checkpoint_plan["layout"] == "hf"
    assert not cfg.fp8_kv_sim and not cfg.fp4_indexer_sim  # transformers' semantics
    assert model.embed.weight.dtype == torch.float32  # the default dtype
    assert cfg.rope_head_dim == hf.config.qk_rope_head_dim and cfg.compress_ratios[:3] == (0, 4, 8)
    toks = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=toks, use_cache=False).logits.float()
        got = model(toks).logits
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-4, err


def test_simulations_that_cannot_block_say_which_and_why(tmp_path):
    _, d = hf_checkpoint(tmp_path, "default-rotary-fraction")
    with pytest.raises(Exception, match=r"fp8_kv_sim.*112.*multiple of 64"):
        load_pretrained(d, fp8_kv_sim=True)
    raw = to_hf_json(ModelConfig.preset("tiny").replace(fp8_kv_sim=False, fp4_indexer_sim=False, index_head_dim=96))
    assert read_config(raw, overrides={"fp4_indexer_sim": False}).index_head_dim == 96
    with pytest.raises(ConfigError, match=r"fp4_indexer_sim.*96.*Hadamard"):
        read_config(raw)
