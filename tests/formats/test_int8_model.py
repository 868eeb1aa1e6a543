"""INT8 mode on whole models (`quant_mode="int8"`, `dsv4.model.int8`): which weights it covers, against an
independent computation, loading from FP8 + MXFP4 and BF16 checkpoints, memory, teacher forcing, the CLI.

The independent side patches the float source model: every projection INT8 mode covers computes, from the
definitions written out here, q = round(x / s) per token and per weight row (s = amax / 127 in fp32),
integer sums (int64), fp32(acc) * s_x * s_w; the experts' SwiGLU in fp32 from the fp32 gate and up,
quantized again before the down projection. Those are the same fp32 operations in the same order as the
package's, and everything else is the same code on both sides, so the logits must agree bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_checkpoint_helpers import RoutedBy, make_representable, tiny_model, tokens
from test_int8 import gemm_exact, quant_rows

from dsv4 import ops
from dsv4.checkpoint import load_pretrained, model_values, official_tensors, save
from dsv4.checkpoint.names import EXPERT, LINEAR
from dsv4.model import DeepSeekV4
from dsv4.model.int8 import Int8Experts, Int8Linear, int8_modules, quantize_int8
from dsv4.model.quant import set_quant_mode
from dsv4.ops.precision import exact_accumulation


def int8_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    wq, ws = quant_rows(w)
    q, s = quant_rows(x)
    return gemm_exact(q, s, wq, ws.squeeze(-1)).to(out_dtype)


def independent(source):
    """The float model with INT8 W8A8 placed on every weight a release stores quantized except wo_a."""
    model = copy.deepcopy(source)
    covered = {
        n[: -len(".weight")]
        for n, spec in official_tensors(model.cfg).items()
        if spec.role == LINEAR and not n.endswith("attn.wo_a.weight")
    }
    for name in sorted(covered):
        mod = model.get_submodule(name)
        mod.forward = lambda x, w=mod.weight: int8_linear(x, w, x.dtype)
    for layer in list(model.layers) + list(model.mtp):
        ex, sh = layer.ffn.experts, layer.ffn.shared_experts
        lim = ex.swiglu_limit

        def swiglu(x, w1, w2, w3, weight, lim=lim):
            gate = int8_linear(x, w1, torch.float32).clamp(max=lim)
            up = int8_linear(x, w3, torch.float32).clamp(-lim, lim)
            return int8_linear(F.silu(gate) * up * weight, w2, torch.float32)

        def routed(x, weights, indices, ex=ex, swiglu=swiglu):
            y = torch.zeros(x.shape)
            for t in range(x.size(0)):
                for k in range(indices.size(1)):
                    e = int(indices[t, k])
                    y[t] += swiglu(x[t : t + 1], ex.w1[e], ex.w2[e], ex.w3[e], weights[t, k])[0]
            return y

        layer.ffn.set_submodule("experts", RoutedBy(routed))
        sh.forward = lambda x, sh=sh, swiglu=swiglu: swiglu(x, sh.w1.weight, sh.w2.weight, sh.w3.weight, 1.0).to(
            x.dtype
        )
    return model


def run(model, toks):
    with torch.no_grad(), exact_accumulation():
        out = model(toks, mtp=True)
    return torch.cat([out.logits.flatten()] + [m.flatten() for m in out.mtp_logits])


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------- placement and numerics
def test_int8_covers_what_a_release_stores_quantized_but_wo_a():
    model = DeepSeekV4.from_config(tiny_model().cfg.replace(quant_mode="int8"), seed=0)
    specs = official_tensors(model.cfg)
    linears = {n[: -len(".weight")] for n, s in specs.items() if s.role == LINEAR} - {
        n for n in (m[: -len(".weight")] for m in specs) if n.endswith("attn.wo_a")
    }
    experts = {n.split(".experts.")[0] + ".experts" for n, s in specs.items() if s.role == EXPERT}
    got = int8_modules(model)
    assert set(got) == linears | experts
    assert all(isinstance(model.get_submodule(n), Int8Linear) for n in linears)
    assert all(isinstance(model.get_submodule(n), Int8Experts) for n in experts)
    assert type(model.layers[1].attn.wo_a).__name__ == "Linear"
    for m in model.modules():  # one byte per weight, one fp32 scale per output row
        if isinstance(m, Int8Linear):
            assert m.weight_q.dtype == torch.int8 and m.scale.shape == (m.out_features,)
        if isinstance(m, Int8Experts):
            assert m.w2_q.dtype == torch.int8 and m.w2_scale.shape == m.w2_q.shape[:2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_model_matches_independent_computation(dtype):
    src = (
        tiny_model(seed=5).to(dtype)
        if dtype == torch.float32
        else DeepSeekV4.from_config(tiny_model().cfg, seed=5, dtype=dtype).eval()
    )
    toks = tokens(24, seed=2)
    want = run(independent(src), toks)
    ops.reset_calls()
    model = quantize_int8(copy.deepcopy(src))
    got = run(model, toks)
    calls = {op for op, _ in ops.calls()}
    assert {"int8_quant", "int8_gemm", "int8_moe_experts"} <= calls and "fp8_gemm" not in calls
    assert torch.equal(got, want)
    assert rel(run(src, toks), want) > 1e-3  # the INT8 rounding is really there


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def fp8_fp4(tmp_path_factory):
    """(source model, checkpoint): FP8 linears and MXFP4 experts holding the source exactly."""
    src = make_representable(tiny_model(seed=3), "fp8", "fp4")
    d = save(model_values(src), src.cfg, tmp_path_factory.mktemp("int8") / "ckpt", "fp8", expert_dtype="fp4")
    return src, d


def test_int8_load_requantizes_fp8_and_fp4_as_they_stream(fp8_fp4):
    src, ckpt = fp8_fp4
    model = load_pretrained(ckpt, quant_mode="int8", progress=False)
    assert model.cfg.quant_mode == "int8"
    formats = int8_modules(model)
    assert formats["layers.1.attn.wq_b"] == "fp8" and formats["layers.1.ffn.shared_experts.w2"] == "fp8"
    assert formats["layers.1.ffn.experts"] == "fp4" and formats["mtp.0.e_proj"] == "fp8"
    toks = tokens(24, seed=1)
    # streaming requantization = requantizing the exactly dequantized model afterwards = the definition
    assert torch.equal(run(model, toks), run(independent(src), toks))
    with pytest.raises(ValueError, match="loaded again"):
        set_quant_mode(model, "w8a8")


def test_int8_load_from_bf16_and_memory(fp8_fp4, tmp_path):
    src, _ = fp8_fp4
    bf16 = make_representable(tiny_model(seed=8), "bf16")
    d = save(model_values(bf16), bf16.cfg, tmp_path / "bf16", "bf16")
    model = load_pretrained(d, quant_mode="int8", progress=False)
    assert set(int8_modules(model).values()) == {"float"}
    assert torch.equal(run(model, tokens(16)), run(quantize_int8(copy.deepcopy(bf16)), tokens(16)))
    float_bytes = sum(
        p.numel() * p.element_size()
        for n, p in bf16.named_parameters()
        if n in {f"{m}.weight" for m in int8_modules(model)} or ".experts.w" in n
    )
    int8_bytes = sum(
        b.numel() * b.element_size() for m in int8_modules(model) for b in model.get_submodule(m).buffers()
    )
    n_weights = float_bytes // 4
    rows = sum(
        b.numel() for m in int8_modules(model) for n, b in model.get_submodule(m).named_buffers() if "scale" in n
    )
    assert int8_bytes == n_weights + 4 * rows  # 1 byte per weight + an fp32 per row


def test_int8_teacher_forcing_and_random_weights():
    from dsv4.check.inputs import check_config
    from dsv4.check.teacher_forcing import teacher_forcing

    model = DeepSeekV4.from_config(check_config("tiny").replace(quant_mode="int8"), seed=1).eval()
    toks = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    rep = teacher_forcing(model, toks, 5)
    assert rep.ok, rep.max_rel_error


def test_int8_cli(fp8_fp4, capsys):
    import json

    from dsv4.cli import main

    _, ckpt = fp8_fp4
    for cmd in (["generate"], ["eval", "heldout"], ["check", "teacher-forcing"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert "--quant {w8a8,w8a16,int8}" in capsys.readouterr().out, cmd
    assert (
        main(
            [
                "generate",
                "--model",
                str(ckpt),
                "--quant",
                "int8",
                "--prompt-ids",
                "0,5,9",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) == 4
    assert main(["generate", "--preset", "tiny", "--quant", "int9", "hi"]) == 2
    assert "invalid choice: 'int9'" in capsys.readouterr().err


def test_int8_serving_engine_batching_does_not_change_tokens():
    """`dsv4 serve --quant int8` builds its engine on the INT8 model; per-token activation scales and exact
    INT32 sums keep a request's greedy tokens the same alone and among others (deterministic mode)."""
    from test_engine import greedy, run

    from dsv4.loading import ModelSource
    from dsv4.serve.startup import EngineSpec, load, make_engine

    spec = EngineSpec(
        ModelSource(preset="tiny", device="cpu", dtype="fp32", quant_mode="int8"),
        max_num_seqs=4,
        max_model_len=256,
        deterministic=True,
        cuda_graphs=False,
        detokenize=False,
    )
    model, tokenizer, _name, _desc = load(spec)  # what the server's engine process loads and builds
    engine = make_engine(spec, model, tokenizer)
    assert engine.model is model and int8_modules(model) and str(engine.device) == "cpu"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 30, 17)]
    alone = [run(model, [p], [greedy()], max_seqs=1, page_size=128)[0][0] for p in prompts]
    busy, _, _ = run(model, prompts, [greedy()] * 3, arrivals=[0, 2, 1], max_batch_tokens=11, page_size=128)
    assert busy == alone
