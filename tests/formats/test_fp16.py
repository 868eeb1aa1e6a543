"""FP16 compute (`--dtype fp16`): the experts' gate and up leave their GEMM in fp32 (a gate below -65504
would otherwise become -inf, and silu(-inf) NaN), teacher forcing agrees, `dsv4 check ranges` reports the
ranges and fails on an overflow.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from dsv4 import ops
from dsv4.check.inputs import check_config
from dsv4.cli import main
from dsv4.model import DeepSeekV4
from dsv4.ops import reference as R

FP16_MAX = 65504.0


def overflow_case(e: int = 4, d: int = 32, inter: int = 16, t: int = 4) -> dict:
    """fp16 experts whose gate pre-activation on channel 0 is -256 * 512 = -131072 for every token (beyond
    FP16's range) and on channel 1 +131072, every product exact in fp16; the other channels are small."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(t, d, generator=g) * 0.25).half()
    x[:, 0] = 256.0
    w1 = (torch.randn(e, inter, d, generator=g) * 0.25).half()
    w1[:, :, 0] = 0.0
    w1[:, 0, 0], w1[:, 1, 0] = -512.0, 512.0
    w3 = (torch.randn(e, inter, d, generator=g) * 0.25).half()
    w2 = (torch.randn(e, d, inter, generator=g) * 0.25).half()
    idx = torch.stack([torch.arange(2) + i % (e - 1) for i in range(t)])
    return dict(x=x, weights=torch.full((t, 2), 0.75), indices=idx, w1=w1, w2=w2, w3=w3, swiglu_limit=10.0)


def formula(case: dict) -> torch.Tensor:
    """The clamped SwiGLU in float64 from the fp16 values (then w2 of the fp16-rounded activation)."""
    y = torch.zeros(case["x"].shape, dtype=torch.float64)
    lim = case["swiglu_limit"]
    for t in range(case["x"].size(0)):
        for k in range(2):
            e = int(case["indices"][t, k])
            x = case["x"][t].double()
            gate = (case["w1"][e].double() @ x).clamp(max=lim)
            up = (case["w3"][e].double() @ x).clamp(-lim, lim)
            h = (F.silu(gate) * up * case["weights"][t, k]).half()
            y[t] += case["w2"][e].double() @ h.double()
    return y


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_fp16_experts_gate_beyond_fp16_range_stays_finite(backend):
    case = overflow_case()
    assert float(case["w1"][0, 0].float() @ case["x"][0].float()) < -FP16_MAX
    got = ops.moe_experts(**case, backend=backend)
    assert bool(torch.isfinite(got).all())
    want = formula(case)
    # the activation h (|h| <= silu(10) * 10 * 0.75 < 75) may round to a neighbouring fp16 value (2^-10
    # relative) on either side, and w2's fp16 output rounds once more (2^-11 relative): per element at most
    # 2^-10 * 75 * sum_j |w2_ij| over the token's two experts, plus 2^-10 |y|
    w2_rows = sum(case["w2"][e].double().abs().sum(-1) for e in range(case["w1"].size(0)))  # [d], >= 2 slots
    bound = 2.0**-10 * 75 * w2_rows + 2.0**-10 * want.abs()
    assert bool(((got.double() - want).abs() <= bound).all())
    # the same GEMMs rounded to fp16 first (what the guard prevents) give NaN
    gate16 = F.linear(case["x"].float(), case["w1"][0].float()).half().float()
    assert bool(torch.isnan(F.silu(gate16.clamp(max=10.0))).any())


def test_fp16_shared_expert_and_w8a8_experts_keep_gate_in_fp32():
    from dsv4.model.moe import Expert

    case = overflow_case()
    cfg = check_config("tiny").replace(dim=32, moe_inter_dim=16)
    shared = Expert(cfg).half()
    with torch.no_grad():
        for w in ("w1", "w2", "w3"):
            getattr(shared, w).weight.copy_(case[w][0])
        out = shared(case["x"])
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    # W8A8 on FP8 weights kept quantized: gate / up from fp8_gemm in fp32 for fp16 activations
    from dsv4 import formats

    q = {w: [formats.quantize_fp8(case[w][e].float()) for e in range(4)] for w in ("w1", "w2", "w3")}
    stack = {w: (torch.stack([a for a, _ in q[w]]), torch.stack([b for _, b in q[w]])) for w in q}
    got = R.quantized_moe_experts(
        case["x"],
        case["weights"],
        case["indices"],
        stack["w1"][0],
        stack["w1"][1],
        stack["w2"][0],
        stack["w2"][1],
        stack["w3"][0],
        stack["w3"][1],
        10.0,
    )
    assert bool(torch.isfinite(got).all())


def test_fp16_teacher_forcing_and_model_dtype():
    from dsv4.check.teacher_forcing import teacher_forcing

    model = DeepSeekV4.from_config(check_config("tiny"), seed=2, dtype=torch.float16).eval()
    assert model.embed.weight.dtype == torch.float16 and model.head.weight.dtype == torch.float32
    toks = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    rep = teacher_forcing(model, toks, 5)
    assert rep.ok, rep.max_rel_error
    with torch.no_grad():
        assert bool(torch.isfinite(model(toks).logits).all())


def test_check_ranges_reports_and_fails_on_overflow(capsys):
    assert main(["check", "ranges", "--preset", "tiny", "--seq-len", "24", "--batch", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fp16 = [r for r in out["rows"] if r["in_fp16"]]
    assert out["ok"] and fp16 and all(r["margin"] > 1 for r in fp16)
    assert any(r["module"] == "layers.*.attn.wq_b" and r["op"] == "mm" for r in fp16)
    assert any(r["module"] == "layers.*.attn_norm" and not r["in_fp16"] for r in out["rows"])  # fp32 island

    from dsv4.check.ranges import activation_ranges

    m32 = DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()
    with torch.no_grad():
        m32.layers[1].attn_norm.weight.mul_(1e5)  # fp32 weight: its fp16 output overflows
    m16 = copy.deepcopy(m32).half()
    for name, p in m16.named_parameters():
        if dict(m32.named_parameters())[name].dtype == torch.float32 and "norm" in name:
            p.data = dict(m32.named_parameters())[name].data.clone()
    rep = activation_ranges(m32, m16, torch.randint(0, 1024, (1, 24), generator=torch.Generator().manual_seed(0)))
    assert not rep.ok and any("attn_norm" in b for b in rep.nonfinite_fp16)


def test_fp16_cli_choices(capsys):
    for cmd in (["generate"], ["serve"], ["eval", "heldout"], ["check", "conformance"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert "fp16" in capsys.readouterr().out, cmd
