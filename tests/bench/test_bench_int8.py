"""`dsv4 bench int8` on the CPU at toy sizes: the speed rows come from fresh processes with their backends
named, the accuracy rows compare against the official W8A8 of the same FP8 + MXFP4 checkpoint."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main


@pytest.mark.slow
def test_bench_int8_speed_and_accuracy_rows(capsys):
    assert (
        main(
            [
                "bench",
                "int8",
                "--preset",
                "tiny",
                "--layers",
                "2",
                "--modes",
                "int8,bf16",
                "--batch",
                "1",
                "2",
                "--prompt",
                "4",
                "--steps",
                "2",
                "--runs",
                "3",
                "--max-new-tokens",
                "6",
                "--prompts",
                "1",
                "--json",
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    # progress on stderr: every fresh process says what it runs, and what it measured
    assert cap.err.count("bench int8: round ") == 6 and cap.err.count("int8:fp32: batch 1 ") == 3
    assert "accuracy: loading" in cap.err
    int8, bf16 = out["speed"]
    assert int8["mode"] == "int8:fp32" and bf16["mode"] == "bf16"
    assert [b["batch"] for b in int8["batches"]] == [1, 2]
    for b in int8["batches"]:
        assert b["min"] <= b["tokens_per_s"] <= b["max"] and b["tokens_per_s"] > 0
        assert "int8_gemm=int_mm" in b["backends"] and "int8_moe_experts=int_mm" in b["backends"]
    assert int8["weights_mib"] < bf16["weights_mib"]  # 1 byte per weight + row scales
    acc = out["accuracy"]
    assert acc["stored_formats"] == ["fp4", "fp8"] and acc["tokens"] == 6
    p = acc["prompts"][0]
    assert p["w8a8"]["logits_rel_l2"] == 0.0  # the reference against itself
    for m in ("int8", "w8a16"):
        assert 0 < p[m]["logits_rel_l2"] < 1 and 0 <= p[m]["greedy_same"] <= 1 and 0 <= p[m]["top1_agree"] <= 1


def test_bench_int8_refuses_bad_modes(capsys):
    assert main(["bench", "int8", "--preset", "tiny", "--modes", "int4"]) == 2
    assert "unknown mode 'int4'" in capsys.readouterr().err


def test_a_mode_can_prefer_a_backend_that_runs_by_name_only(capsys):
    """'+BACKEND' times a mode with that ops backend preferred where it can run (the split-K INT8 GEMM
    beside the default); the label keeps it, and a backend that does not exist is refused by name."""
    from dsv4.bench.int8 import parse_mode, preferred_backend

    assert parse_mode("int8:bf16+triton_splitk", "cuda") == ("int8:bf16+triton_splitk", "int8", "bf16")
    assert parse_mode("int8+triton_splitk", "cpu") == ("int8:fp32+triton_splitk", "int8", "fp32")
    assert parse_mode("bf16", "cuda") == ("bf16", "w8a16", "bf16")
    assert preferred_backend("int8:bf16+triton_splitk") == "triton_splitk" and preferred_backend("bf16") is None
    assert main(["bench", "int8", "--preset", "tiny", "--modes", "int8+nonesuch"]) == 2
    assert "no ops backend named 'nonesuch'" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["small", "medium", "flash", "pro"])
def test_layers_keeps_a_valid_config_of_the_same_shapes(preset):
    """`--layers N` keeps the first N layers of any preset: a config that validates (the hash-routed layers
    are the first ones, so at most N of them), with the kept layers' compression ratios and the rest as it was."""
    from dsv4.bench.int8 import _config
    from dsv4.config import ModelConfig

    full = ModelConfig.preset(preset)
    for n in (1, 2, 3):
        cfg = _config(preset, n)
        cfg.validate()
        assert (cfg.n_layers, cfg.n_hash_layers) == (n, min(full.n_hash_layers, n))
        assert cfg.compress_ratios[:n] == full.compress_ratios[:n]
        shapes = (cfg.dim, cfg.n_routed_experts, cfg.moe_inter_dim)
        assert shapes == (full.dim, full.n_routed_experts, full.moe_inter_dim)
