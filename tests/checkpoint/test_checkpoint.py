"""Checkpoints in the three layouts load into the model they were written from, bit for bit."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from test_checkpoint_helpers import logits, make_representable, rewrite, tiny_model, tokens

from dsv4 import formats as fm
from dsv4.checkpoint import convert, load_pretrained, model_values, read_config_file, save
from dsv4.checkpoint.inspect import expected_report, inspect_dir
from dsv4.checkpoint.layouts import expected_tensors
from dsv4.checkpoint.safetensors_io import iter_file, read_header
from dsv4.config import ModelConfig


@pytest.fixture(scope="module")
def source():
    """A tiny model whose weights are exactly representable as FP8 (+E8M0) linears, MXFP4 experts and
    BF16 dense weights, with its reference logits (main and MTP)."""
    m = make_representable(tiny_model(seed=1), "fp8", "fp4")
    return m, logits(m, tokens())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, source):
    m, _ = source
    root = tmp_path_factory.mktemp("ckpt")
    out = {
        "bf16": save(model_values(m), m.cfg, root / "bf16", "bf16", shard_bytes=1 << 20),
        "fp8": save(model_values(m), m.cfg, root / "fp8", "fp8", expert_dtype="fp4", shard_bytes=1 << 20),
        "fp4-experts": save(model_values(m), m.cfg, root / "fp4e", "bf16", expert_dtype="fp4"),
    }
    out["root"] = root
    return out


# The checkpoints hold the source model's weights exactly; compared with the float source model bit for bit,
# they load with W8A16 numerics (W8A8 quantizes the activations: tests/formats/test_w8a8.py).
W8A16 = {"quant_mode": "w8a16"}
# an HF-layout directory gets transformers' semantics unless asked; the source model simulates QAT
OFFICIAL = {"fp8_kv_sim": True, "fp4_indexer_sim": True}


def same(model, ref, mtp: bool = True) -> bool:
    got = logits(model, tokens())
    ok = torch.equal(got[0], ref[0])
    if mtp:
        ok = ok and len(got[1]) == len(ref[1]) > 0 and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    return ok


def headers(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(read_header(f)[0])
    return out


def inventory(path) -> dict:
    return {k: (v.shape, v.dtype) for k, v in headers(path).items()}


def test_written_inventories_are_the_expected_ones(ckpts, tmp_path):
    cfg = read_config_file(ckpts["fp8"] / "config.json")
    assert cfg.dtype == "fp8" and cfg.expert_dtype == "fp4" and cfg.scale_fmt == "ue8m0"
    assert inventory(ckpts["fp8"]) == expected_tensors(cfg, "release")
    bf = read_config_file(ckpts["bf16"] / "config.json")
    assert bf.dtype == "bf16" and inventory(ckpts["bf16"]) == expected_tensors(bf, "release")
    hf = convert(ckpts["bf16"], tmp_path / "hf", "hf", progress=False)
    assert inventory(hf) == expected_tensors(bf, "hf")


def test_release_bf16_sharded(ckpts, source):
    d = ckpts["bf16"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    h = headers(d)
    assert h["head.weight"].dtype == "BF16" and h["hc_head_fn"].dtype == "F32" and "head.scale" not in h
    assert not any(n.endswith(".scale") for n in h)
    assert same(load_pretrained(d, dtype=torch.float32, progress=False), source[1])


def test_release_fp8_e8m0_mxfp4(ckpts, source):
    d = ckpts["fp8"]
    h = headers(d)
    assert h["layers.1.attn.wq_b.weight"].dtype == "F8_E4M3"
    assert h["layers.1.attn.wq_b.scale"].dtype == "F8_E8M0" and h["layers.1.attn.wq_b.scale"].shape == (4, 1)
    assert h["layers.1.ffn.experts.3.w1.weight"].dtype == "I8" and h["layers.1.ffn.experts.3.w1.weight"].shape == (
        64,
        64,
    )
    assert h["layers.1.ffn.experts.3.w1.scale"].shape == (64, 4)
    assert h["head.weight"].dtype == "BF16" and "head.scale" not in h
    model = load_pretrained(d, dtype=torch.float32, progress=False, **W8A16)
    assert same(model, source[1])
    bf = load_pretrained(d, dtype=torch.bfloat16, progress=False)
    assert bf.layers[1].attn.wq_b.weight.dtype == torch.bfloat16  # dtype argument honoured
    assert bf.head.weight.dtype == torch.float32  # fp32 by design


def test_keep_quantized_matches_dequantized(ckpts, source):
    from dsv4.checkpoint.quantized import QuantExperts, QuantLinear

    model = load_pretrained(ckpts["fp8"], dtype=torch.float32, keep_quantized=True, progress=False, **W8A16)
    assert isinstance(model.layers[1].attn.wq_b, QuantLinear) and model.layers[1].attn.wq_b.fmt == "fp8"
    assert isinstance(model.layers[1].ffn.experts, QuantExperts) and model.layers[1].ffn.experts.fmt == "fp4"
    assert model.layers[1].ffn.experts.w1_q.dtype == torch.uint8  # bytes kept, not dequantized
    assert same(model, source[1])


def test_scale_bytes_survive_load_and_save(ckpts, tmp_path, source):
    """FP8 -> FP8 conversion copies every weight and scale byte unchanged."""
    out = convert(ckpts["fp8"], tmp_path / "again", "fp8", progress=False)
    a, b = {}, {}
    for src, dst in ((ckpts["fp8"], a), (out, b)):
        for f in sorted(src.glob("*.safetensors")):
            for info, t in iter_file(read_header(f)[0]):
                dst[info.name] = (info.dtype, t.view(torch.uint8) if t.element_size() == 1 else t)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]), k
    sc = a["layers.1.attn.wq_b.scale"][1]
    w = source[0].layers[1].attn.wq_b.weight
    assert torch.equal(sc, fm.as_e8m0_bytes(fm.quantize_fp8(w)[1]))  # the bytes the format defines


def test_release_name_variants(ckpts, tmp_path, source):
    """`model.` prefix, self_attn/mlp, weight_scale_inv, e_score_correction_bias, MTP embed/head copies."""

    def rename(name, t):
        n = "model." + name.replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
        n = n.replace(".scale", ".weight_scale_inv").replace("gate.bias", "gate.e_score_correction_bias")
        return {n: t}

    extra = {
        "mtp.0.emb.tok_emb.weight": torch.zeros(1024, 128, dtype=torch.bfloat16),
        "mtp.0.head.weight": torch.zeros(1024, 128, dtype=torch.bfloat16),
        "mtp.0.embed.weight": torch.zeros(1024, 128, dtype=torch.bfloat16),
    }
    d = rewrite(ckpts["fp8"], tmp_path / "variants", rename, extra)
    assert "model.layers.1.self_attn.wq_b.weight_scale_inv" in headers(d)
    r = inspect_dir(d)
    assert r["ok"] and r["layout"] == "release" and len(r["ignored"]) == 3
    assert same(load_pretrained(d, dtype=torch.float32, progress=False, **W8A16), source[1])


def test_inference_layout_mp2(ckpts, tmp_path, source):
    d = convert(ckpts["fp4-experts"], tmp_path / "mp2", "inference", mp=2, progress=False)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    r0, r1 = read_header(d / files[0])[0], read_header(d / files[1])[0]
    assert r0["embed.weight"].shape == (512, 128) and r1["layers.0.attn.wo_b.weight"].shape == (128, 32)
    assert r0["layers.0.attn.attn_sink"].shape == (2,) and r0["layers.0.attn.wkv.weight"].shape == (128, 128)
    assert "layers.0.ffn.experts.3.w1.weight" in r0 and "layers.0.ffn.experts.4.w1.weight" not in r0
    assert "layers.0.ffn.experts.4.w1.weight" in r1
    if fm.HAS_FP4:
        assert r1["layers.0.ffn.experts.4.w1.weight"].dtype == "F4"
    assert inspect_dir(d)["ok"]
    assert same(load_pretrained(d, dtype=torch.float32, progress=False, **W8A16), source[1])


def test_inference_layout_fp8_mp1(ckpts, tmp_path, source):
    d = convert(ckpts["fp8"], tmp_path / "mp1", "inference", mp=1, progress=False)
    h = read_header(d / "model0-mp1.safetensors")[0]
    assert h["layers.1.attn.wq_b.weight"].dtype == "F8_E4M3"
    assert h["layers.1.attn.wo_a.weight"].dtype == "BF16" and "layers.1.attn.wo_a.scale" not in h
    assert same(load_pretrained(d, dtype=torch.float32, progress=False, **W8A16), source[1])
    back = convert(d, tmp_path / "back", "fp8", progress=False)  # inference -> release again
    assert same(load_pretrained(back, dtype=torch.float32, progress=False, **W8A16), source[1])


def test_hf_layout_written_here(ckpts, tmp_path, source):
    d = convert(ckpts["fp8"], tmp_path / "hf", "hf", progress=False)
    h = headers(d)
    assert h["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 128, 128)
    assert "model.layers.1.attn_hc.fn" in h and "model.layers.1.self_attn.sinks" in h
    assert "model.layers.1.self_attn.compressor.position_bias" in h and "lm_head.weight" in h
    model = load_pretrained(d, dtype=torch.float32, progress=False, **OFFICIAL)
    assert model.cfg.n_mtp_layers == 0  # transformers has no MTP
    assert same(model, source[1], mtp=False)


def test_hf_layout_written_by_transformers(ckpts, tmp_path, source):
    transformers = pytest.importorskip("transformers", reason="optional dependency 'transformers' not installed")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM")
    ours = convert(ckpts["bf16"], tmp_path / "hf_ours", "hf", progress=False)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ours, dtype=torch.float32)
    for original in (True, False):
        d = tmp_path / f"hf_saved_{original}"
        hf.save_pretrained(d, save_original_format=original)
        r = inspect_dir(d)
        assert r["ok"] and r["layout"] == "hf", r["problems"][:3]
        model = load_pretrained(d, dtype=torch.float32, progress=False, **OFFICIAL)
        assert same(model, source[1], mtp=False), original


@functools.cache
def _report(preset: str) -> dict:
    return expected_report(ModelConfig.preset(preset))


def test_inspect_expected_matches_parameter_totals():
    r = _report("flash")
    flash, pro = r["parameters"], _report("pro")["parameters"]
    assert abs(flash["backbone"] / 284.33e9 - 1) < 0.005 and abs(flash["mtp"] / 6.61e9 - 1) < 0.005
    assert abs(pro["backbone"] / 1573.0e9 - 1) < 0.005 and abs(pro["mtp"] / 25.84e9 - 1) < 0.005
    assert r["inventory"]["head.weight"] == {"shape": [129280, 4096], "dtype": "BF16"}
    assert r["inventory"]["layers.5.ffn.experts.0.w1.weight"] == {"shape": [2048, 2048], "dtype": "I8"}
    assert r["inventory"]["layers.5.ffn.experts.0.w1.scale"] == {"shape": [2048, 128], "dtype": "F8_E8M0"}
    assert r["inventory"]["layers.5.attn.wq_b.scale"] == {"shape": [256, 8], "dtype": "F8_E8M0"}


@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_expected_inventory_agrees_with_dsv4_info(preset):
    from dsv4 import info

    cfg = ModelConfig.preset(preset)
    mine = _report(preset)["parameters"]
    theirs = info.count_parameters(cfg)
    # dsv4 info counts nn.Parameters; the checkpoint also stores the router's buffers
    buffers = cfg.n_hash_layers * cfg.vocab_size * cfg.n_activated_experts
    buffers += (cfg.n_layers - cfg.n_hash_layers) * cfg.n_routed_experts
    assert mine["backbone"] - buffers == theirs["backbone"]
    assert mine["mtp"] - cfg.n_mtp_layers * cfg.n_routed_experts == theirs["mtp"]
    assert abs(mine["backbone"] / theirs["backbone"] - 1) < 0.005


def test_keep_quantized_experts_large_batch_path_matches_per_expert_path(ckpts, monkeypatch):
    """From GROUPED_MIN_TOKENS on, MXFP4 experts are dequantized chunk by chunk and run through
    ops.moe_experts (forced here with a low threshold and 3-expert chunks): same output as the per-expert
    path, and the op dispatch records the call."""
    from dsv4 import ops
    from dsv4.checkpoint import quantized

    model = load_pretrained(ckpts["fp8"], dtype=torch.float32, keep_quantized=True, progress=False, **W8A16)
    experts = model.layers[1].ffn.experts
    g = torch.Generator().manual_seed(5)
    t, k = 24, model.cfg.n_activated_experts
    x = torch.randn(t, model.cfg.dim, generator=g)
    idx = torch.stack([torch.randperm(experts.n, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    want = experts._per_expert(x, wts, idx)
    w1 = experts.stacked("w1", 0, experts.n)
    monkeypatch.setattr(quantized, "GROUPED_MIN_TOKENS", 8)
    monkeypatch.setattr(quantized, "CHUNK_BYTES", 3 * w1[0].numel() * 3 * x.element_size())
    ops.reset_calls()
    got = experts(x, wts, idx)
    assert sum(n for (op, _), n in ops.calls().items() if op == "moe_experts") == -(-experts.n // 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(w1[2], experts.expert("w1", 2))  # batched dequantization = per expert
