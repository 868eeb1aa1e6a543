"""W8A8: the official numerics of FP8 / FP4 checkpoints, against an independent computation.

The independent side is written here from the format definitions: the E4M3 grid from its bit fields, the
activation scale amax * fp32(1/448) rounded up to a power of two with frexp (or kept, for scale_fmt null),
round to nearest with ties to the even code, and the placement rule "every weight the checkpoint stores
with a block scale, except the grouped output projection wo_a". It patches those projections of the
float source model (whose weights the checkpoint holds exactly) and replaces its routed experts by a
per-token loop. Both sides run under `exact_accumulation` (float64 sums, one rounding to fp32), so the
comparison does not depend on summation order and a quantization step cannot flip on a last-bit
difference: they must agree to fp32 rounding, while W8A16 differs from both by the activation rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_checkpoint_helpers import RoutedBy, make_representable, tiny_model, tokens

from dsv4 import ops
from dsv4.checkpoint import load_pretrained, model_values, save
from dsv4.checkpoint.safetensors_io import read_header
from dsv4.ops.precision import exact_accumulation

BLOCK = 128


# ----------------------------------------------------------------------------- the formats, independently
def e4m3_grid() -> torch.Tensor:
    """The non-negative finite E4M3 values by code 0..126 (sign 0; exponent bias 7, 3 mantissa bits,
    exponent 0 subnormal, code 127 NaN), from the bit fields."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


GRID = e4m3_grid()


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-448, 448] -> nearest E4M3 value (ties to the even code), float64."""
    a = v.double().abs().unsqueeze(-1)
    dist = (a - GRID).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    codes = torch.arange(GRID.numel())
    code = torch.where(tied, codes + 1000 * (codes % 2), 10**6).argmin(-1)  # lowest even among ties
    return torch.copysign(GRID[code], v.double())


def round_trip(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """W8A8 activation quantization of x [..., n] per token in blocks of 128 (the last one ragged), back to
    x's dtype: scale s = amax * fp32(1/448) (amax floored at 1e-4), rounded up to a power of two (pow2)."""
    n = x.size(-1)
    out = torch.empty_like(x)
    inv = torch.tensor(1 / 448, dtype=torch.float32)
    for lo in range(0, n, BLOCK):
        blk = x[..., lo : lo + BLOCK].float()
        s = blk.abs().amax(-1, keepdim=True).clamp_min(1e-4) * inv
        if pow2:
            m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
            s = torch.where(m == 0.5, 2.0 ** (e - 1).double(), 2.0 ** e.double()).float()
        q = to_e4m3((blk / s).clamp(-448, 448))
        out[..., lo : lo + BLOCK] = (q * s.double()).to(x.dtype)
    return out


def quantized_weights(ckpt) -> set[str]:
    """Official names (without `.weight`) of the weights the checkpoint stores with a block scale."""
    names = set()
    for f in ckpt.glob("*.safetensors"):
        names |= {n[: -len(".scale")] for n in read_header(f)[0] if n.endswith(".scale")}
    return names


def independent(source, ckpt, pow2: bool):
    """The source model (exact dequantized weights) with W8A8 placed on every weight stored quantized."""
    import copy

    model = copy.deepcopy(source)
    quant = quantized_weights(ckpt)

    def lin(x, w):
        return F.linear(x.double(), w.double()).to(x.dtype)

    for name in sorted(quant):
        if ".experts." in name and ".shared_experts." not in name or name.endswith(".attn.wo_a"):
            continue  # routed experts below; wo_a runs in bf16
        mod = model.get_submodule(name)
        mod.forward = lambda x, w=mod.weight: lin(round_trip(x, pow2), w)
    for i, layer in enumerate(list(model.layers) + list(model.mtp)):
        prefix = f"layers.{i}" if i < len(model.layers) else f"mtp.{i - len(model.layers)}"
        if f"{prefix}.ffn.experts.0.w1" not in quant:
            continue
        ex = layer.ffn.experts
        limit = ex.swiglu_limit

        def routed(x, weights, indices, ex=ex, limit=limit):
            y = torch.zeros(x.shape, dtype=torch.float32)
            for t in range(x.size(0)):
                for k in range(indices.size(1)):
                    e = int(indices[t, k])
                    xq = round_trip(x[t : t + 1], pow2)
                    gate = lin(xq, ex.w1[e]).float().clamp(max=limit)
                    up = lin(xq, ex.w3[e]).float().clamp(-limit, limit)
                    h = (F.silu(gate) * up * weights[t, k]).to(x.dtype)
                    y[t] += lin(round_trip(h, pow2), ex.w2[e])[0].float()
            return y

        layer.ffn.set_submodule("experts", RoutedBy(routed))
    return model


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=["fp8", "fp4"])
def quantized(request, tmp_path_factory):
    """(source model, checkpoint dir): FP8 linears + FP8 or MXFP4 experts holding the source exactly."""
    experts = request.param
    src = make_representable(tiny_model(seed=3), "fp8", experts)
    d = save(
        model_values(src),
        src.cfg,
        tmp_path_factory.mktemp(f"w8a8_{experts}") / "ckpt",
        "fp8",
        expert_dtype=experts if experts == "fp4" else None,
    )
    return src, d


def with_scale_fmt(ckpt, fmt, tmp_path):
    """A copy of the checkpoint directory whose config says scale_fmt `fmt` (weights unchanged)."""
    import shutil

    d = tmp_path / f"scale_{fmt}"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = fmt
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def run(model, toks):
    with torch.no_grad(), exact_accumulation():
        out = model(toks, mtp=True)
    return torch.cat([out.logits.flatten()] + [m.flatten() for m in out.mtp_logits])


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------- tests
def test_act_quant_matches_the_format_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.exp2(torch.randint(-12, 12, (5, 1), generator=g).float())
    x[0, :128] = 0.0  # amax floor
    x[1, :128] = torch.randn(128, generator=g) * 0.01
    x[1, 5] = 448.0 * 2.0**-3 * (1 + 2.0**-20)  # amax / 448 just above a power of two
    for pow2 in (True, False):
        q, s = ops.act_quant(x, BLOCK, pow2)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
        got = ops.reference.act_dequant(q, s, BLOCK)
        assert torch.equal(got, round_trip(x, pow2)), pow2
    # the power-of-two scale one ulp above 2^-3 * 448 is 2^-2, not 2^-3 (exact ceil, not log2 rounding)
    assert ops.act_quant(x, BLOCK, True)[1][1, 0] == 2.0**-2


@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "kept-quantized"])
@pytest.mark.parametrize("fmt", ["ue8m0", None], ids=["ue8m0", "fp32-scales"])
def test_w8a8_checkpoint_matches_independent_computation(quantized, keep, fmt, tmp_path):
    src, ckpt = quantized
    ckpt = ckpt if fmt == "ue8m0" else with_scale_fmt(ckpt, fmt, tmp_path)
    toks = tokens(24, seed=1)
    ops.reset_calls()
    model = load_pretrained(ckpt, dtype=torch.float32, keep_quantized=keep, progress=False)
    assert model.cfg.quant_mode == "w8a8" and model.cfg.scale_fmt == fmt
    got = run(model, toks)
    calls = {op for op, _ in ops.calls()}
    if keep:
        assert {"act_quant", "fp8_gemm", "quantized_moe_experts"} <= calls
    else:
        assert "fp8_round_trip" in calls
    src_fmt = src if fmt == "ue8m0" else _with_cfg(src, scale_fmt=None)
    want = run(independent(src_fmt, ckpt, pow2=fmt == "ue8m0"), toks)
    w8a16 = run(src_fmt, toks)
    err, effect = rel(got, want), rel(w8a16, want)
    assert err <= 1e-6, (err, effect)  # fp32 rounding (both sides round once per stage)
    assert effect > 1e-3, effect  # the activation quantization is really there


def _with_cfg(model, **changes):
    """A copy of a random model with config changes that do not touch its parameters (e.g. scale_fmt)."""
    import copy

    from dsv4.model import DeepSeekV4

    other = DeepSeekV4(model.cfg.replace(**changes))
    other.load_state_dict(copy.deepcopy(model.state_dict()))
    return other.eval()


def test_kept_quantized_and_dequantized_give_the_same_logits(quantized):
    _, ckpt = quantized
    toks = tokens(24, seed=2)
    a = run(load_pretrained(ckpt, dtype=torch.float32, keep_quantized=True, progress=False), toks)
    b = run(load_pretrained(ckpt, dtype=torch.float32, progress=False), toks)
    assert torch.equal(a, b)


def test_w8a16_switch_and_what_is_marked(quantized):
    from dsv4.model.quant import quantized_modules, set_quant_mode

    src, ckpt = quantized
    toks = tokens(24, seed=1)
    model = load_pretrained(ckpt, dtype=torch.float32, progress=False, quant_mode="w8a16")
    assert torch.equal(run(model, toks), run(src, toks))  # W8A16 = the float model exactly
    marked = quantized_modules(model)
    assert marked["layers.1.attn.wq_b"] == "fp8" and marked["layers.1.ffn.shared_experts.w2"] == "fp8"
    assert marked["layers.1.ffn.experts"] == ("fp4" if "fp4" in str(ckpt) else "fp8")
    assert "layers.1.ffn.gate" not in marked and "head" not in marked
    assert model.layers[1].attn.wo_a.act_format is None  # stored FP8, computed in bf16 officially
    set_quant_mode(model, "w8a8")
    assert model.cfg.quant_mode == "w8a8" and model.layers[1].attn.wq_b.act_format == "ue8m0"
    assert not torch.equal(run(model, toks), run(src, toks))


def test_kv_round_trip_follows_scale_fmt():
    """The FP8 KV simulation (blocks of 64 of the non-RoPE dims): power-of-two scales only for scale_fmt
    ue8m0, amax/448 when null - every call the attention and the compressors make says so."""
    seen: list[tuple[int, bool]] = []

    def spy(x, block=64, pow2=True, inplace=False):
        seen.append((block, pow2))
        return ops.reference.fp8_round_trip(x, block, pow2, inplace)

    m = tiny_model(seed=4)
    out = {}
    ops.register("fp8_round_trip", "spy", spy, priority=100)
    try:
        for fmt in ("ue8m0", None):
            seen.clear()
            with torch.no_grad():
                out[fmt] = _with_cfg(m, scale_fmt=fmt)(tokens(16, seed=3)).logits
            assert seen and set(seen) == {(64, fmt == "ue8m0")}, seen
    finally:
        ops.unregister("fp8_round_trip", "spy")
    assert not torch.equal(out["ue8m0"], out[None])


def test_cli_switch_and_compare_stage_by_stage(quantized, capsys):
    """`--quant-mode` is in --help of the commands that load checkpoints; `dsv4 check compare --quant-modes`
    shows the effect stage by stage, `--quantized` that kept-quantized equals dequantized under W8A8."""
    from dsv4.cli import main

    for cmd in (["generate"], ["check", "teacher-forcing"], ["check", "compare"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert "--quant-mode" in capsys.readouterr().out, cmd
    _, ckpt = quantized
    args = ["check", "compare", "--model", str(ckpt), "--seq-len", "20", "--json"]
    assert main([*args, "--quant-modes", "w8a8,w8a16"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["first_divergence"] == "layers.0.attn.q" and rep["a"] == "W8A8"
    assert main([*args, "--quantized"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and "both sides W8A8" in rep["notes"]
    assert main([*args, "--quantized", "--quant-mode", "w8a16"]) == 0
    assert "both sides W8A16" in json.loads(capsys.readouterr().out)["notes"]
    assert main([*args, "--quant-modes", "w8a8,w4a4"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
