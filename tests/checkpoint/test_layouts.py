"""Checkpoint layouts as objects: every registered layout round-trips through its own files (write, detect,
read back the same tensors), a layout added in one place is picked up everywhere, and Flash-0731's release
with its DSpark draft is recognized, validated, loaded, converted both ways and trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_helpers import make_representable, rewrite, tiny_model, tokens

from dsv4.checkpoint import layouts, load_pretrained, model_values, save
from dsv4.checkpoint.inspect import format_report, inspect_dir
from dsv4.checkpoint.layouts.base import Layout, register, unregister
from dsv4.checkpoint.names import F32, INT, Spec, dspark_tensors
from dsv4.checkpoint.reader import plan, scan
from dsv4.checkpoint.safetensors_io import read_header
from dsv4.checkpoint.writer import plan_values
from dsv4.cli import main


def dspark_cfg(cfg):
    """The draft of the synthetic DSpark checkpoints: Flash-0731's structure (3 stages over the last three
    layers, blocks of 5) at the tiny preset's sizes."""
    return cfg.with_draft("dspark", markov_rank=8).replace(dspark_noise_token_id=7)


@pytest.fixture(scope="module")
def source():
    """A tiny model whose weights every layout stores exactly (FP8/MXFP4-representable, so BF16 too)."""
    return make_representable(tiny_model(seed=3), "fp8", "fp4")


def official(values) -> dict[str, torch.Tensor]:
    return {n: v.dequantize(torch.float32).float() for n, v in values}  # (int tables compared as floats)


def _draft_value(name: str, spec: Spec, g: torch.Generator) -> torch.Tensor:
    if spec.role == INT:
        return torch.zeros(spec.shape, dtype=torch.int32)
    t = torch.randn(spec.shape, generator=g) * 0.02
    return t if spec.role == F32 else t.to(torch.bfloat16)


def write_dspark(model, root: Path, edit=None) -> dict[str, torch.Tensor]:
    """A DSpark-layout checkpoint: the model's backbone as release BF16 shards, a 3-stage draft of random
    tensors under mtp.*, and config.json with the dspark_* keys and, as Flash-0731's says,
    `num_nextn_predict_layers: 1` (the tensors count the stages). `edit(draft)` may change the draft tensors
    before they are written. Returns the draft tensors as written."""
    cfg = dspark_cfg(model.cfg)
    base = save(
        ((n, v) for n, v in model_values(model) if not n.startswith("mtp.")),
        layouts.without_mtp(cfg),
        root.parent / f"{root.name}-backbone",
        "bf16",
    )
    g = torch.Generator().manual_seed(0)
    draft = {n: _draft_value(n, s, g) for n, s in dspark_tensors(cfg).items()}
    if edit is not None:
        edit(draft)
    rewrite(base, root, extra=draft)
    raw = json.loads((root / "config.json").read_text())
    raw.update(num_nextn_predict_layers=1, **cfg.dspark_json())
    (root / "config.json").write_text(json.dumps(raw))
    return draft


def _write(layout: str, model, root: Path) -> dict[str, torch.Tensor]:
    """Write `model` in `layout`; the official tensors the directory must read back as."""
    want = official(model_values(model))
    if layout == "release":
        save(model_values(model), model.cfg, root, "fp8", expert_dtype="fp4", shard_bytes=1 << 20)
    elif layout == "inference":
        save(model_values(model), model.cfg, root, "inference", mp=2)
    elif layout == "hf":
        save(model_values(model), model.cfg, root, "hf")
        want = {n: t for n, t in want.items() if not n.startswith("mtp.")}  # transformers has no MTP
    elif layout == "dspark":
        draft = write_dspark(model, root)
        want = {n: t for n, t in want.items() if not n.startswith("mtp.")}
        want.update({n: t.float() for n, t in draft.items()})
    else:  # a layout registered after this test was written must be added here
        raise AssertionError(f"no round-trip case for layout '{layout}'")
    return want


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_every_layout_round_trips_through_its_files(layout, source, tmp_path):
    want = _write(layout, source, tmp_path / layout)
    found, *_ = scan(tmp_path / layout)
    assert found == layout
    p = plan(tmp_path / layout)
    assert p.layout == layout
    got = official(plan_values(p))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def test_inspect_counts_a_models_parameters_once_in_every_layout(source, tmp_path):
    """Rank files each hold a full copy of the replicated tensors: those count once, so the inference
    layout's two ranks give the parameters of the release layout (14.4M against 11.8M on the shipped model
    before, each copy counted)."""
    save(model_values(source), source.cfg, tmp_path / "bf16", "bf16")
    save(model_values(source), source.cfg, tmp_path / "mp2", "inference", mp=2)
    whole = inspect_dir(tmp_path / "bf16")["parameters"]
    assert inspect_dir(tmp_path / "mp2")["mp"] == 2 and inspect_dir(tmp_path / "mp2")["parameters"] == whole


class ToyLayout(Layout):
    """A release checkpoint that carries one extra F32 tensor `toy.stamp`, and whose config means no QAT
    simulation: a layout defined only here, to show that nothing else has to name it."""

    name = "toy"
    priority = 100
    semantics = {"fp8_kv_sim": False}

    def claims(self, stored_names: list[str]) -> bool:
        return "toy.stamp" in stored_names

    def tensors(self, cfg, root=None):
        return {**super().tensors(cfg, root), "toy.stamp": Spec((3,), F32)}


@pytest.fixture
def toy():
    register(ToyLayout)
    try:
        yield layouts.get("toy")
    finally:
        unregister("toy")


def test_a_layout_registered_in_one_place_is_used_everywhere(toy, source, tmp_path):
    src = save(model_values(source), source.cfg, tmp_path / "rel", "bf16")
    rewrite(src, tmp_path / "toy", extra={"toy.stamp": torch.arange(3.0)})
    assert scan(tmp_path / "toy")[0] == "toy"
    p = plan(tmp_path / "toy")
    assert p.layout == "toy" and "toy.stamp" in p.entries
    assert p.cfg.fp8_kv_sim is False and plan(src).cfg.fp8_kv_sim is True
    assert "toy.stamp" in layouts.expected_tensors(source.cfg, "toy")
    r = inspect_dir(tmp_path / "toy")
    assert r["layout"] == "toy" and r["ok"], r["problems"]
    # the stamp is what makes it a toy checkpoint: without it the release layout reads it, and a
    # forced toy layout names the stamp as missing
    r = inspect_dir(src, layout="toy")
    assert not r["ok"] and any("'toy.stamp'" in m and "missing" in m for m in r["problems"])
    with pytest.raises(ValueError, match="layout must be one of"):
        layouts.get("no-such-layout")


def test_registering_a_name_twice_is_refused(toy):
    with pytest.raises(ValueError, match="registered twice"):
        register(ToyLayout)


# ------------------------------------------------------------------------------------------ DSpark
def test_dspark_inspect_reports_the_draft(source, tmp_path):
    draft = write_dspark(source, tmp_path / "ds")
    r = inspect_dir(tmp_path / "ds")
    assert r["layout"] == "dspark" and r["ok"], r["problems"]
    d = r["draft"]
    assert d["kind"] == "DSpark" and d["stages"] == 3 and d["stages_found"] == [0, 1, 2]
    assert d["tensors"] == len(draft) and d["markov_rank"] == 8 and d["target_layers"] == [1, 2, 3]
    # config.json says 1 MTP layer, as Flash-0731's does: the tensors hold 3 stages, and they win
    assert any("1 MTP layer(s)" in w and "3 DSpark stages" in w for w in r["warnings"])
    # window-only stages: the draft has no compressor and no indexer
    assert not any("compressor" in n or "indexer" in n for n in draft)
    text = format_report(r)
    assert "DSpark draft under mtp.*: 3 stages, block size 5" in text and "--no-mtp" in text
    # no layout claims these files as the first release's MTP block
    assert layouts.get("release").claims(list(draft)) and layouts.detect(list(draft), False).name == "dspark"


def test_dspark_inventory_problems_are_each_named(source, tmp_path):
    def damage(draft):
        del draft["mtp.1.attn.wkv.weight"]  # missing
        draft["mtp.2.attn.compressor.ape"] = torch.zeros(4, 64)  # extra: the draft has none
        draft["mtp.2.markov_head.markov_w1.weight"] = torch.zeros(1024, 9, dtype=torch.bfloat16)  # rank 9

    write_dspark(source, tmp_path / "bad", damage)
    r = inspect_dir(tmp_path / "bad")
    assert r["layout"] == "dspark" and not r["ok"] and r["draft"]["stages_found"] == [0, 1, 2]
    probs = r["problems"]
    assert len(probs) == 3, probs
    assert any("missing tensor 'mtp.1.attn.wkv.weight'" in m for m in probs)
    assert any("unexpected tensor 'mtp.2.attn.compressor.ape'" in m for m in probs)
    assert any("'mtp.2.markov_head.markov_w1.weight' has shape [1024, 9], expected [1024, 8]" in m for m in probs)
    assert "3 problem(s)" in format_report(r)


def test_dspark_loads_with_its_draft_and_without_it(source, tmp_path):
    draft = write_dspark(source, tmp_path / "ds")
    qat = dict(fp8_kv_sim=source.cfg.fp8_kv_sim, fp4_indexer_sim=source.cfg.fp4_indexer_sim)
    m = load_pretrained(tmp_path / "ds", **qat)
    assert m.cfg.dspark and m.cfg.n_mtp_layers == 3 and m.cfg.dspark_block_size == 5
    assert any("3 DSpark stages" in w for w in m.checkpoint_plan["warnings"])
    got = official((n, v) for n, v in model_values(m) if n.startswith("mtp."))
    assert got.keys() == draft.keys() and all(torch.equal(got[n], draft[n].float()) for n in draft)
    with torch.no_grad():
        assert torch.equal(m(tokens()).logits, source(tokens()).logits)  # the main model is untouched
    m0 = load_pretrained(tmp_path / "ds", mtp=False, **qat)
    assert m0.cfg.n_mtp_layers == 0 and not m0.cfg.dspark and not any(n.startswith("mtp.") for n in m0.state_dict())
    with torch.no_grad():
        assert torch.equal(m0(tokens()).logits, source(tokens()).logits)


def test_dspark_cli_inspect_convert_both_ways_generate(source, tmp_path, capsys):
    draft = write_dspark(source, tmp_path / "ds")
    assert main(["inspect", "--model", str(tmp_path / "ds")]) == 0
    # bf16 -> bf16 keeps the draft bit for bit; -> fp8 quantizes main_proj (and experts) like every linear
    assert main(["convert", "--model", str(tmp_path / "ds"), str(tmp_path / "bf"), "--to", "bf16"]) == 0
    assert (
        main(["convert", "--model", str(tmp_path / "ds"), str(tmp_path / "f8"), "--to", "fp8", "--expert-dtype", "fp4"])
        == 0
    )
    assert main(["convert", "--model", str(tmp_path / "f8"), str(tmp_path / "back"), "--to", "bf16"]) == 0
    for d in ("bf", "f8", "back"):
        r = inspect_dir(tmp_path / d)
        assert r["layout"] == "dspark" and r["ok"] and r["draft"]["stages"] == 3, (d, r["problems"])
    bf = official((n, v) for n, v in plan_values(plan(tmp_path / "bf")) if n.startswith("mtp."))
    assert all(torch.equal(bf[n], draft[n].float()) for n in draft)
    headers = {n: i for f in (tmp_path / "f8").glob("*.safetensors") for n, i in read_header(f)[0].items()}
    assert headers["mtp.0.main_proj.weight"].dtype == "F8_E4M3" and "mtp.0.main_proj.scale" in headers
    assert headers["mtp.2.markov_head.markov_w2.weight"].dtype == "BF16"  # never quantized
    f8 = official(plan_values(plan(tmp_path / "f8")))
    back = official(plan_values(plan(tmp_path / "back")))
    assert f8.keys() == back.keys() and all(torch.equal(f8[n], back[n]) for n in f8)  # fp8 -> bf16 exact
    assert main(["convert", "--model", str(tmp_path / "ds"), str(tmp_path / "main"), "--to", "bf16", "--no-mtp"]) == 0
    assert not any(n.startswith("mtp.") for f in (tmp_path / "main").glob("*.safetensors") for n in read_header(f)[0])
    gen = ["generate", "--model", str(tmp_path / "ds"), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    capsys.readouterr()
    assert main(gen) == 0
    capsys.readouterr()
    assert main([*gen, "--speculative", "2", "--speculative-threshold", "0.5", "--json"]) == 0  # the DSpark draft
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 2
    assert main([*gen, "--speculative", "6"]) == 2  # more than the draft's block of 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --speculative 6") and "blocks of 5" in err[0]


def test_the_draft_params_are_checked_against_the_config(source, tmp_path):
    write_dspark(source, tmp_path / "ds")
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    raw["dspark_target_layer_ids"] = [2, 3, 4]  # the tiny model has layers 0-3
    (tmp_path / "ds" / "config.json").write_text(json.dumps(raw))
    r = inspect_dir(tmp_path / "ds")
    assert not r["ok"] and any("dspark_target_layer_ids" in m for m in r["problems"])


def test_training_the_draft_of_a_dspark_checkpoint_keeps_the_main_model(source, tmp_path, capsys):
    write_dspark(source, tmp_path / "ds")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):  # half of them held out, by the hash of their names
        (data / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20, encoding="utf-8")
    train = [
        "train",
        "--model",
        str(tmp_path / "ds"),
        "--data",
        str(data),
        "--held-out-pct",
        "50",
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--seq-len",
        "16",
        "--eval-every",
        "0",
        "--sample-prompt",
        "",
        "--no-progress",
        "--device",
        "cpu",
        "--freeze-main",
        "--dspark-anchors",
        "4",
    ]
    assert main([*train, "--out", str(tmp_path / "run"), "--export", str(tmp_path / "exp")]) == 0
    before = official(plan_values(plan(tmp_path / "ds")))
    after = official(plan_values(plan(tmp_path / "exp")))
    assert after.keys() == before.keys()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.startswith("mtp.") for n in changed), sorted(changed)[:5]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("dspark" in r and "dspark_tau" in r for r in rows)


@pytest.mark.parametrize("to", ["bf16", "hf", "inference"])
def test_convert_refuses_an_expert_dtype_its_target_does_not_write(tmp_path, capsys, to):
    """--expert-dtype is the release layout's FP8 / MXFP4 experts (--to fp8): elsewhere it was ignored (hf,
    inference) or wrote MXFP4 experts into a bf16 checkpoint whose config.json did not say so."""
    from dsv4.loading import default_model_dir

    argv = ["convert", "--model", str(default_model_dir()), str(tmp_path / "out"), "--to", to, "--expert-dtype", "fp4"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("error: --expert-dtype applies to --to fp8") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_empty_destination(capsys):
    from dsv4.loading import default_model_dir

    assert main(["convert", "--model", str(default_model_dir()), "", "--to", "bf16"]) == 2
    assert "is not a usable path: ''" in capsys.readouterr().err
