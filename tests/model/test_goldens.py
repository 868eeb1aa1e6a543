"""The model against the official implementation's numbers (dsv4/assets/goldens, written by
scripts/official_goldens.py from the official inference code): every stage of both cases within the
tolerance `dsv4.check.goldens` derives, through the real checkpoint loader, and the conformance command
runs the check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from dsv4.check import goldens

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("case", goldens.CASES)
def test_official_goldens_match(case):
    rows = goldens.compare_case(case)
    names = {r.stage for r in rows}
    if case == "mtp":  # the block the official forward does not run, called on its own
        assert names == {
            "logits",
            "layers.0.attn.out",
            "layers.0.ffn.out",
            "mtp.0.attn.out",
            "mtp.0.ffn.out",
            "mtp.0.logits",
        }
    else:
        assert {"logits", "layers.0.attn.out", "layers.1.ffn.out", "layers.2.attn.out"} <= names
    bad = [f"{r.stage}: {r.error:.3g} > {r.tol:.3g}" for r in rows if not r.ok]
    assert not bad, bad


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the GPU run of the golden comparison needs one")
def test_official_goldens_match_on_gpu():
    for case in goldens.CASES:
        bad = [r for r in goldens.compare_case(case, "cuda") if not r.ok]
        assert not bad, bad


def test_fixtures_are_in_the_official_layout():
    """Official inference names and storage dtypes (FP8 E4M3 + E8M0 scales, packed FP4 experts, F32 sinks)."""
    with safe_open(str(goldens.GOLDEN_DIR / "fp8-fp4" / "model0-mp1.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("layers.1.attn.wq_b.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.1.attn.wq_b.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("layers.1.ffn.experts.0.w1.weight").get_dtype() == "F4"
        assert f.get_slice("layers.1.attn.attn_sink").get_dtype() == "F32"
    assert {"layers.0.ffn.gate.tid2eid", "layers.1.attn.indexer.compressor.ape", "hc_head_fn"} <= keys
    with safe_open(str(goldens.GOLDEN_DIR / "bf16" / "golden.safetensors"), "pt") as f:
        assert len(f.metadata()["official_commit"]) == 40
    cfg = json.loads((goldens.GOLDEN_DIR / "bf16" / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128] and cfg["n_hash_layers"] == 1


def test_conformance_runs_the_golden_check():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4",
            "check",
            "conformance",
            "--preset",
            "tiny",
            "--checks",
            "official-goldens,transformers-goldens,swiglu-formula",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["baseline"]["official-goldens"]["ok"]
    assert report["baseline"]["transformers-goldens"]["ok"]
    assert "transformers 5." in report["baseline"]["transformers-goldens"]["detail"]
    assert report["baseline"]["swiglu-formula"]["ok"]


def _transformers_model(**kw):
    from dsv4.checkpoint import load_pretrained

    return load_pretrained(goldens.GOLDEN_DIR / goldens.TRANSFORMERS_CASE / "checkpoint", dtype=torch.float32, **kw)


def test_transformers_goldens_match_and_record_the_version():
    """The transformers fixture, loaded from transformers' checkpoint layout by dsv4's loader (QAT
    simulations off: transformers' semantics), matches every stage within the fp32 tolerance."""
    model = _transformers_model()
    assert not model.cfg.fp8_kv_sim and not model.cfg.fp4_indexer_sim
    assert model.cfg.compress_ratios[:3] == (0, 4, 128)
    rows = goldens.compare_case(goldens.TRANSFORMERS_CASE, model=model)
    assert {r.stage for r in rows} == {"logits", *(f"layers.{i}.{s}.out" for i in range(3) for s in ("attn", "ffn"))}
    bad = [f"{r.stage}: {r.error:.3g} > {r.tol:.3g}" for r in rows if not r.ok]
    assert not bad, bad
    meta = goldens.fixture_metadata(goldens.TRANSFORMERS_CASE)
    assert meta["transformers_version"].split(".")[0] >= "5" and meta["dtype"] == "float32"
    with safe_open(str(goldens.GOLDEN_DIR / goldens.TRANSFORMERS_CASE / "checkpoint" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.layers.1.attn.indexer.wq_b.weight", "model.layers.0.ffn.experts.3.w2.weight"} <= keys


def test_transformers_goldens_fail_on_a_perturbed_model():
    """Without the routed experts' SwiGLU clamp (the fixture's expert pre-activations pass the limit), or
    with the official FP8 KV simulation that transformers does not run, the MoE / attention stages leave
    the tolerance."""
    model = _transformers_model()
    for layer in model.layers:
        layer.ffn.experts.swiglu_limit = 0.0
    rows = {r.stage: r for r in goldens.compare_case(goldens.TRANSFORMERS_CASE, model=model)}
    assert rows["layers.0.attn.out"].ok  # before the first MoE: unchanged
    assert not rows["layers.0.ffn.out"].ok and not rows["logits"].ok
    rows = {
        r.stage: r for r in goldens.compare_case(goldens.TRANSFORMERS_CASE, model=_transformers_model(fp8_kv_sim=True))
    }
    assert not rows["layers.0.attn.out"].ok


def test_mtp_golden_fails_when_the_block_mixes_its_inputs_wrongly(monkeypatch):
    """The MTP golden sees the MTP block itself: the embedding of the next token and the hidden state
    swapped in `combine` (the main-model stages stay within tolerance, the MTP ones leave it)."""
    from dsv4.model.block import MTPBlock

    def swapped(self, h, e):
        return self.e_proj(self.enorm(h.mean(2))).unsqueeze(2) + self.h_proj(self.hnorm(e.unsqueeze(2).expand_as(h)))

    monkeypatch.setattr(MTPBlock, "combine", swapped)
    rows = {r.stage: r for r in goldens.compare_case("mtp")}
    assert rows["logits"].ok and rows["layers.0.ffn.out"].ok
    assert not rows["mtp.0.attn.out"].ok and not rows["mtp.0.logits"].ok


def test_dspark_goldens_match_the_reference_code():
    """The DSpark draft against the fixture from the official code's blocks and DeepSpec's heads: the main
    model's taps and logits within the fp32 tolerance, the draft's stages within 2^-4 (they follow the FP8
    round trip of its context keys, where an ulp of difference can move an element by an E4M3 step on
    another device), the same greedy drafts and per-position verify lengths."""
    rows = goldens.compare_dspark()
    names = {r.stage for r in rows}
    assert {
        "taps",
        "mtp.0.attn.out",
        "mtp.1.ffn.out",
        "dspark.base_logits",
        "dspark.logits",
        "dspark.confidence",
        "dspark.tokens",
        "dspark.verify_length",
    } <= names
    bad = [f"{r.stage}: {r.error:.3g} > {r.tol:.3g}" for r in rows if not r.ok]
    assert not bad, bad
    tol = {r.stage: r.tol for r in rows}
    assert tol["taps"] == tol["logits"] == goldens.FP32_TOL
    assert tol["mtp.0.attn.out"] == tol["dspark.confidence"] == goldens.W8A8_TOL
    meta = goldens.fixture_metadata(goldens.DSPARK_CASE)
    assert len(meta["official_commit"]) == 40 and len(meta["deepspec_commit"]) == 40
    cfg = json.loads((goldens.GOLDEN_DIR / goldens.DSPARK_CASE / "config.json").read_text())
    assert cfg["n_mtp_layers"] == 2 and cfg["dspark_block_size"] == 4 and cfg["dspark_target_layer_ids"] == [0, 1]
