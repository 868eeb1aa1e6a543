"""Format and checkpoint checks: FP4 / E8M0 bytes, checkpoint round trips, expert-parallel ranges and the
goldens of the official code, transformers and the DSpark draft."""

from __future__ import annotations

import copy

import torch

from ...config import ModelConfig
from ...model import DeepSeekV4
from ...ops import reference as ref
from .. import goldens
from ..inputs import moe_inputs
from ..result import CheckResult
from .context import (
    Context,
    rel_err,
    tolerance,
)


# ------------------------------------------------------------------------------ formats
def fp4_known_bytes(ctx: Context) -> CheckResult:
    """Bytes 0x21, 0x43 are codes 1, 2, 3, 4 (low nibble first); dequantized values follow."""
    from ...formats import fp4

    dev = ctx.device
    packed = torch.tensor([[0x21, 0x43] + [0x00] * 14], dtype=torch.uint8, device=dev).view(torch.int8)
    codes = fp4.unpack_fp4(packed)
    want = torch.tensor([1, 2, 3, 4] + [0] * 28, dtype=codes.dtype, device=dev)
    if not torch.equal(codes[0], want):
        return CheckResult(False, float((codes[0] != want).float().mean()), f"decoded codes {codes[0, :6].tolist()}")
    scale = torch.tensor([[127]], dtype=torch.uint8, device=dev)  # 2^0
    deq = fp4.dequantize_mxfp4(packed, scale)
    want_v = torch.tensor([0.5, 1.0, 1.5, 2.0] + [0.0] * 28, device=dev)
    err = float((deq[0] - want_v).abs().max())
    return CheckResult(err == 0, err, "known bytes decode bit-exactly")


def e8m0_bytes(ctx: Context) -> CheckResult:
    """Every scale byte b decodes to 2^(b-127), and an FP8 block dequantizes with exactly that scale."""
    from ...formats import e8m0, fp8

    dev = ctx.device
    b = torch.arange(0, 255, dtype=torch.uint8, device=dev)
    got = e8m0.e8m0_decode(b)
    want = torch.exp2(b.double() - 127)
    err = float(((got.double() - want).abs() / want).max())
    if err:
        return CheckResult(False, err, f"byte 130 decodes to {float(got[130])}, want 8.0")
    q = fp8.e4m3_encode(torch.ones(4, 4, device=dev))
    deq = fp8.dequantize_fp8(q, torch.tensor([[130]], dtype=torch.uint8, device=dev))
    err = float((deq - 8.0).abs().max())
    return CheckResult(err == 0, err, "scale bytes decode bit for bit")


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_roundtrip(ctx: Context) -> CheckResult:
    """Save a tiny model as an FP8 release checkpoint, load it back: the load validates every tensor's
    shape and format (a refusal counts as caught), and every loaded weight equals what the format defines
    (FP8 linears = dequant(quant(w)) with E8M0 block scales, BF16 dense weights, F32 exact)."""
    import tempfile

    from ... import formats as fm
    from ...checkpoint import CheckpointError, load_pretrained, model_values, save
    from ...checkpoint.names import EXPERT, F32, INT, LINEAR, official_tensors, to_model

    cfg = ModelConfig.preset("tiny").replace(n_mtp_layers=0, compress_ratios=(0, 4, 128, 4))
    src = DeepSeekV4.from_config(cfg, seed=ctx.seed)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            save(model_values(src), cfg, tmp, target="fp8", overwrite=True)
            loaded = load_pretrained(tmp, dtype=torch.float32)
        except CheckpointError as e:
            return CheckResult(False, None, f"load refused the checkpoint: {str(e)[:200]}")
    want_sd, got_sd = src.state_dict(), loaded.state_dict()
    worst, worst_name = 0.0, ""
    for name, spec in official_tensors(cfg, mtp=False).items():
        mname, j = to_model(name)
        w, g = want_sd[mname], got_sd[mname]
        if j is not None:
            w, g = w[j], g[j]
        if spec.role in (LINEAR, EXPERT):
            q, sc = fm.quantize_fp8(w.float())
            w = fm.dequantize_fp8(q, sc)
        elif spec.role not in (F32, INT):
            w = w.bfloat16()
        err = rel_err(g.float(), w.float()) if w.is_floating_point() else float(not torch.equal(g, w))
        if err > worst:
            worst, worst_name = err, name
    ok = worst <= 1e-6
    return CheckResult(
        ok,
        worst,
        "loaded weights equal their stored format"
        if ok
        else f"loaded '{worst_name}' differs from its stored value (rel {worst:.3g})",
        device="cpu (checkpoint files are written and read on the host)",
    )


def ep_ranges(ctx: Context) -> CheckResult:
    """Expert parallelism in one process on a fake 2-rank group, as rank 1: the rank holds experts
    [E/2, E) and its partial MoE output equals the reference restricted to them."""

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ...train import distributed as ep

    if dist.is_initialized():
        return CheckResult(False, None, "a process group is already initialized in this process")
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        model = copy.deepcopy(ctx.model)
        ep.shard_experts(model, mode="all_reduce")
        rank, world = dist.get_rank(), dist.get_world_size()
        inp = moe_inputs(ctx.cfg, tokens=8, seed=ctx.seed, device=ctx.device, dtype=ctx.model_dtype)
        tol = tolerance(ctx.model_dtype, 1e-5)
        for i, layer in enumerate(model.layers):
            full = ctx.model.layers[i].ffn.experts
            e = full.w1.size(0)
            lo, hi = rank * e // world, (rank + 1) * e // world
            ex = layer.ffn.experts
            if ex.offset != lo or not torch.equal(ex.w1, full.w1[lo:hi]):
                return CheckResult(
                    False,
                    float(abs(ex.offset - lo)),
                    f"layers.{i}: rank {rank} holds experts from {ex.offset}, expected [{lo}, {hi})",
                )
            with torch.no_grad():
                got = layer.ffn.experts(inp["x"], inp["weights"], inp["indices"])
            want = ref.moe_experts(
                inp["x"].float(),
                inp["weights"],
                inp["indices"],
                full.w1[lo:hi].float(),
                full.w2[lo:hi].float(),
                full.w3[lo:hi].float(),
                ctx.cfg.swiglu_limit,
                lo,
            )
            err = rel_err(got, want)
            if err > tol:
                return CheckResult(False, err, f"layers.{i}: rank {rank}'s expert output vs reference")
    except RuntimeError as e:
        return CheckResult(False, None, f"expert parallelism refused: {str(e)[:160]}")
    finally:
        dist.destroy_process_group()
    return CheckResult(True, 0.0, "rank 1 of 2 holds and serves experts [E/2, E) in every layer")


def _golden_verdict(rows, against: str) -> CheckResult:
    """One verdict over golden stage rows (`goldens.compare_case`): the first stage off, or the worst fit."""
    worst = max(rows, key=lambda r: r.error / r.tol)
    bad = [r for r in rows if not r.ok]
    if bad:
        first = bad[0]
        return CheckResult(
            False,
            first.error,
            f"{len(bad)} of {len(rows)} stages off {against}; first: "
            f"{first.case} {first.stage} {first.error:.3g} > {first.tol:.3g}",
        )
    return CheckResult(
        True,
        worst.error,
        f"{len(rows)} stages within tolerance of {against} (worst {worst.case} "
        f"{worst.stage}: {worst.error:.2g} <= {worst.tol:.2g})",
    )


def official_goldens(ctx: Context) -> CheckResult:
    """Every stage of every golden case (`dsv4.check.goldens`) within its tolerance of the numbers the
    official inference code produced."""
    rows = [r for case in goldens.CASES for r in goldens.compare_case(case, ctx.device)]
    return _golden_verdict(rows, f"the official numbers ({len(goldens.CASES)} cases)")


def transformers_goldens(ctx: Context) -> CheckResult:
    """Every stage of the transformers golden case within the fp32 tolerance of the numbers transformers'
    `DeepseekV4ForCausalLM` produced, its checkpoint loaded through dsv4's loader (transformers layout)."""
    case = goldens.TRANSFORMERS_CASE
    version = goldens.fixture_metadata(case).get("transformers_version", "?")
    return _golden_verdict(goldens.compare_case(case, ctx.device), f"transformers {version}'s numbers")


def dspark_goldens(ctx: Context) -> CheckResult:
    """The DSpark draft (`dsv4.model.dspark`) against the fixture the reference code produced: every
    stage, the drafts, their confidence and the verify length (`goldens.compare_dspark`)."""
    return _golden_verdict(goldens.compare_dspark(ctx.device), "the DSpark reference's numbers")
