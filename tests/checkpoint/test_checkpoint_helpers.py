"""Shared helpers for the checkpoint tests (no tests here): a tiny source model, checkpoints from it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsv4.checkpoint import model_values, official_tensors, to_model
from dsv4.checkpoint.names import EXPERT, F32, INT, LINEAR
from dsv4.checkpoint.reader import Value
from dsv4.checkpoint.writer import encode
from dsv4.config import ModelConfig


class RoutedBy(nn.Module):
    """An experts module computing (x [T, dim], weights [T, k], indices [T, k]) -> fp32 [T, dim] with `fn`,
    an independent reference: swapped in for a layer's experts (`model.set_submodule`)."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return self.fn(x, weights, indices)


def tiny_model(seed: int = 0):
    from dsv4.model import DeepSeekV4

    return DeepSeekV4.from_config(ModelConfig.preset("tiny"), seed=seed, dtype=torch.float32).eval()


@torch.no_grad()
def make_representable(model, target: str = "bf16", expert_dtype: str | None = None):
    """Round the model's weights through the storage format in place, so that a checkpoint in that
    format holds them exactly and loading it must reproduce the model's logits bit for bit."""
    specs = official_tensors(model.cfg)
    sd = model.state_dict()
    for name, v in model_values(model):
        spec = specs[name]
        if spec.role in (F32, INT):
            continue
        stored = encode(spec, name, v, target, expert_dtype)
        w = stored[name]
        sc = stored.get(name[: -len(".weight")] + ".scale")
        fmt = "float" if sc is None else ("fp4" if w.dtype == torch.int8 else "fp8")
        val = Value(fmt, w, sc).dequantize(torch.float32)
        mname, j = to_model(name)
        (sd[mname] if j is None else sd[mname][j]).copy_(val)
    return model


def logits(model, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = model(tokens, mtp=model.cfg.n_mtp_layers > 0)
    return out.logits, out.mtp_logits


def tokens(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (2, n), generator=torch.Generator().manual_seed(seed))


__all__ = ["tiny_model", "make_representable", "logits", "tokens", "EXPERT", "LINEAR"]


def rewrite(src, dst, fn=None, extra: dict | None = None):
    """Copy a checkpoint directory file by file, passing every tensor through fn(name, tensor) ->
    {name: tensor} (empty dict drops it); `extra` tensors are added to the first file."""
    import json
    import shutil
    from pathlib import Path

    from dsv4.checkpoint.safetensors_io import iter_file, read_header, write_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    weight_map = {}
    files = sorted(src.glob("*.safetensors"))
    for k, f in enumerate(files):
        infos, _ = read_header(f)
        out = {}
        for info, t in iter_file(infos):
            out.update(fn(info.name, t) if fn else {info.name: t})
        if k == 0 and extra:
            out.update(extra)
        write_file(dst / f.name, out)
        weight_map.update({n: f.name for n in out})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copyfile(f, dst / f.name)
    if (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst
