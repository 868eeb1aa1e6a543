"""Regenerate the transformers golden fixture of `dsv4 check conformance` (check `transformers-goldens`).

Hugging Face transformers' `DeepseekV4ForCausalLM` is a second implementation written without this
repository. This script builds a small model in transformers' own semantics (its `DeepseekV4Config` keys:
a sliding-window layer with hash routing, a compressed-sparse-attention layer with the Lightning Indexer,
a heavily-compressed layer, MoE with a shared expert, mHC), fills its parameters from a fixed seed,
runs one prefill of 132 tokens in float32 and writes `dsv4/assets/goldens/transformers/`:

- `checkpoint/` (`config.json`, `model.safetensors`): `save_pretrained`'s output, i.e. transformers' checkpoint layout
  (the release tensor names under `model.`, per-expert w1 / w2 / w3). The parameters hold
  bf16-representable values and are saved as bf16 (exact, half the bytes);
- `golden.safetensors`: the input tokens, every layer's attention output and MoE output at every
  position, and the logits of the last position, computed in float32. Its metadata records the
  transformers and torch versions.

    python3 scripts/transformers_goldens.py [--out DIR]

Where transformers' semantics differ from the official inference code (and so from dsv4's defaults):
it simulates no quantization-aware training (no FP8 round trip of the KV, no FP4 round trip and no
Hadamard rotation in the indexer), it builds no multi-token-prediction block, and it returns the routed
experts unsorted. The check loads this directory with dsv4's checkpoint loader, which takes a transformers
directory in transformers' semantics (both simulations off); the expert order does not change a sum.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
SEQ = 132  # > 128: one HCA entry; 33 CSA groups; window 16
EXPERT_GAIN = 12.0  # routed experts' gate / up: pre-activations past the SwiGLU limit (10) at times
CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=128,
    q_lora_rank=64,
    partial_rotary_factor=0.5,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    hc_mult=4,
    hc_sinkhorn_iters=4,
    hc_eps=1e-6,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=8,
    index_head_dim=128,
    index_topk=8,
    num_nextn_predict_layers=0,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def fill(model: torch.nn.Module, seed: int) -> None:
    """Deterministic parameters by transformers' names: bf16-representable values at scales that keep the
    activations of order one (the default initializer's 0.02 would leave the softmaxes near uniform)."""
    g = torch.Generator().manual_seed(seed)
    e, k = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"]
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b.size(0))]))
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "gate_up_proj":
                v = torch.randn(p.shape, generator=g) * EXPERT_GAIN / math.sqrt(p.size(-1))
            elif "norm" in name or (leaf == "weight" and p.dim() == 1):
                v = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif leaf == "sinks":
                v = 0.5 * torch.randn(p.shape, generator=g)
            elif "hc" in name and leaf.endswith("scale"):
                v = 0.5 + 0.1 * torch.randn(p.shape, generator=g)
            elif "hc" in name and leaf.endswith("base"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif leaf in ("position_bias", "e_score_correction_bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.size(-1))
            p.copy_(v.bfloat16().to(p.dtype))


def run(out: Path) -> None:
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(SEED)
    cfg = DeepseekV4Config(**CONFIG)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    fill(model, SEED)
    stages: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(
            lambda mod, inp, o, i=i: stages.__setitem__(f"layers.{i}.attn.out", o[0].detach().clone())
        )
        layer.mlp.register_forward_hook(
            lambda mod, inp, o, i=i: stages.__setitem__(f"layers.{i}.ffn.out", o.detach().clone())
        )
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(SEED + 1))
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits.float()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out / "checkpoint")  # the values are bf16: exact
    golden = {
        "tokens": tokens.to(torch.int32),
        "logits": logits[:, -1].contiguous(),
        **{k: v.float().contiguous() for k, v in sorted(stages.items())},
    }
    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "seed": str(SEED),
        "dtype": "float32",
        "attn_implementation": "eager",
    }
    save_file(golden, str(out / "golden.safetensors"), metadata=meta)
    (out / "checkpoint" / "generation_config.json").unlink(missing_ok=True)
    for f in [*out.glob("*.*"), *(out / "checkpoint").glob("*.*")]:
        f.chmod(0o644)
    print(json.dumps(meta))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "dsv4" / "assets" / "goldens" / "transformers")
    a = p.parse_args()
    try:
        import transformers  # noqa: F401
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        print("error: needs transformers with DeepSeek-V4 support (pip install 'transformers>=5.5')", file=sys.stderr)
        return 2
    run(a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
