"""Regenerate the DSpark golden fixture of `dsv4 check conformance` (check `dspark-goldens`) from public
reference code: the official DeepSeek-V4 inference code and DeepSeek's DeepSpec.

    python3 scripts/dspark_goldens.py --official /path/to/DeepSeek-V4-Pro-code/inference --deepspec /path/to/DeepSpec

- `--official`: the official inference code's `inference/` folder (`model.py`, the pure-torch `kernel.py`),
  the public copy `Nicooo-Wang/DeepSeek-V4-Pro-code` at the commit `official_goldens.py` names. Its
  `Transformer` runs the main model; its `Block` (mHC, window attention projections, MoE), `RMSNorm`,
  `Linear`, `ParallelHead.hc_head`, `apply_rotary_emb`, `act_quant` and `sparse_attn` are the draft's stages.
- `--deepspec`: a checkout of `deepseek-ai/DeepSpec` (MIT): its `VanillaMarkov`
  (`deepspec/modeling/dspark/markov_head.py`) draws the block's tokens (greedy) with the Markov bias, its
  `AcceptRatePredictor` (`deepspec/modeling/dspark/common.py`, bias held at zero: the V4 head has none) is
  the confidence head and `_confident_prefix_length` (`deepspec/eval/dspark/draft_ops.py`) the
  per-position verify length. Only these definitions are executed (the packages' `__init__`s import the
  Qwen3 / Gemma stacks, which are not needed).

What Flash-0731 adds to the official code - `DSparkAttention` (the context keys from main_x through the
stage's own wkv / kv_norm / RoPE / FP8 round trip written to the window ring, the key set of
`get_dspark_topk_idxs`: the ring, then every key of the block), the taps (mean over the mHC copies of
the target layers' outputs), `forward_embed` (anchor + noise tokens) and `forward_head` (the last stage's
HC head, norm, the shared head) - ships with the release's weights, not in a GitHub repository; it is
written out below in terms of the official primitives, as the public ports of it describe it
(`dsv4/model/dspark.py` names them). Each anchor p runs as the release runs a draft step: a prefill of
main_x at positions 0 .. p-2 (the ring fill of `start_pos == 0`), then the block at start_pos = p - 1.

Writes `dsv4/assets/goldens/dspark/`: `config.json` (inference keys, with the `dspark_*` keys and the
stages as `n_mtp_layers`), `model0-mp1.safetensors` (the weights in the official inference layout, the
draft under `mtp.*` as the release names it) and `golden.safetensors`: tokens, anchors, the taps, every
stage's attention and MoE output for each block, the base logits, the Markov-corrected logits, the greedy
drafts, the confidence logits and the per-position verify length at threshold 0.5. The QAT round trips
round as the original kernels do (`official_goldens.install_shim`).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import typing
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from official_goldens import F32_LEAVES, OFFICIAL_COMMIT, fill, install_shim  # noqa: E402

# a hash-routed and a score-routed main layer (window-only: the draft reads outputs, not caches), two
# draft stages, blocks of 4; window 16 over 40 tokens so blocks see partial and full windows
ARGS = dict(
    vocab_size=256,
    dim=128,
    n_layers=2,
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
    compress_ratios=(0, 0, 0, 0),
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
    dtype="bf16",
    scale_fmt=None,
    expert_dtype=None,
    scale_dtype="fp32",
    moe_inter_dim=32,
    q_lora_rank=64,
    o_lora_rank=32,
)
DRAFT = dict(
    stages=2, dspark_block_size=4, dspark_noise_token_id=3, dspark_target_layer_ids=(0, 1), dspark_markov_rank=16
)
SEQ = 40
ANCHORS = (2, 9, 17, 30, 39)  # anchor positions p: context p-16 .. p-1 (partial windows first)
THRESHOLD = 0.5


def deepspec_defs(root: Path, rel: str, names: tuple[str, ...], ns: dict) -> dict:
    """Execute only the named top-level definitions of a DeepSpec source file into ns."""
    tree = ast.parse((root / rel).read_text(), rel)
    keep = [n for n in tree.body if getattr(n, "name", None) in names]
    missing = set(names) - {n.name for n in keep}
    if missing:
        raise SystemExit(f"error: {root / rel} defines no {sorted(missing)} (a different DeepSpec?)")
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(root / rel), "exec"), ns)
    return ns


def dspark_attention(om, attn, x, start_pos: int, main_x: torch.Tensor) -> torch.Tensor:
    """Flash-0731's `DSparkAttention.forward` in the official primitives (see the module docstring)."""
    bsz, seqlen, _ = main_x.size()
    win, rd = attn.window_size, attn.rope_head_dim
    ring = attn.kv_cache[:, :win]
    main_kv = attn.kv_norm(attn.wkv(main_x))
    om.apply_rotary_emb(main_kv[..., -rd:], attn.freqs_cis[start_pos : start_pos + seqlen])
    om.act_quant(main_kv[..., :-rd], 64, om.scale_fmt, om.scale_dtype, True)
    if start_pos == 0:  # prefill: fill the ring, no output
        if seqlen <= win:
            ring[:bsz, :seqlen] = main_kv
        else:
            cutoff = seqlen % win
            ring[:bsz, cutoff:win], ring[:bsz, :cutoff] = main_kv[:, -win:].split([win - cutoff, cutoff], dim=1)
        return x
    block = x.size(1)
    freqs = attn.freqs_cis[start_pos + seqlen : start_pos + seqlen + block]
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (attn.n_local_heads, attn.head_dim))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + attn.eps)
    om.apply_rotary_emb(q[..., -rd:], freqs)
    kv = attn.kv_norm(attn.wkv(x))
    om.apply_rotary_emb(kv[..., -rd:], freqs)
    om.act_quant(kv[..., :-rd], 64, om.scale_fmt, om.scale_dtype, True)
    ring[:bsz, start_pos % win] = main_kv.squeeze(1)
    topk = torch.cat([torch.arange(min(win, start_pos + 1)), win + torch.arange(block)])
    topk = topk.int().view(1, 1, -1).expand(bsz, block, -1).contiguous()
    o = om.sparse_attn(q, torch.cat([ring[:bsz], kv], dim=1), attn.attn_sink, topk, attn.softmax_scale)
    om.apply_rotary_emb(o[..., -rd:], freqs, True)
    o = o.view(bsz, block, attn.n_local_groups, -1)
    o = torch.einsum("bsgd,grd->bsgr", o, attn.wo_a.weight.view(attn.n_local_groups, attn.o_lora_rank, -1))
    return attn.wo_b(o.flatten(2))


def run(official: Path, deepspec: Path, out: Path, deepspec_commit: str | None = None) -> None:
    sys.path.insert(0, str(official))
    import kernel
    import model as om

    install_shim(kernel, om)
    heads: dict = {"torch": torch, "nn": nn, "Optional": typing.Optional}
    deepspec_defs(deepspec, "deepspec/utils/sampling.py", ("sample_tokens",), heads)
    deepspec_defs(deepspec, "deepspec/modeling/dspark/markov_head.py", ("VanillaMarkov",), heads)
    deepspec_defs(deepspec, "deepspec/modeling/dspark/common.py", ("AcceptRatePredictor",), heads)
    deepspec_defs(deepspec, "deepspec/eval/dspark/draft_ops.py", ("_confident_prefix_length",), heads)

    torch.manual_seed(0)
    S, B, n = DRAFT["stages"], DRAFT["dspark_block_size"], ARGS["n_layers"]
    targets, rank = DRAFT["dspark_target_layer_ids"], DRAFT["dspark_markov_rank"]
    args = om.ModelArgs(**ARGS)
    with om.set_dtype(torch.float32):
        net = om.Transformer(args)
        draft = nn.Module()
        draft.stages = nn.ModuleList(om.Block(n + k, args) for k in range(S))
        draft.main_proj = om.Linear(args.dim * len(targets), args.dim)
        draft.main_norm = om.RMSNorm(args.dim, args.norm_eps)
        draft.norm = om.RMSNorm(args.dim, args.norm_eps)
        draft.hc_head_fn = nn.Parameter(torch.empty(args.hc_mult, args.hc_mult * args.dim))
        draft.hc_head_base = nn.Parameter(torch.empty(args.hc_mult))
        draft.hc_head_scale = nn.Parameter(torch.empty(1))
        draft.markov_head = heads["VanillaMarkov"](vocab_size=args.vocab_size, markov_rank=rank)
        draft.confidence_head = heads["AcceptRatePredictor"](args.dim + rank)
    fill(net, seed=1)
    fill(draft, seed=2)
    with torch.no_grad():
        draft.confidence_head.proj.bias.zero_()  # the V4 confidence head has no bias
        draft.confidence_head.proj.weight.mul_(2.0**-6)  # logits of a few units: probabilities
        # strictly inside (0, 1), so the verify
        # length depends on them (exact in bf16)
    for prm in [*net.parameters(), *draft.parameters()]:  # bf16 values, held and computed in fp32
        if prm.dtype == torch.bfloat16:
            prm.data = prm.data.float()
    tokens = torch.randint(4, args.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(3))

    golden: dict[str, torch.Tensor] = {
        "tokens": tokens.to(torch.int64),
        "anchors": torch.tensor([ANCHORS], dtype=torch.int64),
    }
    with torch.inference_mode():
        h = net.embed(tokens).unsqueeze(2).repeat(1, 1, args.hc_mult, 1)
        taps = []
        for i, layer in enumerate(net.layers):
            h = layer(h, 0, tokens)
            if i in targets:
                taps.append(h.mean(dim=2))  # Flash-0731: the target layers' outputs
        golden["logits"] = net.head(h, net.hc_head_fn, net.hc_head_scale, net.hc_head_base, net.norm).float()
        golden["taps"] = torch.cat(taps, -1).float()
        main_x = draft.main_norm(draft.main_proj(torch.cat(taps, -1)))
        rows: dict[str, list[torch.Tensor]] = {}
        for p in ANCHORS:
            for stage in draft.stages:
                stage.attn.kv_cache.zero_()
                dspark_attention(om, stage.attn, None, 0, main_x[:, : p - 1])  # ring: positions 0 .. p-2
            ids = torch.full((1, B), DRAFT["dspark_noise_token_id"], dtype=torch.long)
            ids[:, 0] = tokens[:, p]
            x = net.embed(ids).unsqueeze(2).repeat(1, 1, args.hc_mult, 1)
            for k, stage in enumerate(draft.stages):
                stage.attn.forward = lambda y, start_pos, a=stage.attn, mx=main_x[:, p - 1 : p]: dspark_attention(
                    om, a, y, start_pos, mx
                )
                hooks = [
                    stage.attn.register_forward_hook(
                        lambda m, a, o, k=k: rows.setdefault(f"mtp.{k}.attn.out", []).append(o.float())
                    ),
                    stage.ffn.register_forward_hook(
                        lambda m, a, o, k=k: rows.setdefault(f"mtp.{k}.ffn.out", []).append(o.float())
                    ),
                ]
                x = stage(x, p - 1, ids)
                for hk in hooks:
                    hk.remove()
            hid = net.head.hc_head(x, draft.hc_head_fn, draft.hc_head_scale, draft.hc_head_base)  # [1, B, dim]
            base = F.linear(draft.norm(hid).float(), net.head.weight)
            drafts, logits = draft.markov_head.sample_block_tokens(
                base, first_prev_token_ids=ids[:, 0], hidden_states=None, temperature=0.0
            )
            prev = torch.cat([ids[:, :1], drafts[:, :-1]], 1)
            emb = draft.markov_head.get_prev_embeddings(prev)
            conf = draft.confidence_head(torch.cat([hid.float(), emb.float()], -1)).float()
            length = heads["_confident_prefix_length"](conf, block_size=B, threshold=THRESHOLD)
            for name, t in (
                ("dspark.base_logits", base),
                ("dspark.logits", logits),
                ("dspark.tokens", drafts),
                ("dspark.confidence", conf),
                ("dspark.verify_length", torch.tensor([length])),
            ):
                rows.setdefault(name, []).append(t)
        golden.update({k: torch.cat(v, 0).contiguous() for k, v in rows.items()})

    d = out / "dspark"
    d.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in net.named_parameters():
        if not k.startswith("mtp."):
            state[k] = v
    last = f"mtp.{S - 1}"
    for k, v in draft.named_parameters():
        if k.startswith("stages."):
            i, rest = k[len("stages.") :].split(".", 1)
            name = f"mtp.{i}.{rest}"
        elif k.startswith("main_"):
            name = f"mtp.0.{k}"
        elif k == "confidence_head.proj.bias":
            continue
        else:
            name = f"{last}.{k}"
        state[name] = v
    for k, v in list(state.items()):
        leaf = k.rsplit(".", 1)[-1]
        if v.dtype == torch.float32 and not (leaf in F32_LEAVES or leaf.startswith("hc_")):
            v = v.bfloat16()  # exact: the values are bf16
        state[k] = v.detach().contiguous()
    save_file(state, str(d / "model0-mp1.safetensors"))
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ARGS.items()}
    cfg.update(
        n_mtp_layers=S,
        compress_ratios=[0] * (n + S),
        dspark_block_size=B,
        dspark_noise_token_id=DRAFT["dspark_noise_token_id"],
        dspark_target_layer_ids=list(targets),
        dspark_markov_rank=rank,
    )
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    save_file(
        golden,
        str(d / "golden.safetensors"),
        metadata={
            "official_commit": OFFICIAL_COMMIT,
            "deepspec_commit": deepspec_commit or _commit(deepspec),
            "case": "dspark",
            "threshold": str(THRESHOLD),
        },
    )
    sys.path.remove(str(official))
    for m in ("model", "kernel"):
        sys.modules.pop(m, None)


def _commit(repo: Path) -> str:
    head = repo / ".git" / "HEAD"
    if not head.is_file():
        return "unknown"
    ref = head.read_text().strip()
    if ref.startswith("ref: "):
        f = repo / ".git" / ref[5:]
        return f.read_text().strip() if f.is_file() else "unknown"
    return ref


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--official", required=True, type=Path, help="the official code's inference/ folder")
    p.add_argument("--deepspec", required=True, type=Path, help="a checkout of deepseek-ai/DeepSpec")
    p.add_argument("--deepspec-commit", help="the DeepSpec commit, when --deepspec is not a git checkout")
    p.add_argument("--out", type=Path, default=ROOT / "dsv4" / "assets" / "goldens")
    a = p.parse_args()
    if not (a.official / "model.py").is_file() or not (a.official / "kernel.py").is_file():
        print(f"error: {a.official} holds no model.py and kernel.py (the official inference/ folder)", file=sys.stderr)
        return 2
    if not (a.deepspec / "deepspec" / "modeling" / "dspark" / "markov_head.py").is_file():
        print(
            f"error: {a.deepspec} is not a DeepSpec checkout (no deepspec/modeling/dspark/markov_head.py)",
            file=sys.stderr,
        )
        return 2
    run(a.official, a.deepspec, a.out, a.deepspec_commit)
    print(f"wrote {a.out / 'dspark'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
