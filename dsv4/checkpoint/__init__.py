"""Checkpoints: the release, inference (model-parallel) and Hugging Face layouts, and Flash-0731's release
with its DSpark draft (one module each in `layouts/`); load, inspect, convert, random-weight checkpoints."""

from .layouts import LAYOUTS, expected_tensors, parameter_totals
from .layouts.hf_config import read_config, read_config_file, to_hf_json
from .load import load_into, load_pretrained
from .names import canonical, official_tensors, to_model, to_official
from .random_weights import write_random
from .reader import Plan, Value, plan, stream
from .safetensors_io import CheckpointError
from .writer import TARGETS, convert, model_values, save

__all__ = [
    "LAYOUTS",
    "TARGETS",
    "CheckpointError",
    "Plan",
    "Value",
    "canonical",
    "convert",
    "expected_tensors",
    "load_into",
    "load_pretrained",
    "model_values",
    "official_tensors",
    "parameter_totals",
    "plan",
    "read_config",
    "read_config_file",
    "save",
    "stream",
    "to_hf_json",
    "to_model",
    "to_official",
    "write_random",
]
