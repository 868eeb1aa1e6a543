"""What every checkpoint layout is: the `Layout` base class, the registry, and what all layouts share
(finding the safetensors files of a directory, reading its config.json, the release storage rules).

A layout is one object that owns everything that differs between checkpoint directories holding the same
weights: how it is recognized from its files and tensor names (`claims`), the tensors it must contain
(`tensors`: official names; `expected`: stored names, shapes and dtypes), how stored pieces combine into
one official tensor (`split_dim`, `gather`, `replicated`: the inference layout's model-parallel ranks),
what its config.json means (`semantics`, `load_config`), whether a validated checkpoint may be loaded
(`prepare_load`), and how official tensors are written into it (`writer`: the `from_official` direction;
reading goes through `names.canonical`, the `to_official` direction). Each layout is one module of this
package that subclasses `Layout` and decorates it with `@register`; nothing else names it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...config import ModelConfig
from ...safe_paths import contained, read_text, regular_file
from ..inventory import Piece, Plan, Problems, without_mtp
from ..names import EXPERT, F32, INT, LINEAR, Spec, expert_index, official_tensors, scale_name
from ..safetensors_io import CheckpointError

if TYPE_CHECKING:
    from ..storage import Value

_MP_RE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


# ------------------------------------------------------------------------------------------ registry
_LAYOUTS: dict[str, Layout] = {}


__all__ = [
    "CONFIG_FILES",
    "Layout",
    "LayoutWriter",
    "config_from_json",
    "detect",
    "find_files",
    "get",
    "load_config",
    "logical_numel",
    "names",
    "parameter_totals",
    "raw_config",
    "register",
    "release_storage",
    "unregister",
    "without_mtp",
]


def register(cls: type[Layout]) -> type[Layout]:
    """Class decorator: make a layout known by its name (detection, --layout, inspect)."""
    if cls.name in _LAYOUTS:
        raise ValueError(f"layout '{cls.name}' registered twice")
    _LAYOUTS[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Forget a layout (one registered for a while, e.g. by a test or a plugin being unloaded)."""
    _LAYOUTS.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered layout, in registration order."""
    return tuple(_LAYOUTS)


def get(name: str) -> Layout:
    """The layout called `name`; ValueError for an unknown one."""
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout must be one of {names()}, got {name!r}") from None


def detect(stored_names: Iterable[str], rank_files: bool) -> Layout:
    """The layout of a directory from its kind of files and its tensor names: the most specific layout
    (highest `priority`) among those of the same kind of files that claims the names."""
    stored = list(stored_names)
    for lay in sorted(_LAYOUTS.values(), key=lambda x: -x.priority):
        if lay.rank_files == rank_files and lay.claims(stored):
            return lay
    raise CheckpointError("no checkpoint layout recognizes these files")  # pragma: no cover - release claims all


# ------------------------------------------------------------------------------------------ the base
class Layout:
    """One checkpoint layout. Subclasses set `name` and override what differs from this default: a
    directory of `*.safetensors` shards holding official names, one stored piece per tensor."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    rank_files: ClassVar[bool] = False  # stored as model{rank}-mp{N}.safetensors, one file per rank
    priority: ClassVar[int] = 0  # detection order among layouts of the same kind of files, highest first
    semantics: ClassVar[dict[str, Any]] = {}  # ModelConfig fields this layout's config.json implies
    writable: ClassVar[bool] = True

    # ---------------------------------------------------------------------------- recognize, configure
    def claims(self, stored_names: list[str]) -> bool:
        """Whether tensors with these stored names are a checkpoint of this layout."""
        return True

    def config_keys(self, raw: dict[str, Any]) -> set[str]:
        """Keys of a config.json that describe this layout's extras, not the model (`ModelConfig` does
        not know them; the config is read without them)."""
        return set()

    def configure(self, cfg: ModelConfig, stored_names: list[str], root: Path) -> tuple[ModelConfig, list[str]]:
        """The config read from config.json, adjusted to what the tensor names show where this layout's
        config.json is known to understate it, with a warning for each change (default: unchanged)."""
        return cfg, []

    def load_config(self, root: Path, overrides: dict | None = None) -> ModelConfig:
        """The directory's config.json read with this layout's semantics, then `overrides` applied."""
        return load_config(root, {**self.semantics, **(overrides or {})})

    # ---------------------------------------------------------------------------- inventory
    def tensors(self, cfg: ModelConfig, root: Path | None = None) -> dict[str, Spec]:
        """{official name: Spec} of the weights a checkpoint of cfg in this layout holds (no scales)."""
        return official_tensors(cfg)

    def expected(self, cfg: ModelConfig, mtp: bool = True) -> dict[str, tuple]:
        """{stored name: (shape, safetensors dtype)} the layout must contain for cfg (bf16/fp8 per cfg)."""
        out: dict[str, tuple] = {}
        for name, spec in self.tensors(cfg).items():
            if mtp or not name.startswith("mtp."):
                out.update(release_storage(cfg, name, spec.shape, spec.role))
        return out

    def mtp_absent(self, root: Path) -> str | None:
        """A warning when a checkpoint of this layout may lack the MTP block the config names (then the
        model is built without it), or None when missing MTP tensors are errors."""
        return None

    # ---------------------------------------------------------------------------- reading pieces
    def piece_rank(self, file_index: int) -> int:
        """The model-parallel rank of the tensors in the file at this position of the load order."""
        return 0

    def split_dim(self, official: str) -> int | None:
        """The dim the stored pieces of this tensor are concatenated on (None: stored whole)."""
        return None

    def replicated(self, official: str) -> bool:
        """Whether every rank file holds a full copy of this tensor (only rank 0's is read)."""
        return False

    def gather(
        self, name: str, spec: Spec, pieces: list[Piece], scales: list[Piece], mp: int, probs: Problems
    ) -> tuple[list[Piece], list[Piece]]:
        """The stored pieces of one official weight and of its block scale, checked for duplicates and
        completeness, in the order they are read."""
        if len(pieces) > 1:
            probs.add(f"tensor {pieces[1].where()} is stored twice (also {pieces[0].where()})")
        if len(scales) > 1 and expert_index(name) is None:
            probs.add(f"tensor {scales[1].where()} is stored twice (also {scales[0].where()})")
        return pieces[:1], scales[:1]

    # ---------------------------------------------------------------------------- using a plan
    def prepare_load(self, p: Plan, mtp: bool = True) -> Plan:
        """The plan to build a model from (mtp=False: without the MTP block and its tensors); raises for
        a checkpoint this package validates but cannot run."""
        return p if mtp else p.without_mtp()

    def details(self, root: Path, stored_names: list[str], cfg: ModelConfig | None) -> dict[str, Any]:
        """Layout-specific facts for `dsv4 inspect`, from the tensor names and the config (None when it
        could not be read); they are reported also when validation finds problems."""
        return {}

    # ---------------------------------------------------------------------------- writing
    def check_write(self, cfg: ModelConfig, mp: int) -> None:
        """Refuse, before anything is written, what this layout cannot hold."""
        if not self.writable:
            raise CheckpointError(f"dsv4 cannot write the {self.name} layout")
        if mp != 1:
            raise CheckpointError("--mp applies to --to inference only, and must be >= 1")

    def write_tensors(self, cfg: ModelConfig) -> dict[str, Spec]:
        """The official tensors a written checkpoint of cfg holds."""
        return self.tensors(cfg)

    def skips(self, official: str) -> bool:
        """Whether a source tensor that this layout does not hold is dropped silently when writing."""
        return False

    def writer(
        self, root: Path, cfg: ModelConfig, mp: int, fmt: str, expert_dtype: str | None, shard_bytes: int
    ) -> LayoutWriter:
        raise CheckpointError(f"dsv4 cannot write the {self.name} layout")

    def output_config(self, cfg: ModelConfig, fmt: str, expert_dtype: str | None) -> dict:
        """The config.json written next to the weights."""
        from .hf_config import to_hf_json

        if fmt == "fp8":
            c = to_hf_json(cfg.replace(dtype="fp8", expert_dtype=expert_dtype, scale_fmt="ue8m0"))
            c["quantization_config"] = {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0",
            }
            if expert_dtype:
                c["expert_dtype"] = expert_dtype
            return c
        return to_hf_json(cfg.replace(dtype="bf16", expert_dtype=None, scale_fmt=None))

    def verify_config(self, cfg: ModelConfig) -> ModelConfig | None:
        """The config a written directory is re-validated against (None: its own config.json)."""
        return cfg


class LayoutWriter:
    """Official (name, Value) pairs in, a layout's files out (`from_official`); `close` returns
    {file name: {stored name: digest}} and raises if a tensor the layout needs never came."""

    def add(self, name: str, spec: Spec, v: Value) -> None:
        raise NotImplementedError

    def close(self) -> dict[str, dict[str, str]]:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ files
def find_files(path: str | Path) -> tuple[bool, list[Path], int]:
    """(whether the files are model-parallel rank files, safetensors files in load order, mp size)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    mp_files = {}
    for p in root.iterdir():
        m = _MP_RE.match(p.name)
        if m:
            mp_files[int(m[1])] = (int(m[2]), _shard(root, p.name, root))
    if mp_files:
        sizes = {n for n, _ in mp_files.values()}
        if len(sizes) != 1:
            raise CheckpointError(f"{root}: model-parallel files disagree on the rank count: {sorted(sizes)}")
        n = sizes.pop()
        missing = [r for r in range(n) if r not in mp_files]
        if missing:
            raise CheckpointError(
                f"{root}: missing shard {root / f'model{missing[0]}-mp{n}.safetensors'} "
                f"({len(missing)} of {n} ranks absent)"
            )
        return True, [mp_files[r][1] for r in range(n)], n
    index = sorted(root.glob("*.safetensors.index.json"))
    if index:
        idx = _shard(root, index[0].name, root)
        try:
            weight_map = json.loads(read_text(idx))["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError("weight_map must be a non-empty object")
            names_ = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{idx}: not a valid safetensors index ({str(e)[:200]})") from None
        for n in names_:
            if not isinstance(n, str) or not n.endswith(".safetensors"):
                raise CheckpointError(
                    f"{idx}: not a valid safetensors index (entry {str(n)[:80]!r} is not a .safetensors file name)"
                )
        files = [_shard(root, n, idx) for n in names_]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: missing shard (listed in {index[0].name})")
        return False, files, 1
    files = [_shard(root, f.name, root) for f in sorted(root.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    return False, files, 1


def _shard(root: Path, name: str, named_by: Path) -> Path:
    """root/name, contained in root and a regular file if it exists (see `paths`)."""
    path = contained(root, name, str(named_by))
    if os.path.lexists(path):
        regular_file(path)
    return path


def load_config(path: str | Path, overrides: dict | None = None) -> ModelConfig:
    """The directory's config.json, with `overrides` (ModelConfig fields) applied before validation."""
    cfg_path = Path(path) / "config.json"
    if not os.path.lexists(cfg_path):
        raise CheckpointError(
            f"{cfg_path}: missing (a checkpoint directory needs its config.json; pass "
            "--config or a ModelConfig to use another)"
        )
    contained(path, "config.json", str(path))
    from ...config import ConfigError

    try:
        return config_from_json(cfg_path, overrides)
    except ConfigError as e:
        said = str(e)  # (the reader names the file where the fault is its text)
        raise CheckpointError(said if said.startswith(f"{cfg_path}:") else f"{cfg_path}: {said}") from None


def config_from_json(cfg_path: str | Path, overrides: dict | None = None) -> ModelConfig:
    """`read_config_file` (any format's keys), without the keys a layout owns (e.g. a DSpark draft's `dspark_*`)."""
    cfg_path = Path(cfg_path)
    raw = raw_config(cfg_path)
    from .hf_config import read_config, read_config_file

    own = {k for lay in _LAYOUTS.values() for k in lay.config_keys(raw)}
    if not own:
        return read_config_file(cfg_path, overrides)
    rest = {k: v for k, v in raw.items() if k not in own}
    return read_config(rest, name=cfg_path.parent.name or "custom", overrides=overrides)


def raw_config(cfg_path: Path) -> dict[str, Any]:
    """A config.json as a dict, or {} when it is absent, unreadable or not a JSON object (the config
    reader then reports why)."""
    if not os.path.lexists(cfg_path):
        return {}
    try:
        raw = json.loads(read_text(cfg_path))
    except (ValueError, RecursionError, OSError, CheckpointError):
        return {}
    return raw if isinstance(raw, dict) else {}


# ------------------------------------------------------------------------------------------ storage
def release_storage(cfg: ModelConfig, name: str, shape: tuple[int, ...], role: str) -> dict[str, tuple]:
    """{stored name: (shape, dtype)} of one official weight as the release stores it for cfg."""
    scale_dt = "F8_E8M0" if (cfg.scale_fmt or "ue8m0") == "ue8m0" else "F32"
    if role == EXPERT and cfg.expert_dtype == "fp4":
        o, i = shape
        return {name: ((o, i // 2), "I8"), scale_name(name): ((o, i // 32), "F8_E8M0")}
    if role in (LINEAR, EXPERT) and cfg.dtype == "fp8":
        o, i = shape
        return {name: (shape, "F8_E4M3"), scale_name(name): ((-(-o // 128), -(-i // 128)), scale_dt)}
    if role == F32:
        return {name: (shape, "F32")}
    if role == INT:
        return {name: (shape, "I32")}
    return {name: (shape, "BF16")}


def logical_numel(shape: tuple[int, ...], dtype: str, name: str) -> int:
    """Parameters a stored tensor holds (packed I8 FP4 holds two per byte; scales hold none)."""
    if name.endswith((".scale", "weight_scale_inv")):
        return 0
    n = math.prod(shape)
    return 2 * n if dtype == "I8" and ".experts." in name else n


def parameter_totals(inventory: dict[str, tuple]) -> dict[str, int]:
    back = sum(logical_numel(s, d, n) for n, (s, d) in inventory.items() if not n.startswith("mtp."))
    mtp = sum(logical_numel(s, d, n) for n, (s, d) in inventory.items() if n.startswith("mtp."))
    return {"backbone": back, "mtp": mtp, "total": back + mtp}
