"""`dsv4 init`: random checkpoints of any config in the release layout, valid for `inspect` and the loader."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dsv4.checkpoint import load_pretrained
from dsv4.checkpoint.initialize import BLOCK_ELEMENTS, E2M1_RMS, apply_overrides, init_checkpoint, random_values
from dsv4.checkpoint.quantized import QuantExperts, QuantLinear
from dsv4.cli import main
from dsv4.config import ModelConfig
from dsv4.memory import allocation_peak
from dsv4.model import DeepSeekV4


def _inspect(path, capsys) -> dict:
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_checkpoint_is_a_valid_release_checkpoint(tmp_path, capsys):
    dst = tmp_path / "tiny"
    assert main(["init", str(dst), "--preset", "tiny", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "release" and out["tensors"] > 200
    rep = _inspect(dst, capsys)
    assert rep["ok"] and rep["layout"] == "release"
    model = load_pretrained(dst)
    ref = DeepSeekV4.from_config("tiny")
    assert model.cfg.replace(name="x") == ref.cfg.replace(name="x")
    with torch.no_grad():
        logits = model(torch.randint(0, 1024, (1, 40))).logits
    assert bool(torch.isfinite(logits).all())
    # the distributions of reset_parameters: norms 1, zero sinks, mHC base as the model's, hash rows distinct
    layer = model.layers[1]
    assert torch.equal(layer.attn_norm.weight, torch.ones_like(layer.attn_norm.weight))
    assert not layer.attn.attn_sink.any()
    assert torch.equal(layer.hc_attn_base, ref.layers[1].hc_attn_base)
    table = model.layers[0].ffn.gate.tid2eid
    assert all(len(set(row)) == len(row) for row in table.tolist())
    assert bool(((table >= 0) & (table < 8)).all())
    # a linear is N(0, 1/in) rounded to bf16: the sample std of n values is within 5 standard errors
    # (1/sqrt(2n) relative) of 1/sqrt(in), plus bf16's relative rounding 2^-8
    w = layer.attn.wq_b.weight.detach().float()
    rel = abs(float(w.std()) * math.sqrt(w.size(1)) - 1)
    assert rel < 5 / math.sqrt(2 * w.numel()) + 2**-8, rel


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    cfg = ModelConfig.preset("tiny")
    a = dict(random_values(cfg, seed=1))
    b = dict(random_values(cfg, seed=1))
    c = dict(random_values(cfg, seed=2))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].data, b[k].data) for k in a)
    assert not torch.equal(a["layers.1.attn.wq_b.weight"].data, c["layers.1.attn.wq_b.weight"].data)
    # shards of another size hold the same tensors
    init_checkpoint(tmp_path / "one", cfg, seed=1)
    init_checkpoint(tmp_path / "many", cfg, seed=1, shard_bytes=1 << 20)
    one, many = load_pretrained(tmp_path / "one"), load_pretrained(tmp_path / "many")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 1
    assert all(torch.equal(x, y) for x, y in zip(one.state_dict().values(), many.state_dict().values()))


def test_drafts_and_overrides(tmp_path, capsys):
    assert main(["init", str(tmp_path / "nomtp"), "--preset", "tiny", "--draft", "none"]) == 0
    assert load_pretrained(tmp_path / "nomtp").cfg.n_mtp_layers == 0
    assert (
        main(
            [
                "init",
                str(tmp_path / "mtp"),
                "--preset",
                "tiny",
                "--override",
                "n_mtp_layers=0",
                "n_layers=3",
                "--draft",
                "mtp",
            ]
        )
        == 0
    )
    cfg = load_pretrained(tmp_path / "mtp").cfg
    assert (cfg.n_layers, cfg.n_mtp_layers, cfg.compress_ratios) == (3, 1, (0, 4, 128, 0))
    capsys.readouterr()
    # Flash-0731's DSpark draft: written in its layout, inspected and loaded with the draft
    assert main(["init", str(tmp_path / "ds"), "--preset", "tiny", "--draft", "dspark"]) == 0
    model = load_pretrained(tmp_path / "ds")
    assert model.cfg.dspark and model.dspark is not None
    assert model.checkpoint_plan["layout"] == "dspark"


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--override", "nlayers=3"], "not a config field"),
        (["--override", "n_layers"], "KEY=VALUE"),
        (["--override", "n_layers=3", "n_layers=4"], "n_layers: given twice"),
        (["--override", "n_layers=9"], "give compress_ratios"),
        (["--override", "n_hash_layers=7"], "n_hash_layers"),
        (["--override", "dim=100", "--expert-dtype", "fp4"], "multiples of 32"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, words):
    dst = tmp_path / "x"
    capsys.readouterr()
    assert main(["init", str(dst), "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not dst.exists() and os.listdir(tmp_path) == []


def test_existing_destination_is_left_alone(tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main(["init", str(dst), "--preset", "tiny"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert os.listdir(dst) == ["keep.txt"]


def test_a_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    from dsv4.checkpoint import initialize

    live, count = initialize.random_value, [0]

    def failing(*a, **k):
        count[0] += 1
        if count[0] == 50:
            raise OSError(28, "No space left on device")
        return live(*a, **k)

    monkeypatch.setattr(initialize, "random_value", failing)
    with pytest.raises(OSError):
        init_checkpoint(tmp_path / "half", ModelConfig.preset("tiny"))
    assert os.listdir(tmp_path) == []  # no destination, no temporary directory


@pytest.mark.slow
def test_flash_shaped_checkpoint_kept_quantized_with_bounded_memory(tmp_path, capsys):
    """Flash's dimensions (dim 4096, 64 heads of 512, q_lora 1024, O-LoRA 8 x 1024, indexer 64 x 128, experts
    of 2048) with two layers (CSA and HCA), 8 experts and a 8192-token vocabulary: FP8 linears, MXFP4
    experts, written one tensor at a time."""
    cfg = apply_overrides(
        ModelConfig.preset("flash"),
        {"n_layers": 2, "n_routed_experts": 8, "vocab_size": 8192, "compress_ratios": (4, 128, 0)},
    )
    dst = tmp_path / "flash2"
    _, peak = allocation_peak(lambda: init_checkpoint(dst, cfg, seed=0))
    rep = _inspect(dst, capsys)
    assert rep["ok"], rep
    assert set(rep["dtypes"]) == {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32", "I32"}, rep["dtypes"]
    total = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    largest = max(math.prod(s) * 2 for s in ((cfg.vocab_size, cfg.dim),))  # embedding / head in bf16
    # alive at once: the tensor being written and the one being drawn (each at most the largest), and one
    # fp32 block of draws
    bound = 2 * largest + 4 * BLOCK_ELEMENTS + (1 << 20)
    assert peak <= bound, (peak, bound)
    assert peak < total / 3
    # loads kept quantized, and per rank: rank 1 of 2 holds experts [4, 8) of every layer
    model = load_pretrained(dst, keep_quantized=True, dtype=torch.bfloat16, rank=1, world_size=2)
    assert isinstance(model.layers[0].attn.wq_b, QuantLinear) and model.layers[0].attn.wq_b.fmt == "fp8"
    ex = model.layers[0].ffn.experts
    assert isinstance(ex, QuantExperts) and ex.fmt == "fp4" and (ex.offset, ex.n) == (4, 4)
    # MXFP4 codes drawn uniformly under one power-of-two scale: rms within sqrt(2) of 1/sqrt(in)
    w1 = ex.expert("w1", 0).float()
    ratio = float(w1.square().mean().sqrt()) * math.sqrt(cfg.dim)
    # (the sample rms of 8M codes is within 1% of E2M1_RMS)
    assert 2**-0.5 * 0.99 <= ratio <= 2**0.5 * 1.01, (ratio, E2M1_RMS)
