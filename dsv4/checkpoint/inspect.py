"""`dsv4 inspect`: what a checkpoint directory holds, from headers only, and what a config expects."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..config import ModelConfig
from . import layouts
from .layouts import expected_tensors, logical_numel, parameter_totals
from .reader import plan, scan
from .safetensors_io import CheckpointError


def inspect_dir(path: str | Path, config: ModelConfig | None = None, layout: str | None = None) -> dict:
    """Layout, files, tensor inventory by dtype (count, bytes), parameters, and every problem found
    against the config (missing / unexpected / wrong dtype or shape / scale rules). No payload is read."""
    root = Path(path)
    found, files, mp, headers = scan(root)
    lay = layouts.get(layout or found)
    by_dtype: Counter = Counter()
    bytes_by_dtype: Counter = Counter()
    n_params = 0
    counted: set[str] = set()
    for h in headers.values():
        for info in h.values():
            by_dtype[info.dtype] += 1
            bytes_by_dtype[info.dtype] += info.nbytes
            if info.name in counted and lay.replicated(info.name):
                continue  # a full copy in every rank file: its parameters count once
            counted.add(info.name)
            n_params += logical_numel(info.shape, info.dtype, info.name) if info.dtype != "F4" else info.numel
    report: dict = {
        "path": str(root),
        "layout": layout or found,
        "files": [f.name for f in files],
        "mp": mp,
        "tensors": sum(by_dtype.values()),
        "bytes": sum(bytes_by_dtype.values()),
        "dtypes": {k: {"tensors": by_dtype[k], "bytes": bytes_by_dtype[k]} for k in sorted(by_dtype)},
        "parameters": n_params,
        "problems": [],
        "warnings": [],
    }
    cfg = config
    try:
        p = plan(root, config, layout)
        cfg = p.cfg
        report["config"] = p.cfg.name
        report["warnings"] = p.warnings
        report["ignored"] = [t.name for t in p.ignored]
    except CheckpointError as e:
        report["problems"] = list(getattr(e, "problems", [str(e)]))
        if cfg is None:
            try:
                cfg = lay.configure(lay.load_config(root), [n for h in headers.values() for n in h], root)[0]
            except CheckpointError:
                cfg = None
    report.update(lay.details(root, [n for h in headers.values() for n in h], cfg))
    report["ok"] = not report["problems"]
    return report


def expected_report(cfg: ModelConfig, layout: str = "release") -> dict:
    """The inventory a layout must contain for cfg, with dtype counts and parameter totals."""
    inv = expected_tensors(cfg, layout)
    by_dtype: Counter = Counter(d for _, d in inv.values())
    totals = parameter_totals(inv)
    return {
        "config": cfg.name,
        "layout": layout,
        "tensors": len(inv),
        "dtypes": dict(sorted(by_dtype.items())),
        "parameters": totals,
        "parameters_billions": {k: round(v / 1e9, 2) for k, v in totals.items()},
        "inventory": {k: {"shape": list(s), "dtype": d} for k, (s, d) in inv.items()},
    }


def format_report(r: dict) -> str:
    if "inventory" in r:
        lines = [
            f"expected {r['layout']} layout for config '{r['config']}': {r['tensors']} tensors",
            "  dtypes: " + ", ".join(f"{k} x{v}" for k, v in r["dtypes"].items()),
            "  parameters: " + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in r["parameters"].items()),
        ]
        return "\n".join(lines)
    lines = [
        f"{r['path']}: {r['layout']} layout, {len(r['files'])} file(s)"
        + (f", mp={r['mp']}" if r["mp"] > 1 else "")
        + f", {r['tensors']} tensors, {r['bytes'] / 1e9:.3f} GB, {r['parameters'] / 1e9:.3f}B parameters"
    ]
    for k, v in r["dtypes"].items():
        lines.append(f"  {k:8s} {v['tensors']:7d} tensors {v['bytes'] / 1e9:10.3f} GB")
    d = r.get("draft")
    if d:
        stages = d.get("stages", len(d["stages_found"]))
        line = f"  {d['kind']} draft under mtp.*: {stages} stages"
        if "block_size" in d:
            line += (
                f", block size {d['block_size']}, noise token {d['noise_token_id']}, target layers "
                f"{d['target_layers']}, Markov rank {d['markov_rank']}; {d['tensors']} tensors, "
                f"{d['parameters'] / 1e9:.3f}B parameters"
            )
        if d["stages_found"] != list(range(stages)):
            line += f"; the files hold stages {d['stages_found']}"
        lines.append(line)
        lines.append("  note: the draft loads with the model (dsv4.model.dspark); --no-mtp leaves it out")
    for w in r.get("warnings", []):
        lines.append(f"  warning: {w}")
    if r["problems"]:
        lines.append(f"  {len(r['problems'])} problem(s):")
        lines.extend(f"    {p}" for p in r["problems"][:50])
        if len(r["problems"]) > 50:
            lines.append(f"    ... and {len(r['problems']) - 50} more")
    else:
        lines.append("  ok: every expected tensor present with valid dtype, shape and scales")
    return "\n".join(lines)


__all__ = ["inspect_dir", "expected_report", "format_report"]
