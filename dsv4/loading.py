"""Model arguments and loading shared by the commands that run a model (`generate`, `check`, `serve`,
`chat`, `bench serve`): --preset / --model / --config, --device / --dtype, --quant-mode, and the loader
behind them. It sits below dsv4.cli and dsv4.serve so that both can use it without importing each other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from . import options
from .errors import UserError

ASSETS = Path(__file__).parent / "assets"


def default_model_dir() -> Path | None:
    """The model shipped inside the package (the default of `generate`), if present."""
    if not ASSETS.is_dir():
        return None
    for d in sorted(ASSETS.iterdir()):
        if (d / "config.json").exists():
            return d
    return None


def add_model_args(p: argparse.ArgumentParser, default_hint: str) -> None:
    """--preset / --model / --config and --no-mtp (the shared options of dsv4.options)."""
    options.model_options(p, default_hint)


def speculative_problem(cfg, k: int, threshold: float = 0.0) -> str | None:
    """Why `--speculative k` (with `--speculative-threshold`) cannot run with a model of this config (None:
    it can)."""
    if threshold and not k:
        return "--speculative-threshold: give --speculative K too (the threshold picks how many of K drafts to verify)"
    if not k:
        return None
    if cfg.dspark:
        if k > cfg.dspark_block_size:
            return (
                f"--speculative {k}: this model's DSpark draft proposes blocks of {cfg.dspark_block_size} "
                f"tokens, so at most {cfg.dspark_block_size} drafts can be verified per step"
            )
        return None
    if cfg.n_mtp_layers < 1:
        return "--speculative drafts with the model's MTP block, and this model has none"
    if threshold:
        return (
            "--speculative-threshold applies to a DSpark draft's confidence head; this model drafts with "
            "an MTP block, which has none"
        )
    return None


def add_quant_mode_arg(p: argparse.ArgumentParser) -> None:
    options.add(p, "quant_mode")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and how to build it: what the command line's model options say, typed.

    One of `preset` (random weights of a built-in architecture, drawn with `seed`), `config` (a config.json,
    random weights), `model` (a checkpoint directory or Hub id); none of them = the shipped model (or
    `default_preset` of `resolve_config` / `load_model`). The rest applies where it can: `no_mtp` (leave
    the draft out), `quant_mode`, `keep_quantized`, `device` / `dtype` (names, "auto" or None)."""

    preset: str | None = None
    config: str | None = None
    model: str | None = None
    no_mtp: bool = False
    quant_mode: str | None = None
    keep_quantized: bool = False
    device: str | None = None
    dtype: str | None = None
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace | ModelSource) -> ModelSource:
        """The source an argparse namespace names (options a command does not have take their defaults)."""
        if isinstance(args, ModelSource):
            return args
        get = vars(args).get
        return cls(
            preset=get("preset"),
            config=None if get("config") is None else str(get("config")),
            model=None if get("model") is None else str(get("model")),
            no_mtp=bool(get("no_mtp")),
            quant_mode=get("quant_mode"),
            keep_quantized=bool(get("keep_quantized")),
            device=None if get("device") is None else str(get("device")),
            dtype=get("dtype"),
            seed=get("seed") or 0,
        )


def resolve_config(args: argparse.Namespace | ModelSource, default_preset: str | None = None):
    """The model config a source names (no weights read)."""
    from .config import ConfigError, ModelConfig

    src = ModelSource.from_args(args)
    try:
        if src.preset:
            return ModelConfig.preset(src.preset)
        if src.config:
            from .checkpoint import read_config_file

            return read_config_file(src.config)
        if src.model:
            from .checkpoint.hub import resolve_model_path
            from .checkpoint.layouts import config_from_json, without_mtp

            path = resolve_model_path(src.model, weights=False)
            cfg = config_from_json(path / "config.json")
            if src.no_mtp:
                cfg = without_mtp(cfg)
            return cfg if path == Path(src.model) else cfg.replace(name=src.model)  # a Hub id, not a hash
        if default_preset:
            return ModelConfig.preset(default_preset)
        shipped = default_model_dir()
        if shipped is None:
            raise UserError("no model given and no shipped model installed: pass --preset or --model DIR")
        from .checkpoint import read_config_file
        from .checkpoint.layouts import without_mtp

        cfg = read_config_file(shipped / "config.json")
        return without_mtp(cfg) if src.no_mtp else cfg
    except ConfigError as e:
        raise UserError(str(e)) from None


def load_model(
    args: argparse.Namespace | ModelSource, default_preset: str | None = None, rank: int = 0, world_size: int = 1
):
    """(model, tokenizer or None, description) from a `ModelSource` (or the namespace of a command's model
    options): a preset or config with random weights, a checkpoint, or the shipped model.

    rank, world_size: a worker of several (`dsv4.parallel`): a checkpoint is read for this rank's experts
    only; a preset is built whole (every rank draws the same weights) and cut by the serving pass."""
    from . import defaults
    from .model import DeepSeekV4

    src = ModelSource.from_args(args)
    device = defaults.resolve_device(src.device)
    dtype = defaults.resolve_dtype(src.dtype, device)
    if src.preset or src.config or (default_preset and not src.model):
        cfg = resolve_config(src, default_preset)
        if src.quant_mode == "int8":  # random weights requantized like a checkpoint's
            cfg = cfg.replace(quant_mode="int8")
        model = DeepSeekV4.from_config(cfg, seed=src.seed, dtype=dtype, device=device)
        return model.eval(), None, f"{cfg.name} (random weights)"
    path = Path(src.model) if src.model else default_model_dir()
    if path is None:
        raise UserError("no model given and no shipped model installed: pass --preset or --model DIR")
    from .checkpoint import load_pretrained
    from .checkpoint.hub import resolve_model_path

    path = resolve_model_path(path)  # a Hub id becomes its snapshot in the Hugging Face cache

    model = load_pretrained(
        path,
        dtype=dtype,
        device=device,
        quant_mode=src.quant_mode,
        keep_quantized=src.keep_quantized,
        mtp=not src.no_mtp,
        rank=rank,
        world_size=world_size,
    ).eval()
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(path)
    return model, tokenizer, str(path)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --threads (the shared options of dsv4.options: the same defaults everywhere)."""
    options.device_options(p)
