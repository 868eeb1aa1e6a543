"""Checkpoint layouts as objects: one module per layout, each a `Layout` registered by name.

- release (`release.py`): the release's Hugging Face repository (official names, FP8/MXFP4, MTP).
- inference (`inference.py`): the official converter's model-parallel rank files.
- hf (`hf.py`): a transformers `save_pretrained` directory (HF names, fused experts, no MTP).
- dspark (`dspark.py`): Flash-0731's release with its 3-stage DSpark draft under `mtp.*`.

Every module of this package is imported here, so adding a layout is adding one file that subclasses
`base.Layout` and decorates it with `@register`. The registry answers by name (`get`), lists the names
(`LAYOUTS`) and picks a directory's layout from its files (`detect`).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import (
    CONFIG_FILES,
    Layout,
    LayoutWriter,
    config_from_json,
    detect,
    find_files,
    get,
    load_config,
    logical_numel,
    names,
    parameter_totals,
    register,
    release_storage,
    without_mtp,
)

# the first three in the order the command line has always listed them, then any other module
_FIRST = ("release", "inference", "hf")
for _name in (*_FIRST, *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _FIRST)):
    if _name != "base":
        importlib.import_module(f"{__name__}.{_name}")

LAYOUTS = names()


def detect_layout(stored_names: list[str], rank_files: bool) -> str:
    """The name of the layout of files with these tensor names (see `detect`)."""
    return detect(stored_names, rank_files).name


def expected_tensors(cfg, layout: str = "release", mtp: bool = True) -> dict[str, tuple]:
    """{stored name: (shape, safetensors dtype)} a layout must contain for cfg (inference: one rank, mp=1)."""
    return get(layout).expected(cfg, mtp)


__all__ = [
    "LAYOUTS",
    "CONFIG_FILES",
    "Layout",
    "LayoutWriter",
    "config_from_json",
    "detect",
    "detect_layout",
    "expected_tensors",
    "find_files",
    "get",
    "load_config",
    "logical_numel",
    "parameter_totals",
    "register",
    "release_storage",
    "without_mtp",
]
