"""A resume that trusts nothing it reads, and a run that stops when its loss turns non-finite.

One short real run (the micro V4 of test_train) writes a checkpoint; each case then plants one hostile
thing in a copy of the run - in its `latest` pointer, its state.json (with a manifest that matches, as a
crafted checkpoint would have), its weights or optimizer state - and checks the refusal: one clear error
naming the file and the key or tensor, at once (a FIFO never blocks), quoting no file content.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_fuzz import time_bound
from test_train import _train_cfg

from dsv4.cli import main
from dsv4.errors import RunFailed, UserError
from dsv4.train import checkpoint
from dsv4.train.trainer import Trainer

BOUND = 20.0  # seconds: every refusal is immediate; a hang fails


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory whose checkpoints/latest names step_00000002 (of a 2-step run)."""
    tmp = tmp_path_factory.mktemp("run")
    Trainer(_train_cfg(tmp, steps=2, save_every=2, eval_every=0, diag_every=0), log=lambda *_: None).fit()
    return tmp


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _resume(tmp: Path, **kw):
    return Trainer(_train_cfg(tmp, save_every=-1, eval_every=0, diag_every=0, resume="auto", **kw), log=lambda *_: None)


def _rehash(ckpt: Path) -> None:
    """Rewrite the manifest to match the files (a crafted checkpoint passes the integrity check)."""
    manifest = {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in checkpoint.FILES}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["fifo", "link out of the run", "50 MB", "null byte", "device", "directory"])
def test_a_hostile_latest_pointer_is_refused_at_once(run, tmp_path, kind):
    tmp = _copy(run, tmp_path / "t")
    latest = tmp / "run" / "checkpoints" / "latest"
    latest.unlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("step_00000002\nroot:x:0:0:the content of a file outside the run\n")
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "link out of the run":
        os.symlink(secret, latest)
    elif kind == "50 MB":
        latest.write_bytes(b"step_" + b"9" * (50 << 20))
    elif kind == "null byte":
        latest.write_bytes(b"step_0000\x000002\n")
    elif kind == "device":
        os.symlink("/dev/zero", latest)
    else:
        latest.mkdir()
    with time_bound(BOUND), pytest.raises(UserError) as info:
        _resume(tmp)
    msg = str(info.value)
    assert "latest" in msg and len(msg) < 400 and "root:x" not in msg and "\x00" not in msg, msg


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("loader", None, "'loader' must be an object"),
        ("loader", [1, 2], "'loader' must be an object"),
        ("step", -5, "'step' must be in [0, "),
        ("step", True, "'step' must be an integer"),
        ("step", 3, "'step' is 3 but the checkpoint is step_00000002"),
        ("history", {"a": 1}, "'history' must be a list"),
        ("loader.index", 10**9, "'loader.index' 1000000000 is past the data's"),
        ("loader.epoch", "1", "'loader.epoch' must be an integer"),
        ("model_config", None, None),
    ],
)
def test_a_crafted_state_json_is_refused_by_its_schema(run, tmp_path, key, value, words):
    tmp = _copy(run, tmp_path / "t")
    ckpt = tmp / "run" / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "state.json").read_text())
    if "." in key:
        outer, inner = key.split(".")
        state[outer][inner] = value
    elif value is None and key == "model_config":
        del state[key]
        words = "'model_config' is missing"
    else:
        state[key] = value
    (ckpt / "state.json").write_text(json.dumps(state))
    _rehash(ckpt)
    with pytest.raises(checkpoint.CorruptCheckpoint) as info:
        _resume(tmp)
    assert "state.json" in str(info.value) and words in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "file,name", [("model.safetensors", "layers.1.attn.wq_a.weight"), ("optimizer.safetensors", None)]
)
def test_non_finite_weights_or_optimizer_state_are_not_resumed(run, tmp_path, file, name):
    tmp = _copy(run, tmp_path / "t")
    ckpt = tmp / "run" / "checkpoints" / "step_00000002"
    tensors = load_file(str(ckpt / file))
    name = name or sorted(k for k in tensors if k.endswith("exp_avg"))[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = math.nan
    save_file(tensors, str(ckpt / file))
    _rehash(ckpt)
    with pytest.raises(checkpoint.CorruptCheckpoint) as info:
        _resume(tmp)
    assert file in str(info.value) and f"'{name}' holds 1 NaN" in str(info.value)


def test_a_loss_that_turns_non_finite_stops_the_run_naming_the_step(tmp_path, capsys):
    """A weight set to NaN after step 2: step 3's loss is NaN, so the run stops there with exit 1 (the
    checkpoint of step 2 kept); with --skip-nonfinite the NaN batches are skipped and the run ends, and the
    skipped steps move no weight."""
    t = Trainer(_train_cfg(tmp_path, steps=5, save_every=2, eval_every=0, diag_every=0), log=lambda *_: None)
    w = dict(t.model.named_parameters())["layers.1.attn.wq_a.weight"]
    original = t.train_step

    def poisoned(tokens):
        if t.step == 2:
            with torch.no_grad():
                w.view(-1)[0] = math.nan
        return original(tokens)

    t.train_step = poisoned
    with pytest.raises(RunFailed) as info:
        t.fit()
    msg = str(info.value)
    assert "step 3" in msg and "nan" in msg and "step_00000002" in msg and "--skip-nonfinite" in msg, msg
    (tmp_path / "b").mkdir()
    t2 = Trainer(
        _train_cfg(tmp_path / "b", steps=4, save_every=-1, eval_every=0, diag_every=0, skip_nonfinite=True),
        log=lambda *_: None,
    )
    w2 = dict(t2.model.named_parameters())["layers.1.attn.wq_a.weight"]
    with torch.no_grad():
        w2.view(-1)[0] = math.nan
    before = {n: p.detach().clone() for n, p in t2.model.named_parameters()}
    t2.fit()
    assert [r["skipped"] for r in t2.history if "skipped" in r] == [True] * 4
    assert all(torch.equal(p, before[n]) or torch.isnan(p).any() for n, p in t2.model.named_parameters())


def test_the_command_line_exits_1_naming_the_step(tmp_path, capsys):
    """The same through `dsv4 train`: a learning rate so large that the loss overflows stops the run with
    one line and exit 1."""
    from test_train import _corpus

    code = main(
        [
            "train",
            "--preset",
            "tiny",
            "--data",
            str(_corpus(tmp_path)),
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--steps",
            "6",
            "--lr",
            "1e30",
            "--warmup",
            "0",
            "--eval-every",
            "0",
            "--save-every",
            "-1",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
            "--held-out-pct",
            "10",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: training stopped at step "), err


def test_a_save_never_prunes_itself_nor_a_later_history(tmp_path):
    """A run resumed from an earlier checkpoint into a folder holding later ones (another history): the
    checkpoint just written stays and `latest` names it; of the steps up to it the newest `keep` stay; the
    later steps' folders are left until this run's own saves replace them."""
    t = {"w": torch.zeros(2)}
    for step in (6, 8):
        checkpoint.save(tmp_path, step, t, t, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000008"]
    for step in (2, 3, 4):
        final = checkpoint.save(tmp_path, step, t, t, {"step": step}, keep=2)
        assert final.is_dir() and checkpoint.follow_latest(tmp_path) == final
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000003",
        "step_00000004",
        "step_00000006",
        "step_00000008",
    ]
    checkpoint.save(tmp_path, 7, t, t, {"step": 7}, keep=2)  # past 6: its own history now
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000007", "step_00000008"]
