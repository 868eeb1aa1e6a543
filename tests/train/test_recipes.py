"""The training recipes in dsv4/train/recipes: each one loads, builds its model's config, and a shipped-model
recipe fits what the package may ship (files of at most 16 MiB, 64 MiB in all) with the shipped tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4 import memory
from dsv4.config import ModelConfig
from dsv4.loading import default_model_dir
from dsv4.tokenizer import Tokenizer
from dsv4.train.settings import TrainConfig

RECIPES = sorted((Path(__file__).parents[2] / "dsv4" / "train" / "recipes").glob("*.toml"))


def model_config(recipe: Path) -> ModelConfig:
    cfg = TrainConfig.from_file(recipe)
    return ModelConfig.preset(cfg.preset).replace(**cfg.model)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_and_builds_its_model_config(recipe):
    cfg = TrainConfig.from_file(recipe)
    mcfg = model_config(recipe)
    assert cfg.seq_len <= mcfg.max_seq_len and cfg.batch_size > 0 and cfg.steps > 0
    assert mcfg.n_mtp_layers == 1 and set(mcfg.compress_ratios[: mcfg.n_layers]) == {0, 4, 128}  # every feature


def test_the_larger_shipped_model_fits_the_package_in_the_release_layout():
    """pycode-base in FP8 linears + MXFP4 experts (`dsv4 convert --to fp8 --expert-dtype fp4`, what
    scripts/gpu_train_shipped.sh ships) is at most 64 MiB, and it reads the shipped tokenizer's ids."""
    mcfg = model_config(next(r for r in RECIPES if r.stem == "pycode-base"))
    released = memory.weight_bytes(mcfg.replace(dtype="fp8", expert_dtype="fp4"), torch.bfloat16)
    assert released.stored <= 64 * 2**20
    assert memory.weight_bytes(mcfg, torch.bfloat16).params > 4 * 11_790_000  # "far larger" than stdlib-v4-mini
    assert mcfg.vocab_size == Tokenizer.from_file(default_model_dir()).vocab_size
