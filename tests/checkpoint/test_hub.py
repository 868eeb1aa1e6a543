"""Hub ids as model arguments, resolved offline from a Hugging Face cache laid out as huggingface_hub writes it.

The cache is built from the shipped checkpoint the way huggingface_hub stores a download: content-addressed
blobs (git SHA-1 for small files, SHA-256 for LFS files such as shards), snapshots/<commit>/<file> as
relative symlinks to them, refs/<name> holding the commit. huggingface_hub's own cache scanner must read
it back, so the layout is the library's, not a guess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subproc import checkout_env

from dsv4.checkpoint import CheckpointError, load_pretrained
from dsv4.checkpoint.hub import META_PATTERNS, is_hub_id, parse_hub_id, resolve_model_path
from dsv4.cli import default_model_dir

huggingface_hub = pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = default_model_dir()
REPO = "dsv4-test/stdlib-v4-mini"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def _blob_name(data: bytes, lfs: bool) -> str:
    """The blob file name huggingface_hub uses: the LFS SHA-256, or the git blob SHA-1 of a small file."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(
    cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",)
) -> Path:
    """Write `files` into the cache as huggingface_hub does after a download of `repo` at `commit`."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo_dir / "blobs" / _blob_name(data, lfs=name.endswith(".safetensors"))
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


def shipped_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(SHIPPED.iterdir()) if p.is_file()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """HF_HOME=tmp_path, offline, holding the shipped model as REPO (main and the tag v1) and an older
    revision without weights."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, COMMIT, shipped_files(), refs=("main", "v1"))
    return cache


def test_cache_layout_is_what_huggingface_hub_reads(hub_cache):
    info = huggingface_hub.scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == COMMIT and rev.refs == {"main", "v1"}
    assert {f.file_name for f in rev.files} == set(shipped_files())


def test_hub_id_shape_and_directory_precedence(tmp_path, monkeypatch):
    assert parse_hub_id("deepseek-ai/DeepSeek-V4-Flash") == ("deepseek-ai/DeepSeek-V4-Flash", None)
    assert parse_hub_id("deepseek-ai/DeepSeek-V4-Flash@v1.0") == ("deepseek-ai/DeepSeek-V4-Flash", "v1.0")
    assert parse_hub_id(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_id in ("name", "/abs/path", "a/b/c", "./a", "../a/b", "a/..", "org/name@", "org name/x"):
        assert parse_hub_id(not_id) is None, not_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing directory wins
    assert resolve_model_path("org/name") == Path("org/name")
    assert is_hub_id("org/other")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_model_path("no-such-dir")


def test_load_pretrained_from_the_cache_equals_the_directory(hub_cache):
    snap = resolve_model_path(REPO)
    assert snap == hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model_path(f"{REPO}@v1") == snap and resolve_model_path(f"{REPO}@{COMMIT}") == snap
    from_hub = load_pretrained(REPO).state_dict()
    from_dir = load_pretrained(SHIPPED).state_dict()
    assert from_hub.keys() == from_dir.keys()
    for k in from_dir:
        assert torch.equal(from_hub[k], from_dir[k]), k


def test_a_revision_not_cached(hub_cache):
    with pytest.raises(CheckpointError) as e:
        resolve_model_path(f"{REPO}@v2")
    msg = str(e.value)
    assert "revision 'v2' is not in the Hugging Face cache" in msg and "main" in msg and "v1" in msg
    assert "HF_HUB_OFFLINE" in msg and "\n" not in msg


def test_a_repository_not_cached(hub_cache):
    with pytest.raises(
        CheckpointError, match=r"^other/model: not a directory, and not in the Hugging Face cache .*HF_HUB_OFFLINE"
    ):
        resolve_model_path("other/model")


def test_a_missing_shard_is_named_before_any_weight_is_read(hub_cache):
    files = shipped_files()
    index = json.loads(files["model.safetensors.index.json"])
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2  # (the shipped model comes in shards)
    del files[shards[1]]
    add_snapshot(hub_cache, "dsv4-test/partial", COMMIT, files)
    with pytest.raises(
        CheckpointError,
        match=rf"dsv4-test/partial: shard {shards[1]} \(1 of {len(shards)} named by the index\) "
        r"is not in the Hugging Face cache",
    ):
        load_pretrained("dsv4-test/partial")
    assert resolve_model_path("dsv4-test/partial", weights=False).is_dir()  # config and index are there


def test_a_repository_that_is_not_deepseek_v4(hub_cache):
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 128,
    }
    add_snapshot(
        hub_cache,
        "meta-llama/tiny",
        COMMIT,
        {"config.json": json.dumps(llama).encode(), "model.safetensors": b"\0" * 16},
    )
    with pytest.raises(
        CheckpointError,
        match=r"meta-llama/tiny: not a DeepSeek-V4 model \(model_type 'llama', "
        r"architectures LlamaForCausalLM\)",
    ):
        load_pretrained("meta-llama/tiny")
    add_snapshot(hub_cache, "someone/dataset-like", COMMIT, {"README.md": b"# not a model\n"})
    with pytest.raises(CheckpointError, match="no config.json in the repository"):
        resolve_model_path("someone/dataset-like")


def test_only_the_files_loading_reads_are_requested():
    """The first fetch asks for configuration only; the shard names come from the index alone."""
    from fnmatch import fnmatch

    for name in shipped_files():
        meta = any(fnmatch(name, p) for p in META_PATTERNS)
        assert meta == (not name.endswith(".safetensors")), name


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    full = checkout_env(**env, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "dsv4", *args], capture_output=True, text=True, env=full, timeout=300)


def test_cli_generate_with_a_hub_id_matches_the_directory(hub_cache):
    env = {"HF_HOME": str(hub_cache.parent), "HF_HUB_OFFLINE": "1"}
    common = ["--prompt-ids", "0,15,27", "--max-new-tokens", "4", "--json"]
    hub = _cli(["generate", "--model", f"{REPO}@v1", *common], env)
    assert hub.returncode == 0, hub.stderr
    local = _cli(["generate", "--model", str(SHIPPED), *common], env)
    assert json.loads(hub.stdout)["ids"] == json.loads(local.stdout)["ids"]


def test_cli_bad_hub_ids_are_one_error_line_exit_2(hub_cache):
    files = shipped_files()
    shard = sorted(set(json.loads(files["model.safetensors.index.json"])["weight_map"].values()))[0]
    del files[shard]
    add_snapshot(hub_cache, "dsv4-test/partial", COMMIT, files)
    env = {"HF_HOME": str(hub_cache.parent), "HF_HUB_OFFLINE": "1"}
    ok = _cli(["inspect", "--model", f"{REPO}@v1", "--json"], env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"], ok.stderr
    cases = [
        (["info", "--model", f"{REPO}@v2"], "revision 'v2' is not in the Hugging Face cache"),
        (["inspect", "--model", "dsv4-test/partial"], f"shard {shard}"),
    ]
    for args, want in cases:
        r = _cli(args, env)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_hub_unreachable_falls_back_to_the_cache(hub_cache):
    """Not offline, but the Hub does not answer (a closed local port as its endpoint): a cached repository
    still resolves from the cache, an uncached one is one error line naming both causes."""
    env = {"HF_HOME": str(hub_cache.parent), "HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}
    ok = _cli(["info", "--model", REPO, "--json"], env)
    assert ok.returncode == 0, ok.stderr
    cfg = json.loads(ok.stdout)["config"]
    assert cfg["dim"] == json.loads((SHIPPED / "config.json").read_text())["hidden_size"]
    assert cfg["name"] == REPO  # named by its id, not by the snapshot's hash
    bad = _cli(["info", "--model", "other/model"], env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: other/model: not a directory, and not in the Hugging Face cache {hub_cache} "
        "and the Hub could not be reached"
    ]


def test_nothing_of_the_cache_is_changed(hub_cache):
    """Resolution reads the cache; it never rewrites or deletes what huggingface_hub stored."""
    before = {p: p.stat().st_mtime_ns for p in hub_cache.rglob("*")}
    resolve_model_path(REPO)
    with pytest.raises(CheckpointError):
        resolve_model_path(f"{REPO}@v2")
    assert {p: p.stat().st_mtime_ns for p in hub_cache.rglob("*")} == before
