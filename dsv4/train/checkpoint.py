"""Training checkpoints: resumable, atomic, verified.

A checkpoint is a directory `step_XXXXXXXX/` under the run's checkpoint folder holding
- `model.safetensors`: every parameter and buffer (router biases, hash tables) in their live dtypes;
- `optimizer.pt`: Muon and AdamW state (weights_only loadable);
- `state.json`: step, data-loader position, metrics history needed to continue, the run's settings;
- `manifest.json`: SHA-256 of each of the files above.
It is written into a temporary sibling directory and renamed into place, then `latest` (a one-line
file) is replaced atomically. Loading re-hashes every file first: a truncated or altered checkpoint is
refused with a message instead of silently resuming from garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError

FILES = ("model.safetensors", "optimizer.pt", "state.json")


class CorruptCheckpoint(UserError):
    """The checkpoint's files do not match its manifest (or it is incomplete)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):          # DTensor (FSDP2): gather the full tensor
            v = v.full_tensor()
        out[k] = v.detach().cpu().contiguous()
    return out


def save(root: str | Path, step: int, tensors: dict[str, torch.Tensor], optim_state: dict, state: dict,
         keep: int = 2) -> Path:
    """Write step_<step>/ atomically and point `latest` at it; keep the newest `keep` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"step": str(step)})
        torch.save(optim_state, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        manifest = {name: _sha256(tmp / name) for name in FILES}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for name in (*FILES, "manifest.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    if keep > 0:
        old = sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run's checkpoint folder (follows `latest`)."""
    p = Path(path)
    if (p / "manifest.json").exists() or (p / "model.safetensors").exists():
        return p
    if (p / "latest").exists():
        return p / (p / "latest").read_text().strip()
    raise UserError(f"{p}: no training checkpoint here (no manifest.json and no 'latest' file)")


def verify(ckpt: Path) -> None:
    mf = ckpt / "manifest.json"
    if not mf.exists():
        raise CorruptCheckpoint(f"{ckpt}: manifest.json is missing; the checkpoint is incomplete")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError:
        raise CorruptCheckpoint(f"{ckpt}: manifest.json is not valid JSON") from None
    for name in FILES:
        f = ckpt / name
        if not f.exists():
            raise CorruptCheckpoint(f"{ckpt}: {name} is missing")
        if _sha256(f) != manifest.get(name):
            raise CorruptCheckpoint(f"{ckpt}: {name} does not match its recorded SHA-256 (corrupt or "
                                    "modified); resume from an earlier checkpoint")


def load(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict, dict, dict]:
    """-> (dir, model tensors, optimizer state, state.json) after verifying every file."""
    ckpt = resolve(path)
    verify(ckpt)
    try:
        tensors = load_file(str(ckpt / "model.safetensors"), device=str(map_location))
        optim = torch.load(ckpt / "optimizer.pt", map_location=map_location, weights_only=True)
        state = json.loads((ckpt / "state.json").read_text())
    except Exception as e:  # hash matched but the content is unreadable (e.g. written by another version)
        raise CorruptCheckpoint(f"{ckpt}: cannot read the checkpoint ({e})") from None
    return ckpt, tensors, optim, state
