"""Hostile checkpoints, configs and destinations, one class at a time, with real files, FIFOs and
symlinks: containment, never blocking, values (not just shapes), the config schema, and writers that
never destroy what they did not create."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from subproc import checkout_env
from test_checkpoint_fuzz import micro_config, time_bound
from test_checkpoint_helpers import make_representable, rewrite

from dsv4 import formats as fm
from dsv4.checkpoint import CheckpointError, load_pretrained, model_values, read_config, save, to_hf_json
from dsv4.checkpoint.atomic import MARKER, stale_temporaries
from dsv4.cli import main as cli
from dsv4.config import ConfigError, ModelConfig

BOUND = 20.0  # seconds; every refusal here is immediate, the bound only turns a hang into a failure


@pytest.fixture(scope="module")
def model():
    from dsv4.model import DeepSeekV4

    return make_representable(DeepSeekV4.from_config(micro_config(), seed=5, dtype=torch.float32).eval(), "fp8", "fp4")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model):
    """A four-shard FP8 + MXFP4 release checkpoint with an index."""
    return save(
        model_values(model),
        model.cfg,
        tmp_path_factory.mktemp("h") / "ckpt",
        "fp8",
        expert_dtype="fp4",
        shard_bytes=100_000,
    )


def refused(path, *needles):
    with time_bound(BOUND), pytest.raises(CheckpointError) as ei:
        load_pretrained(path, dtype=torch.float32, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_index(d: Path, fn) -> None:
    idx = d / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    fn(obj["weight_map"])
    idx.write_text(json.dumps(obj))


# ------------------------------------------------------------------------------------------ containment
@pytest.mark.parametrize(
    "entry",
    ["../elsewhere/stolen.safetensors", "ABS", "../../../../etc/passwd", "sub/../model-00001-of-00004.safetensors"],
)
def test_index_entries_that_leave_the_directory_are_refused_by_name(ckpt, tmp_path, entry, capsys):
    d = copy(ckpt, tmp_path / "c")
    (tmp_path / "elsewhere").mkdir()
    stolen = tmp_path / "elsewhere" / "stolen.safetensors"
    shutil.copyfile(d / "model-00001-of-00004.safetensors", stolen)  # valid bytes: only the path is wrong
    entry = str(stolen) if entry == "ABS" else entry
    edit_index(d, lambda wm: wm.update({k: entry for k, v in wm.items() if v == "model-00001-of-00004.safetensors"}))
    refused(d, repr(entry))
    assert cli(["inspect", "--model", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and repr(entry) in err


def test_symlinked_shard_out_of_the_directory_is_refused(ckpt, tmp_path):
    d = copy(ckpt, tmp_path / "c")
    shard = d / "model-00002-of-00004.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    refused(d, "model-00002-of-00004.safetensors", "outside the checkpoint directory")
    cfg = d / "config.json"  # config.json too: a checkpoint's files are its own
    shutil.move(cfg, tmp_path / "config.json")
    os.symlink(tmp_path / "config.json", cfg)
    shard.unlink()
    shutil.move(outside, shard)
    refused(d, "config.json", "outside the checkpoint directory")


def test_symlinks_inside_and_hugging_face_cache_snapshots_still_load(ckpt, tmp_path, model):
    """A cache snapshot holds symlinks into the repository's blobs/: that is part of the checkpoint."""
    repo = tmp_path / "models--org--micro"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(ckpt.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    with time_bound(BOUND):
        got = load_pretrained(snap, dtype=torch.float32, progress=False)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------ never block
@pytest.mark.parametrize("kind", ["fifo", "dir", "loop", "device"])
def test_non_regular_files_are_refused_at_once(ckpt, tmp_path, kind):
    for victim in ("model-00003-of-00004.safetensors", "config.json", "model.safetensors.index.json"):
        d = copy(ckpt, tmp_path / f"{kind}-{victim}")
        (d / victim).unlink()
        if kind == "fifo":
            os.mkfifo(d / victim)
        elif kind == "dir":
            (d / victim).mkdir()
        elif kind == "loop":
            os.symlink(victim, d / victim)
        else:
            os.symlink("/dev/zero", d / victim)
        t0 = time.monotonic()
        refused(d, victim)
        assert time.monotonic() - t0 < BOUND


def test_fifo_checkpoint_does_not_hang_the_command_line(ckpt, tmp_path):
    """The real commands, in real processes: inspect and generate answer with one line and exit 2."""
    d = copy(ckpt, tmp_path / "c")
    (d / "model-00001-of-00004.safetensors").unlink()
    os.mkfifo(d / "model-00001-of-00004.safetensors")
    env = checkout_env()
    for args in (
        ["inspect", "--model", str(d)],
        ["generate", "--model", str(d), "--prompt-ids", "0,1", "--max-new-tokens", "1"],
    ):
        r = subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2, (args, r.stderr)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "FIFO" in err[0], r.stderr


def test_fifo_config_and_tokenizer(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with time_bound(BOUND), pytest.raises(ConfigError, match="FIFO"):
        ModelConfig.from_json(tmp_path / "config.json")
    from dsv4.errors import UserError
    from dsv4.tokenizer import Tokenizer

    os.mkfifo(tmp_path / "tokenizer.json")
    with time_bound(BOUND), pytest.raises(UserError, match="FIFO"):
        Tokenizer.from_file(tmp_path)


# ------------------------------------------------------------------------------------------ values
def _with_scale(ckpt, dst, name, value: int, where=(0, 0), zero_weight=False):
    def fn(n, t):
        if n == name:
            b = fm.as_e8m0_bytes(t).clone()
            b[where] = value
            return {n: fm.e8m0_from_bytes(b)}
        if zero_weight and n == name[: -len(".scale")] + ".weight":
            return {n: torch.zeros_like(t)}
        return {n: t}

    return rewrite(ckpt, dst, fn)


@pytest.mark.parametrize("name", ["layers.0.attn.wq_a.scale", "layers.1.ffn.experts.2.w1.scale"])
def test_scales_that_overflow_on_dequantization_are_refused(ckpt, tmp_path, name):
    d = _with_scale(ckpt, tmp_path / "fe", name, 0xFE)  # 2^127: FP8/FP4 codes of any size overflow bf16
    refused(d, name[: -len(".scale")], "overflow")
    d = _with_scale(ckpt, tmp_path / "ff", name, 0xFF)
    refused(d, name, "NaN")


def test_large_scales_over_zero_codes_are_accepted(ckpt, tmp_path, model):
    """The check is on the dequantized values, not a blanket limit on scale bytes."""
    d = _with_scale(ckpt, tmp_path / "z", "layers.0.attn.wq_a.scale", 0xFE, zero_weight=True)
    with time_bound(BOUND):
        got = load_pretrained(d, dtype=torch.float32, progress=False)
    assert float(got.state_dict()["layers.0.attn.wq_a.weight"].abs().max()) == 0.0


@pytest.mark.parametrize("bad", [4, -1, 2**31 - 1])
def test_tid2eid_out_of_range_is_refused(ckpt, tmp_path, bad):
    name = "layers.0.ffn.gate.tid2eid"

    def fn(n, t):
        if n == name:
            t = t.clone()
            t[7, 1] = bad
        return {n: t}

    refused(rewrite(ckpt, tmp_path / "t", fn), name, "outside [0, 4)", str(bad))


# ------------------------------------------------------------------------------------------ config schema
BASE = micro_config().to_inference_json()


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("norm_eps", -1e-6, "(0.0, 1.0]"),
        ("norm_eps", float("nan"), "finite"),
        ("rope_theta", float("nan"), "finite"),
        ("rope_theta", 1.0, "(1.0,"),
        ("compress_rope_theta", float("inf"), "finite"),
        ("hc_sinkhorn_iters", 10**9, "[1, 1000]"),
        ("hc_eps", 0.0, "(0.0, 1.0]"),
        ("dim", "64", "must be an integer, got str"),
        ("n_layers", 2.5, "must be an integer"),
        ("n_layers", True, "must be an integer, got bool"),
        ("fp8_kv_sim", "yes", "true or false"),
        ("n_activated_experts", 5, "n_routed_experts (4)"),
        ("o_groups", 3, "divisible"),
        ("vocab_size", 10**12, "must be an integer in"),
        ("score_func", None, "must be one of"),
        ("route_scale", -1, "(0.0,"),
        ("compress_ratios", [0, "4"], "entries must be integers"),
        ("max_seq_len", 2**40, "must be an integer in"),
    ],
)
def test_config_schema_names_key_value_and_rule(key, value, rule):
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict({**BASE, key: value})
    msg = str(ei.value)
    assert f"'{key}'" in msg and repr(value)[:20] in msg and rule in msg, msg


def test_config_schema_bounds_total_size_and_applies_to_hugging_face_keys(tmp_path, capsys):
    big = {**BASE, "dim": 60000, "moe_inter_dim": 900000, "n_routed_experts": 60000}
    with pytest.raises(ConfigError, match="parameters, more than the limit"):
        ModelConfig.from_dict(big)
    hf = to_hf_json(micro_config())
    for key, value in (
        ("rms_norm_eps", float("nan")),
        ("rope_scaling", {"type": "yarn", "factor": "x"}),
        ("num_hidden_layers", "2"),
        ("eos_token_id", []),
        ("layer_types", 5),
        ("rope_scaling", {"type": "yarn", "factor": 2, "beta_slow": 0}),
    ):
        with pytest.raises(ConfigError, match="config key"):
            read_config({**hf, key: value})
    for name in ("tiny", "small", "medium", "flash", "pro"):
        ModelConfig.preset(name)  # the limits leave every real config alone
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**hf, "rms_norm_eps": -1}))
    assert cli(["info", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "'norm_eps' = -1" in err


# ------------------------------------------------------------------------------------------ writers
def test_existing_destination_is_refused_untouched(model, tmp_path):
    for make in (lambda p: p.mkdir(), lambda p: p.write_text("mine"), lambda p: os.symlink(tmp_path / "x", p)):
        dst = tmp_path / "dst"
        make(dst)
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(CheckpointError, match="already exists"):
            save(model_values(model), model.cfg, dst, "bf16")
        assert sorted(os.listdir(tmp_path)) == before
        shutil.rmtree(dst) if dst.is_dir() and not dst.is_symlink() else dst.unlink()


@pytest.mark.parametrize("appears", ["empty dir", "full dir", "file"])
def test_destination_that_appears_while_writing_is_left_alone(model, tmp_path, appears):
    dst = tmp_path / "dst"

    def values():
        for i, nv in enumerate(model_values(model)):
            if i == 5:  # another process creates the destination in the middle of the write
                if appears == "file":
                    dst.write_text("theirs")
                else:
                    dst.mkdir()
                    if appears == "full dir":
                        (dst / "theirs.txt").write_text("theirs")
            yield nv

    with pytest.raises(CheckpointError, match="appeared while this writer ran"):
        save(values(), model.cfg, dst, "bf16")
    if appears == "file":
        assert dst.read_text() == "theirs"
    else:
        assert sorted(os.listdir(dst)) == ([] if appears == "empty dir" else ["theirs.txt"])
    assert sorted(os.listdir(tmp_path)) == ["dst"]  # our temporary directory is gone


WRITER = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_checkpoint_fuzz import micro_config
from dsv4.model import DeepSeekV4
from dsv4.checkpoint import model_values, save, CheckpointError
m = DeepSeekV4.from_config(micro_config(), seed=1, dtype=torch.float32)
def slow():
    for i, nv in enumerate(model_values(m)):
        if i == 3:
            print("writing", flush=True)
            if sys.argv[2] == "hold":      # held mid-write until the parent says go (a line on stdin)
                sys.stdin.readline()
            else:
                time.sleep(float(sys.argv[2]))
        yield nv
try:
    save(slow(), m.cfg, sys.argv[1], "bf16")
except CheckpointError as e:
    print("refused:", e, flush=True)
    sys.exit(2)
"""


def _writer(dst: Path, pause: float | str) -> subprocess.Popen:
    """A process that saves a checkpoint to dst and stops after its fourth tensor: for `pause` seconds, or
    with pause="hold" until a line arrives on its stdin."""
    code = WRITER.format(tests=str(Path(__file__).resolve().parent))
    env = checkout_env()
    return subprocess.Popen(
        [sys.executable, "-c", code, str(dst), str(pause)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_concurrent_writers_exactly_one_succeeds(tmp_path):
    """Two processes write the same destination; each is held after its fourth tensor until both have
    got there, so both are provably mid-write at once whatever the machine's speed; then both go on."""
    dst = tmp_path / "dst"
    procs = [_writer(dst, "hold") for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "writing"  # held mid-write: both are writing at the same time
    assert not dst.exists()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.close()
    codes = sorted(p.wait(timeout=120) for p in procs)
    assert codes == [0, 2]
    load_pretrained(dst, dtype=torch.float32, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["dst"]


def test_killed_writer_leaves_a_marked_temp_dir_that_the_next_run_cleans(model, tmp_path, caplog):
    dst = tmp_path / "out" / "dst"
    p = _writer(dst, 60.0)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait(timeout=30)
    left = [t for t, _ in stale_temporaries(dst.parent)]
    assert len(left) == 1 and left[0].name.startswith(".dst.dsv4-tmp-")
    assert json.loads((left[0] / MARKER).read_text())["pid"] == p.pid
    assert stale_temporaries(dst.parent)[0][1] == "dead"
    foreign = dst.parent / ".other.dsv4-tmp-nomarker"  # same name pattern, no marker: reported, kept
    foreign.mkdir()
    not_ours = dst.parent / "keep-me"
    not_ours.mkdir()
    with caplog.at_level(logging.WARNING, logger="dsv4.checkpoint"):
        save(model_values(model), model.cfg, dst, "bf16")
    assert not left[0].exists() and foreign.exists() and not_ours.exists()
    assert "removed" in caplog.text and "leaving" in caplog.text and foreign.name in caplog.text


# ------------------------------------------------------------------------------------------ training pointer
def test_training_resume_pointer_stays_inside_the_run(tmp_path):
    from dsv4.errors import UserError
    from dsv4.train import checkpoint as tc

    run = tmp_path / "run" / "checkpoints"
    tc.save(run, 1, {"w": torch.ones(2)}, {}, {"step": 1})
    assert tc.resolve(run) == run / "step_00000001"
    outside = tmp_path / "step_00000009"
    shutil.copytree(run / "step_00000001", outside)
    for pointer in ("../../step_00000009", "/etc", "step_00000009"):
        if pointer == "step_00000009":
            os.symlink(outside, run / pointer)  # a step directory that is a symlink out of the run
        (run / "latest").write_text(pointer + "\n")
        with time_bound(BOUND), pytest.raises(UserError):
            tc.resolve(run)
    (run / "latest").unlink()
    os.mkfifo(run / "latest")
    with time_bound(BOUND), pytest.raises(UserError, match="FIFO"):
        tc.resolve(run)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_written_folder_has_the_modes_the_umask_gives_any_new_folder(tmp_path, umask):
    """The temporary folder a checkpoint is written in becomes the checkpoint: it gets the mode a plain
    mkdir would (readable by a serving account under the usual umask), not the temporary folder's 0700."""
    from dsv4.checkpoint.atomic import atomic_directory

    old = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "ckpt") as tmp:
            (tmp / "x").write_text("x")
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    mode = (tmp_path / "ckpt").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777 == 0o777 & ~umask
