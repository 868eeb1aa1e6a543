"""Broken checkpoints are refused with one clear error naming tensor and file; planted format bugs
(docs/bugzoo.md Z01-Z04) are caught by the loader or by comparing logits with the source model."""

from __future__ import annotations

import json

import pytest
import torch
from test_checkpoint_helpers import logits, make_representable, rewrite, tiny_model, tokens

from dsv4 import formats as fm
from dsv4.checkpoint import CheckpointError, convert, load_pretrained, model_values, plan, save
from dsv4.cli import main as cli
from dsv4.errors import UserError
from dsv4.formats import fp4, fp8


@pytest.fixture(scope="module")
def source():
    m = make_representable(tiny_model(seed=2), "fp8", "fp4")
    return m, logits(m, tokens())


@pytest.fixture(scope="module")
def good(tmp_path_factory, source):
    """A single-file FP8 + E8M0 + MXFP4 release checkpoint."""
    m, _ = source
    return save(model_values(m), m.cfg, tmp_path_factory.mktemp("good") / "fp8", "fp8", expert_dtype="fp4")


def refused(path, *needles: str) -> str:
    """Loading must raise one CheckpointError (a UserError) whose first line names every needle."""
    with pytest.raises(CheckpointError) as ei:
        load_pretrained(path, dtype=torch.float32, progress=False)
    assert isinstance(ei.value, UserError)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def replaced(name: str, new: dict):
    return lambda n, t: new if n == name else {n: t}


FILE = "model.safetensors"


# ------------------------------------------------------------------------------------------- bad input
def test_missing_shard(source, tmp_path):
    m, _ = source
    d = save(model_values(m), m.cfg, tmp_path / "sharded", "bf16", shard_bytes=1 << 20)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    refused(d, "missing shard", victim.name)


def test_truncated_file(good, tmp_path):
    d = rewrite(good, tmp_path / "trunc")
    f = d / FILE
    f.write_bytes(f.read_bytes()[:-100])
    refused(d, "truncated", FILE)


def test_corrupt_header(good, tmp_path):
    d = rewrite(good, tmp_path / "corrupt")
    raw = bytearray((d / FILE).read_bytes())
    raw[8:16] = b"\x00garbage"
    (d / FILE).write_bytes(bytes(raw))
    refused(d, "corrupt", FILE)


def test_wrong_dtype(good, tmp_path):
    d = rewrite(
        good,
        tmp_path / "dtype",
        replaced("layers.0.attn.attn_sink", {"layers.0.attn.attn_sink": torch.zeros(4, dtype=torch.int32)}),
    )
    refused(d, "layers.0.attn.attn_sink", FILE, "I32", "F32")


def test_wrong_shape(good, tmp_path):
    d = rewrite(
        good,
        tmp_path / "shape",
        replaced(
            "layers.0.attn.kv_norm.weight",
            {"layers.0.attn.kv_norm.weight": torch.ones(64, dtype=torch.bfloat16)},
        ),
    )
    refused(d, "layers.0.attn.kv_norm.weight", FILE, "[64]", "[128]")


def test_missing_scale(good, tmp_path):
    d = rewrite(good, tmp_path / "noscale", replaced("layers.2.attn.wq_a.scale", {}))
    refused(d, "layers.2.attn.wq_a.weight", FILE, "no block scale")


def test_missing_tensor(good, tmp_path):
    d = rewrite(good, tmp_path / "missing", replaced("layers.3.ffn.experts.5.w2.weight", {}))
    refused(d, "missing tensor 'layers.3.ffn.experts.5.w2.weight'")


def test_extra_tensor(good, tmp_path):
    d = rewrite(good, tmp_path / "extra", extra={"layers.0.attn.bogus.weight": torch.zeros(2, 2)})
    refused(d, "unexpected tensor 'layers.0.attn.bogus.weight'", FILE)


def test_config_weights_mismatch(good, tmp_path):
    d = rewrite(good, tmp_path / "cfg")
    c = json.loads((d / "config.json").read_text())
    c["num_hidden_layers"] = 3
    c["layer_types"], c["mlp_layer_types"] = c["layer_types"][:3], c["mlp_layer_types"][:3]
    (d / "config.json").write_text(json.dumps(c))
    refused(d, "unexpected tensor 'layers.3.", FILE, "do config and weights match")
    c = json.loads((good / "config.json").read_text())
    c["q_lora_rank"] = 32
    (d / "config.json").write_text(json.dumps(c))
    refused(d, "layers.0.attn.wq_a.weight", "expected [32, 128]")


@pytest.mark.parametrize("case", ["float", "fp8", "e8m0"])
def test_non_finite_values_named(good, tmp_path, case):
    if case == "float":
        name, t = "layers.1.ffn_norm.weight", torch.full((128,), float("nan"), dtype=torch.bfloat16)
    elif case == "fp8":
        q = torch.zeros(64, 128, dtype=torch.uint8)
        q[3, 5] = 0x7F
        name, t = "layers.1.attn.wq_a.weight", fm.fp8_from_bytes(q)
    else:
        name, t = "layers.1.attn.wq_a.scale", fm.e8m0_from_bytes(torch.full((1, 1), 255, dtype=torch.uint8))
    d = rewrite(good, tmp_path / case, replaced(name, {name: t}))
    refused(d, name, FILE, "NaN")


def test_nothing_half_written(good, tmp_path, capsys):
    bad = rewrite(
        good,
        tmp_path / "bad",
        replaced(
            "layers.1.ffn_norm.weight",
            {"layers.1.ffn_norm.weight": torch.full((128,), float("inf"), dtype=torch.bfloat16)},
        ),
    )
    dst = tmp_path / "out" / "converted"
    with pytest.raises(CheckpointError, match="layers.1.ffn_norm.weight"):
        convert(bad, dst, "bf16", progress=False)
    assert not dst.exists() and list((tmp_path / "out").iterdir()) == []
    rc = cli(["convert", "--model", str(bad), str(dst), "--to", "bf16", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and "layers.1.ffn_norm.weight" in err
    assert not dst.exists() and list((tmp_path / "out").iterdir()) == []
    with pytest.raises(CheckpointError, match="wo_b"):  # tiny wo_b: 64 cols, not 2x128
        convert(good, dst, "inference", mp=2, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_cli_inspect_exit_codes(good, tmp_path, capsys):
    assert cli(["inspect", "--model", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    d = rewrite(good, tmp_path / "noscale", replaced("layers.2.attn.wq_a.scale", {}))
    assert cli(["inspect", "--model", str(d), "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert not r["ok"] and "layers.2.attn.wq_a" in r["problems"][0]
    assert cli(["inspect", "--model", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# ------------------------------------------------------------------------------------------- bug zoo
def test_z01_wrong_nibble_order_is_caught(good, source, tmp_path, monkeypatch):
    _, ref = source
    assert torch.equal(
        logits(load_pretrained(good, dtype=torch.float32, progress=False, quant_mode="w8a16"), tokens())[0], ref[0]
    )

    # planted in the file: experts packed "all low nibbles, then all high" instead of interleaved
    def planar_pack(n, t):
        if t.dtype == torch.int8 and ".experts." in n:
            codes = fm.unpack_fp4(t)
            half = codes.size(-1) // 2
            return {n: (codes[..., :half] | (codes[..., half:] << 4)).view(torch.int8)}
        return {n: t}

    d = rewrite(good, tmp_path / "z01", planar_pack)
    assert not torch.equal(
        logits(load_pretrained(d, dtype=torch.float32, progress=False, quant_mode="w8a16"), tokens())[0], ref[0]
    )
    # planted in the loader's decoder: the nibbles of each byte taken in the wrong order
    monkeypatch.setattr(fp4, "_byte_table", lambda dev: fp4._byte_table_cpu().flip(-1).to(dev))
    assert not torch.equal(
        logits(load_pretrained(good, dtype=torch.float32, progress=False, quant_mode="w8a16"), tokens())[0], ref[0]
    )


def test_z02_value_cast_scales_are_caught(good, source, tmp_path, monkeypatch):
    _, ref = source
    # planted in the file: scale bytes converted by value (uint8 -> float8_e8m0fnu) instead of as bits
    if fm.HAS_E8M0:

        def cast(n, t):
            if n.endswith(".scale"):
                return {n: fm.as_e8m0_bytes(t).to(torch.float8_e8m0fnu)}
            return {n: t}

        d = rewrite(good, tmp_path / "z02", cast)
        got = logits(load_pretrained(d, dtype=torch.float32, progress=False, quant_mode="w8a16"), tokens())[0]
        assert not torch.equal(got, ref[0])
    # planted in the loader: decoding scale bytes as integers
    monkeypatch.setattr(fp8, "e8m0_decode", lambda b: fm.as_e8m0_bytes(b).float())
    monkeypatch.setattr(fp4, "e8m0_decode", lambda b: fm.as_e8m0_bytes(b).float())
    got = logits(load_pretrained(good, dtype=torch.float32, progress=False, quant_mode="w8a16"), tokens())[0]
    assert not torch.equal(got, ref[0])


def test_z03_transposed_or_reshaped_scale_is_refused(good, tmp_path):
    name = "layers.0.attn.wo_a.scale"  # wo_a [64, 256]: scale [1, 2]
    for tag, bad in (
        ("t", lambda t: t.view(torch.uint8).t().contiguous()),
        ("1", lambda t: t.view(torch.uint8).reshape(1, 1, 2)),
    ):
        d = rewrite(good, tmp_path / f"z03{tag}", lambda n, t, bad=bad: {n: bad(t) if n == name else t})
        msg = refused(d, name, FILE, "expected [1, 2]")
        assert "block scale" in msg


def test_z04_quantized_head_without_scale_is_refused(good, tmp_path):
    def fp8_head(n, t):
        if n == "head.weight":
            return {n: fm.quantize_fp8(t.float())[0]}
        return {n: t}

    d = rewrite(good, tmp_path / "z04", fp8_head)
    refused(d, "head.weight", FILE, "F8_E4M3", "no block scale")
    with pytest.raises(CheckpointError):
        plan(d)  # caught from headers alone


def test_inference_rank_files_checked(source, tmp_path):
    from dsv4.checkpoint.safetensors_io import iter_file, read_header, write_file

    m, ref = source
    src = save(model_values(m), m.cfg, tmp_path / "src", "bf16", expert_dtype="fp4")
    (src / "tokenizer.json").write_text("{}")
    d = convert(src, tmp_path / "mp2", "inference", mp=2, progress=False)
    assert (d / "tokenizer.json").read_text() == "{}"  # tokenizer files travel along
    rank1 = d / "model1-mp2.safetensors"
    tensors = {i.name: t for i, t in iter_file(read_header(rank1)[0])}
    tensors["layers.0.attn.kv_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)  # a bad replica
    write_file(rank1, tensors)
    refused(d, "layers.0.attn.kv_norm.weight", "model1-mp2.safetensors", "[64]", "[128]")
    rank1.unlink()
    refused(d, "missing shard", "model1-mp2.safetensors")


@pytest.mark.parametrize("text", [b"\xff\xfe", b"{", b"[]"])
def test_a_broken_config_json_is_named_once(good, tmp_path, text):
    from dsv4.checkpoint.inspect import inspect_dir

    d = rewrite(good, tmp_path / "cfg")
    (d / "config.json").write_bytes(text)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(d)
    for said in (str(e.value), *inspect_dir(d)["problems"]):
        assert said.count(str(d / "config.json")) == 1, said
