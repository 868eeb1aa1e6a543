"""A model argument that names a Hugging Face Hub repository: `org/name` or `org/name@revision`.

Users fetch DeepSeek-V4 from the Hub, so every `--model` and `load_pretrained` takes a repository id as
well as a directory. The rule that decides between them: a string naming an existing directory is that
directory; an id-shaped string that is not a directory is a Hub id; anything else is a missing directory.

Fetching goes through `huggingface_hub` and so inherits its behaviour: the shared cache (`HF_HOME`,
`HF_HUB_CACHE`), tokens (`HF_TOKEN`, `hf auth login`), offline mode (`HF_HUB_OFFLINE=1`: the cache only)
and resumable downloads. Only what loading reads is fetched, in two steps: first config.json, the
tokenizer files and the safetensors index; then the config is checked to be a DeepSeek-V4 one (before a
shard is downloaded), and only the shards the index names are fetched. The directory returned is the
cache's snapshot, which `load_pretrained` then validates header by header like any local directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .layouts import CONFIG_FILES
from .safetensors_io import CheckpointError

# owner/name as the Hub spells them, then an optional @revision (a branch, tag or commit hash)
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<rev>[A-Za-z0-9._/-]+))?$"
)
META_PATTERNS = [*CONFIG_FILES, "*.safetensors.index.json"]
V4_MODEL_TYPE = "deepseek_v4"


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` is shaped like a Hub id, else None."""
    m = _HUB_ID.match(spec)
    if m is None or ".." in spec:
        return None
    return m["repo"], m["rev"]


def is_hub_id(spec: str | Path) -> bool:
    """True for an id-shaped string that is not an existing directory (the directory wins)."""
    return not Path(spec).is_dir() and parse_hub_id(str(spec)) is not None


def resolve_model_path(spec: str | Path, *, weights: bool = True) -> Path:
    """The local directory of `spec`: the directory itself, or the Hub cache snapshot of a repository id.

    weights=False fetches only the config, tokenizer and index (what `dsv4 info` needs).
    Raises CheckpointError (a UserError: one line, exit 2 on the command line) with the reason."""
    path = Path(spec)
    if path.is_dir():
        return path
    parsed = parse_hub_id(str(spec))
    if parsed is None:
        raise CheckpointError(f"{spec}: not a directory (nor a Hugging Face Hub id such as org/name[@revision])")
    repo, revision = parsed
    root = _snapshot(repo, revision, META_PATTERNS)
    _check_v4(repo, revision, root)
    if weights:
        shards = _indexed_shards(repo, revision, root)
        root = _snapshot(repo, revision, shards if shards is not None else ["*.safetensors"])
        if shards is not None:
            missing = [s for s in shards if not (root / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"{_label(repo, revision)}: shard {missing[0]} ({len(missing)} of {len(shards)} named by the "
                    f"index) is not in the Hugging Face cache {_cache_dir()}"
                    f"{_offline_hint() or ' after the download: the repository does not hold it'}"
                )
    return root


# --------------------------------------------------------------------------------------- internals
def _label(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def _cache_dir() -> Path:
    """The hub cache huggingface_hub uses, read from the environment now (not when it was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _offline_hint() -> str:
    return " and HF_HUB_OFFLINE is set (fetch it once with network access)" if _offline() else ""


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """snapshot_download of the files matching `patterns`, its errors turned into one-line messages."""
    try:
        from huggingface_hub import errors as hf_errors
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{repo}: a Hub id needs the huggingface_hub package (pip install huggingface_hub)"
        ) from None
    cache = _cache_dir()
    try:
        return Path(
            snapshot_download(
                repo, revision=revision, allow_patterns=patterns, cache_dir=cache, local_files_only=_offline()
            )
        )
    except hf_errors.LocalEntryNotFoundError:
        raise CheckpointError(_not_cached(repo, revision, cache)) from None
    except hf_errors.GatedRepoError:
        raise CheckpointError(
            f"{repo}: a gated repository; accept its terms on the Hub and log in (HF_TOKEN or `hf auth login`)"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo}: not a directory, and no such repository on the Hugging Face Hub (or it "
            "is private: set HF_TOKEN or run `hf auth login`)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise CheckpointError(f"{_label(repo, revision)}: the repository has no revision '{revision}'") from None
    except (hf_errors.HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{_label(repo, revision)}: download from the Hugging Face Hub failed ({first}); "
            "an interrupted download resumes when run again"
        ) from None


def _not_cached(repo: str, revision: str | None, cache: Path) -> str:
    """Why offline resolution failed: the repository is absent, or present without this revision."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    refs = sorted(p.name for p in (repo_dir / "refs").glob("*")) if (repo_dir / "refs").is_dir() else []
    snaps = sorted(p.name[:12] for p in (repo_dir / "snapshots").glob("*")) if repo_dir.is_dir() else []
    why = _offline_hint() or " and the Hub could not be reached"
    if not repo_dir.is_dir():
        return f"{repo}: not a directory, and not in the Hugging Face cache {cache}{why}"
    cached = ", ".join(refs + [s for s in snaps if s not in refs]) or "none"
    return (
        f"{_label(repo, revision)}: revision '{revision or 'main'}' is not in the Hugging Face cache {cache} "
        f"(cached: {cached}){why}"
    )


def _check_v4(repo: str, revision: str | None, root: Path) -> None:
    """Refuse a repository that is not a DeepSeek-V4 model before any shard is fetched."""
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{_label(repo, revision)}: no config.json in the repository (not a model repository)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{_label(repo, revision)}: config.json is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if model_type not in (None, V4_MODEL_TYPE) or (archs and not any("DeepseekV4" in str(a) for a in archs)):
        what = f"model_type '{model_type}'" + (f", architectures {', '.join(map(str, archs))}" if archs else "")
        raise CheckpointError(
            f"{_label(repo, revision)}: not a DeepSeek-V4 model ({what}); dsv4 runs "
            f"model_type '{V4_MODEL_TYPE}' checkpoints"
        )
    from .layouts import load_config

    load_config(root)  # the same config validation as a local directory


def _indexed_shards(repo: str, revision: str | None, root: Path) -> list[str] | None:
    """The shard file names the safetensors index lists, or None when the repository has no index."""
    index = sorted(root.glob("*.safetensors.index.json"))
    if not index:
        return None
    try:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{_label(repo, revision)}: {index[0].name} is not a valid safetensors index ({e})"
        ) from None


__all__ = ["META_PATTERNS", "is_hub_id", "parse_hub_id", "resolve_model_path"]
