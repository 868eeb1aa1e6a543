"""Regenerate the golden fixtures of `dsv4 check conformance` (check `official-goldens`) from the official
DeepSeek-V4 inference code.

The official code is not part of this repository: fetch it separately (the public copy used here is
`Nicooo-Wang/DeepSeek-V4-Pro-code`, commit 20746603cee2244bb42104dc0057b66bdaf656d2, its `inference/`
folder: `model.py` and the pure-torch `kernel.py`) and pass that folder:

    python3 scripts/official_goldens.py --official /path/to/DeepSeek-V4-Pro-code/inference

For each case (a small model with window-only, CSA + indexer and HCA layers, a hash-routed layer, MoE
and mHC; BF16 weights, and FP8 weights with MXFP4 experts; and a one-layer model with an MTP block, whose
`MTPBlock.forward` the script calls on the main model's last hidden state) it builds the official
`Transformer` on the CPU, fills its parameters from a fixed seed, runs one prefill and writes
`dsv4/assets/goldens/<case>/`: `config.json` (inference keys), `model0-mp1.safetensors` (the weights in
the official inference layout) and `golden.safetensors` (input tokens, the per-layer attention and MoE
outputs and the logits). The model runs in float32 activations (`torch.set_default_dtype(float32)` for
the non-quantized parameters: weights hold bf16-representable values), so the fixture numbers carry
fp32 rounding only.

Where the pure-torch port differs from the original kernels it is corrected here, outside the official
code: its in-place QAT round trips (`act_quant(..., inplace=True)` for the KV, `fp4_act_quant` for the
indexer) clamp and rescale without rounding; the original kernels round to E4M3 / E2M1, so the shim
below rounds (round to nearest, ties to even) before rescaling. `rotate_activation` asserts bf16 input
(its fast kernel's dtype); the shim applies the same Hadamard rotation to the fp32 activations.
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
OFFICIAL_COMMIT = "20746603cee2244bb42104dc0057b66bdaf656d2"

# few Sinkhorn iterations (the release has 20): far from converged, so the iteration count shows in the
# numbers; expert gate / up projections large enough that the SwiGLU clamp (10) acts on both sides.
# small shapes with every component of the main model: layer 0 window-only (hash-routed), 1 CSA +
# indexer, 2 HCA; MoE with a shared expert and mHC everywhere (the official forward runs no MTP block)
ARGS = dict(
    vocab_size=256,
    dim=128,
    n_layers=3,
    n_hash_layers=1,
    n_mtp_layers=0,
    n_heads=2,
    n_routed_experts=4,
    n_shared_experts=1,
    n_activated_experts=2,
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    head_dim=128,
    rope_head_dim=64,
    norm_eps=1e-6,
    o_groups=2,
    window_size=16,
    compress_ratios=(0, 4, 128),
    compress_rope_theta=160000.0,
    original_seq_len=65536,
    rope_theta=10000.0,
    rope_factor=16.0,
    beta_fast=32,
    beta_slow=1,
    index_n_heads=8,
    index_head_dim=128,
    index_topk=8,
    hc_mult=4,
    hc_sinkhorn_iters=4,
    hc_eps=1e-6,
    max_batch_size=1,
    max_seq_len=256,
)
# FP8 activations are quantized in blocks of 128: every FP8 / FP4 GEMM input is a multiple of 128 wide
CASES = {
    "bf16": dict(
        dtype="bf16",
        scale_fmt=None,
        expert_dtype=None,
        scale_dtype="fp32",
        moe_inter_dim=32,
        q_lora_rank=64,
        o_lora_rank=32,
    ),
    "fp8-fp4": dict(
        dtype="fp8",
        scale_fmt="ue8m0",
        expert_dtype="fp4",
        scale_dtype="fp8",
        moe_inter_dim=128,
        q_lora_rank=128,
        o_lora_rank=64,
    ),
    # the multi-token-prediction block, which the official forward does not run: one hash-routed
    # window-only main layer and one MTP block (window-only: its compress ratio is the list's last
    # entry), BF16 weights; `MTPBlock.forward` is called on the main model's last hidden state
    "mtp": dict(
        dtype="bf16",
        scale_fmt=None,
        expert_dtype=None,
        scale_dtype="fp32",
        moe_inter_dim=32,
        q_lora_rank=64,
        o_lora_rank=32,
        n_layers=1,
        n_mtp_layers=1,
        compress_ratios=(0, 0),
    ),
}
# stored in float32 in the release (everything else that is not FP8 / FP4 is BF16)
F32_LEAVES = ("attn_sink", "ape", "bias")
EXPERT_GAIN = 12.0  # routed experts' w1 / w3: pre-activations of several units, past +-10 at times
SEQ = 132  # > 128: one HCA entry; 33 CSA groups; window 16


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), ties to the even code."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = v.abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - grid).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    # ties: the even code (codes 0, 2, 4, 6 -> grid indices with index % 2 == 0)
    even = cand & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1))
    return grid[idx] * v.sign()


def install_shim(kernel, model) -> None:
    """The original kernels' rounding in the in-place round trips (see the module docstring)."""
    port_act_quant = kernel.act_quant

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
        if not inplace:
            return port_act_quant(x, block_size, scale_fmt, scale_dtype)
        xb = x.float().unflatten(-1, (-1, block_size))
        amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        s = amax * (1.0 / 448.0)
        if scale_fmt is not None or scale_dtype == torch.float8_e8m0fnu:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        x.copy_((round_e4m3(xb / s) * s).flatten(-2).to(x.dtype))
        return x

    def fp4_act_quant(x, block_size=32, inplace=True):
        assert inplace
        xb = x.float().unflatten(-1, (-1, block_size))
        amax = xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
        s = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / 6.0))))
        x.copy_((round_e2m1(xb / s) * s).flatten(-2).to(x.dtype))
        return x

    def rotate_activation(x):
        # the same normalized Walsh-Hadamard rotation; the official function asserts bf16 input only because
        # its fast kernel takes bf16, and these fixtures run in fp32
        return kernel.hadamard_transform(x, scale=x.size(-1) ** -0.5)

    model.act_quant = act_quant
    model.fp4_act_quant = fp4_act_quant
    model.rotate_activation = rotate_activation


def fill(model, seed: int) -> None:
    """Deterministic parameters: bf16-representable values; FP8 / FP4 weights as codes plus scales."""
    from dsv4 import formats as fm

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.float8_e8m0fnu:
                continue  # set with its weight
            if p.dtype == torch.int32:
                e = ARGS["n_routed_experts"]
                p.copy_(torch.stack([torch.randperm(e, generator=g)[: p.size(1)] for _ in range(p.size(0))]))
                continue
            gain = EXPERT_GAIN if ".experts." in name and (".w1." in name or ".w3." in name) else 1.0
            if p.dtype == torch.float8_e4m3fn:
                w = torch.randn(p.shape, generator=g) * gain / math.sqrt(p.size(1))
                q, s = fm.quantize_fp8(w, scale_fmt="ue8m0")
                p.copy_(q.view(torch.float8_e4m3fn))
                p.scale.copy_(s.view(torch.float8_e8m0fnu))
                continue
            if p.dtype == torch.float4_e2m1fn_x2:
                w = torch.randn(p.size(0), p.size(1) * 2, generator=g) * gain / math.sqrt(p.size(1) * 2)
                q, s = fm.quantize_mxfp4(w)
                p.view(torch.int8).copy_(q.view(torch.int8))
                p.scale.copy_(s.view(torch.float8_e8m0fnu))
                continue
            if "norm" in name or leaf == "weight" and p.dim() == 1:
                v = 1 + 0.1 * torch.randn(p.shape, generator=g)
            elif leaf == "attn_sink":
                v = 0.5 * torch.randn(p.shape, generator=g)
            elif leaf.startswith("hc_") and leaf.endswith("_scale"):
                v = 0.5 + 0.1 * torch.randn(p.shape, generator=g)
            elif leaf.startswith("hc_") and leaf.endswith("_base"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif leaf.startswith("hc_"):
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.size(-1))
            elif leaf in ("ape", "bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) * gain / math.sqrt(p.size(-1))
            p.copy_(v.bfloat16().to(p.dtype))


def run_case(official: Path, case: str, out: Path) -> None:
    sys.path.insert(0, str(official))
    import kernel
    import model as om

    install_shim(kernel, om)
    torch.manual_seed(0)
    args = om.ModelArgs(**{**ARGS, **CASES[case]})
    with om.set_dtype(torch.float32):
        net = om.Transformer(args)
    fill(net, seed=1)
    for prm in net.parameters():  # bf16 values, held and computed in fp32
        if prm.dtype == torch.bfloat16:
            prm.data = prm.data.float()
    stages: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(net.layers):
        hooks.append(
            layer.attn.register_forward_hook(
                lambda m, a, o, i=i: stages.__setitem__(f"layers.{i}.attn.out", o.float().clone())
            )
        )
        hooks.append(
            layer.ffn.register_forward_hook(
                lambda m, a, o, i=i: stages.__setitem__(f"layers.{i}.ffn.out", o.float().clone())
            )
        )
    tokens = torch.randint(2, args.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(2))
    hidden: list[torch.Tensor] = []
    hooks.append(net.head.register_forward_pre_hook(lambda m, a: hidden.append(a[0].clone())))
    logits = net(tokens)
    for h in hooks:
        h.remove()
    for k, block in enumerate(net.mtp):
        # depth k combines the hidden state at t with the embedding of token t+1 (its input_ids); the
        # positions that have a next token: the first SEQ - 1 - k. Its head returns the last position's
        # logits (the prediction of the token after the last input)
        n = SEQ - 1 - k
        h_in = hidden[-1][:, :n]
        hooks = [
            block.attn.register_forward_hook(
                lambda m, a, o, k=k: stages.__setitem__(f"mtp.{k}.attn.out", o.float().clone())
            ),
            block.ffn.register_forward_hook(
                lambda m, a, o, k=k: stages.__setitem__(f"mtp.{k}.ffn.out", o.float().clone())
            ),
        ]
        stages[f"mtp.{k}.logits"] = block(h_in, 0, tokens[:, k + 1 :]).float().clone()
        for h in hooks:
            h.remove()
    d = out / case
    d.mkdir(parents=True, exist_ok=True)
    # parameters only (no caches); the MTP block's embedding and head are the main model's (not stored)
    state = {}
    for k, v in net.named_parameters():
        if k.startswith("mtp.") and (".embed." in k or ".head." in k):
            continue
        leaf = k.rsplit(".", 1)[-1]
        if v.dtype == torch.float32 and not (leaf in F32_LEAVES or leaf.startswith("hc_")):
            v = v.bfloat16()  # exact: the values are bf16
        state[k] = v.detach().contiguous()
    save_file(state, str(d / "model0-mp1.safetensors"))
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in {**ARGS, **CASES[case]}.items()}
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    golden = {"tokens": tokens.to(torch.int64), "logits": logits.float().contiguous()}
    golden.update({k: v.contiguous() for k, v in stages.items()})
    save_file(golden, str(d / "golden.safetensors"), metadata={"official_commit": OFFICIAL_COMMIT, "case": case})
    sys.path.remove(str(official))
    for m in ("model", "kernel"):
        sys.modules.pop(m, None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--official", required=True, type=Path, help="the official code's inference/ folder")
    p.add_argument("--out", type=Path, default=ROOT / "dsv4" / "assets" / "goldens")
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    if not (a.official / "model.py").is_file() or not (a.official / "kernel.py").is_file():
        print(f"error: {a.official} holds no model.py and kernel.py (the official inference/ folder)", file=sys.stderr)
        return 2
    for case in a.cases.split(","):
        run_case(a.official, case, a.out)
        print(f"wrote {a.out / case}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
