"""Training checkpoints: resumable, atomic, verified.

A checkpoint is a directory `step_XXXXXXXX/` under the run's checkpoint folder holding
- `model.safetensors`: every parameter and buffer (router biases, hash tables) in their live dtypes;
- `optimizer.safetensors`: Muon momentum and AdamW moments by parameter name, full (unsharded) tensors in
  the single-process layout (`muon/<param>/momentum_buffer`, `adamw/<param>/exp_avg|exp_avg_sq|step`)
  whatever the number of processes that wrote it (see `optimizer_tensors`);
- `state.json`: step, data-loader position, metrics history needed to continue, the run's settings;
- `manifest.json`: SHA-256 of each of the files above.
It is written into a temporary sibling directory and renamed into place, then `latest` (a one-line
file) is replaced atomically. Loading re-hashes every file first: a truncated or altered checkpoint is
refused with a message instead of silently resuming from garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.atomic import atomic_directory, fsync_dir
from ..errors import CheckpointError, UserError
from ..safe_paths import contained, open_regular, read_text

FILES = ("model.safetensors", "optimizer.safetensors", "state.json")

# (tensor shaped like parameter p, p) -> the full tensor / (full tensor, p) -> this process's part of it
Gather = Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]
Scatter = Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]


class CorruptCheckpoint(UserError):
    """The checkpoint's files do not match its manifest (or it is incomplete)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:  # a FIFO or device in a checkpoint must not block the resume
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):  # DTensor (FSDP2): gather the full tensor
            v = v.full_tensor()
        out[k] = v.detach().cpu().contiguous()
    return out


def _muon_views(opt, params: dict[str, torch.nn.Parameter]):
    """(name, parameter, its 2-D Muon views) in MuonAdamW's order (a stacked [E, out, in] tensor has E views)."""
    views = iter(opt.muon_params)
    for name in opt.muon_names:
        p = params[name]
        n = 1 if p.dim() == 2 else p.shape[:-2].numel()
        yield name, p, [next(views) for _ in range(n)]


_ADAMW_KEYS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def optimizer_tensors(
    opt, model: torch.nn.Module, full: Gather | None = None, keep: bool = True
) -> dict[str, torch.Tensor]:
    """MuonAdamW's state as full CPU tensors keyed by parameter name (the single-process layout).

    `full(t, p)` turns a tensor shaped like parameter p (a sharded or rank-local moment) into the whole
    tensor; under torch.distributed it is a collective, so every process must call this (in the same
    order), and `keep=False` drops the gathered tensors on processes that do not write them.
    State not created yet is stored as zeros (Muon: identical to a fresh buffer) and AdamW step 0 (skipped
    when loading), so every process gathers the same list of tensors.
    """
    full = full or (lambda t, p: t)
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor, p: torch.nn.Parameter) -> None:
        t = full(t, p)
        if keep:
            out[key] = t.detach().to("cpu", copy=True).contiguous()

    if opt.muon is not None:
        for name, p, views in _muon_views(opt, params):
            bufs = [opt.muon.state.get(v, {}).get("momentum_buffer") for v in views]
            bufs = [torch.zeros_like(v) if b is None else b for b, v in zip(bufs, views)]
            put(f"muon/{name}/momentum_buffer", bufs[0] if p.dim() == 2 else torch.stack(bufs).reshape(p.shape), p)
    for name in opt.adamw_names:
        p = params[name]
        st = opt.adamw.state.get(p, {})
        for k in _ADAMW_KEYS:
            put(f"adamw/{name}/{k}", st[k] if k in st else torch.zeros_like(p), p)
        if keep:
            out[f"adamw/{name}/step"] = torch.tensor(float(st.get("step", 0.0)), dtype=torch.float32)
    return out


@torch.no_grad()
def load_optimizer_tensors(
    opt, model: torch.nn.Module, tensors: dict[str, torch.Tensor], local: Scatter | None = None
) -> None:
    """Restore MuonAdamW's state from `optimizer_tensors` output; `local(full, p)` cuts this process's part
    (no communication). Raises ValueError when the names or shapes do not fit the optimizer."""
    local = local or (lambda t, p: t)
    params = dict(model.named_parameters())
    want = set()
    if opt.muon is not None:
        want |= {f"muon/{n}/momentum_buffer" for n in opt.muon_names}
    want |= {f"adamw/{n}/{k}" for n in opt.adamw_names for k in (*_ADAMW_KEYS, "step")}
    if set(tensors) != want:
        raise ValueError(
            f"optimizer state has {sorted(set(tensors) - want)[:3]} unexpected and "
            f"{sorted(want - set(tensors))[:3]} missing entries"
        )

    def part(key: str, p: torch.nn.Parameter, shape: torch.Size) -> torch.Tensor:
        t = tensors[key]
        if t.shape != shape:
            raise ValueError(f"{key}: shape {tuple(t.shape)}, the model's parameter has {tuple(shape)}")
        return local(t.to(device=p.device, dtype=p.dtype), p)

    def index_of(o: torch.optim.Optimizer) -> dict[int, int]:
        ps = [q for g in o.param_groups for q in g["params"]]
        return {id(q): i for i, q in enumerate(ps)}

    if opt.muon is not None:
        idx, state = index_of(opt.muon), {}
        for name, p, views in _muon_views(opt, params):
            full_shape = tensors[f"muon/{name}/momentum_buffer"].shape
            buf = part(f"muon/{name}/momentum_buffer", p, full_shape)  # p's layout
            bufs = [buf] if p.dim() == 2 else list(buf.reshape(-1, *p.shape[-2:]).unbind(0))
            for v, b in zip(views, bufs, strict=True):
                state[idx[id(v)]] = {"momentum_buffer": b.clone()}
        sd = opt.muon.state_dict()
        opt.muon.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    idx, state = index_of(opt.adamw), {}
    for name in opt.adamw_names:
        p = params[name]
        step = tensors[f"adamw/{name}/step"]
        if float(step) == 0:  # never stepped: leave the state to be created fresh
            continue
        state[idx[id(p)]] = {
            "step": step.float().cpu().clone(),
            **{k: part(f"adamw/{name}/{k}", p, tensors[f"adamw/{name}/{k}"].shape).clone() for k in _ADAMW_KEYS},
        }
    sd = opt.adamw.state_dict()
    opt.adamw.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def save(
    root: str | Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    optim_tensors: dict[str, torch.Tensor],
    state: dict,
    keep: int = 2,
) -> Path:
    """Write step_<step>/ atomically and point `latest` at it; keep it and the `keep` - 1 before it. Those of
    later steps (a run resumed from an earlier checkpoint into the same folder: another history) are left as
    they are until this run's own saves replace them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    with atomic_directory(final, replace=True) as tmp:  # a step re-saved after a resume replaces its own
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"step": str(step)})
        save_file(optim_tensors, str(tmp / "optimizer.safetensors"), metadata={"step": str(step)})
        (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        manifest = {name: _sha256(tmp / name) for name in FILES}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for name in (*FILES, "manifest.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
    latest_tmp = root / f".latest.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        latest_tmp.unlink()
    fd = os.open(latest_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    fsync_dir(root)
    if keep > 0:  # only directories this writer makes: step_<8 digits> holding a manifest, never symlinks
        ours = [
            p
            for p in root.iterdir()
            if _STEP_RE.match(p.name) and not p.is_symlink() and p.is_dir() and (p / "manifest.json").exists()
        ]
        upto = sorted((int(p.name[5:]), p) for p in ours if int(p.name[5:]) <= step)
        for _, p in upto[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    return final


_STEP_RE = re.compile(r"^step_\d{8,}$")


def follow_latest(root: str | Path) -> Path:
    """The checkpoint directory that `root/latest` names, opened like every checkpoint file: `latest` itself
    must resolve inside the run (a symlink out of it is refused), be a regular file (a FIFO or device is
    refused without blocking) of at most 4 KiB, and name `step_<number>`, a directory directly inside
    `root` (symlinks followed). Its content is quoted in an error only as a short, escaped prefix."""
    root = Path(root)
    pointer = root / "latest"
    try:
        contained(root, "latest", str(pointer))
        name = read_text(pointer, limit=4096).strip()
    except CheckpointError as e:
        raise CorruptCheckpoint(
            str(e).replace("outside the checkpoint directory", "not a checkpoint inside the run directory")
        ) from None
    if not _STEP_RE.match(name):
        raise CorruptCheckpoint(
            f"{pointer} names {name[:40]!r}{'...' if len(name) > 40 else ''}, which is not a "
            f"checkpoint inside {root} (step_<number>): refused"
        )
    try:
        target = contained(root, name, str(pointer))
    except CheckpointError:
        raise CorruptCheckpoint(
            f"{pointer} names {name}, which is not a checkpoint inside {root} (a symlink out of the run): refused"
        ) from None
    real = Path(os.path.realpath(target))
    if real.parent != Path(os.path.realpath(root)):
        raise CorruptCheckpoint(f"{pointer} names {name}, which is not a checkpoint inside {root}: refused")
    if not target.is_dir():
        raise CorruptCheckpoint(f"{pointer}: points at {name}, which is missing")
    return target


def latest_name(root: str | Path) -> str | None:
    """The name of the run's latest checkpoint, for messages (None when there is none or it is unusable)."""
    try:
        return follow_latest(root).name if os.path.lexists(Path(root) / "latest") else None
    except UserError:
        return None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a run's checkpoint folder (follows `latest`)."""
    p = Path(path)
    if (p / "manifest.json").exists() or (p / "model.safetensors").exists():
        return p
    if os.path.lexists(p / "latest"):
        return follow_latest(p)
    raise UserError(f"{p}: no training checkpoint here (no manifest.json and no 'latest' file)")


def verify(ckpt: Path) -> None:
    mf = ckpt / "manifest.json"
    if not mf.exists():
        raise CorruptCheckpoint(f"{ckpt}: manifest.json is missing; the checkpoint is incomplete")
    try:
        manifest = json.loads(read_text(mf))
        if not isinstance(manifest, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):
        raise CorruptCheckpoint(f"{ckpt}: manifest.json is not valid JSON") from None
    if "optimizer.pt" in manifest:
        raise CorruptCheckpoint(f"{ckpt}: written by an earlier version (optimizer.pt), which cannot be resumed")
    for name in FILES:
        f = ckpt / name
        if not f.exists():
            raise CorruptCheckpoint(f"{ckpt}: {name} is missing")
        if _sha256(f) != manifest.get(name):
            raise CorruptCheckpoint(
                f"{ckpt}: {name} does not match its recorded SHA-256 (corrupt or "
                "modified); resume from an earlier checkpoint"
            )


def load(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict, dict, dict]:
    """-> (dir, model tensors, optimizer tensors, state.json) after verifying every file."""
    ckpt = resolve(path)
    verify(ckpt)
    try:
        tensors = load_file(str(ckpt / "model.safetensors"), device=str(map_location))
        optim = load_file(str(ckpt / "optimizer.safetensors"), device="cpu")
        state = json.loads(read_text(ckpt / "state.json"))
    except CheckpointError:
        raise
    except Exception as e:  # hash matched but the content is unreadable (e.g. written by another version)
        raise CorruptCheckpoint(f"{ckpt}: cannot read the checkpoint ({str(e)[:200]})") from None
    from .resume_checks import nonfinite_problem, state_problem

    why = state_problem(state, ckpt)
    if why:
        raise CorruptCheckpoint(f"{ckpt / 'state.json'}: {why}")
    for file, content in (("model.safetensors", tensors), ("optimizer.safetensors", optim)):
        why = nonfinite_problem(content)
        if why:
            raise CorruptCheckpoint(
                f"{ckpt / file}: {why}; a run does not resume from non-finite weights or "
                "optimizer state (resume from an earlier checkpoint)"
            )
    return ckpt, tensors, optim, state
