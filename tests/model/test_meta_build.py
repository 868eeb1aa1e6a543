"""Building a model on the meta device (what the checkpoint loader does before it reads the weights) runs no
initializer and does not load torch's compiler, and gives the modules a model built for real has."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import torch
from subproc import checkout_env

from dsv4.config import ModelConfig
from dsv4.model.layers import building_on
from dsv4.model.transformer import DeepSeekV4


def _layout(model: torch.nn.Module) -> dict:
    return {n: (tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_a_meta_model_has_every_tensor_of_a_real_one():
    cfg = ModelConfig.preset("tiny")
    meta = DeepSeekV4(cfg, dtype=torch.bfloat16, device="meta")
    real = DeepSeekV4(cfg, dtype=torch.bfloat16, device="cpu")
    assert all(t.is_meta for t in meta.parameters())
    assert _layout(meta) == _layout(real)


def test_the_meta_build_mode_leaves_real_tensors_fills_alone():
    """Whether meta fills are skipped shows in the subprocess test below (no compiler import)."""
    with building_on("meta"):
        meta = torch.nn.Linear(8, 4, device="meta")
        cpu = torch.empty(1000).fill_(7.0)
        torch.nn.init.normal_(cpu, mean=0.0, std=1.0, generator=torch.Generator().manual_seed(0))
    assert meta.weight.is_meta
    assert 0.5 < float(cpu.std()) < 1.5 and not torch.equal(cpu, torch.full_like(cpu, 7.0))  # filled for real
    assert isinstance(building_on("cpu"), contextlib.nullcontext)  # off the meta device: no mode at all


def test_loading_the_shipped_model_does_not_import_the_compiler():
    """~2 s of every command line that loads a model (torch's meta fills import torch._dynamo)."""
    code = (
        "import sys\n"
        "from dsv4.checkpoint import load_pretrained\n"
        "from dsv4.loading import default_model_dir\n"
        "load_pretrained(default_model_dir())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=checkout_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False", "loading a checkpoint imported torch._dynamo"
