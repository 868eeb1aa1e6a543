"""Model arguments and loading shared by the commands that run a model (`generate`, `check`, `serve`,
`chat`, `bench serve`): --preset / --model / --config, --device / --dtype, --quant-mode, and the loader
behind them. It sits below dsv4.cli and dsv4.serve so that both can use it without importing each other.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import argtypes
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", type=argtypes.preset,
                   help="a built-in architecture with random weights: tiny, small, medium, flash, pro")
    g.add_argument("--model", metavar="DIR|ID", type=argtypes.path,
                   help=f"a checkpoint directory or a Hugging Face Hub id org/name[@rev] (default: {default_hint})")
    g.add_argument("--config", metavar="FILE", type=argtypes.path,
                   help="a config.json (official or Hugging Face keys)")
    p.add_argument("--no-mtp", action="store_true",
                   help="with --model: load the main model without its draft (the MTP block, or a DSpark draft)")


def speculative_problem(cfg, k: int, threshold: float = 0.0) -> str | None:
    """Why `--speculative k` (with `--speculative-threshold`) cannot run with a model of this config (None:
    it can)."""
    if threshold and not k:
        return "--speculative-threshold: give --speculative K too (the threshold picks how many of K drafts to verify)"
    if not k:
        return None
    if cfg.dspark:
        if k > cfg.dspark_block_size:
            return (f"--speculative {k}: this model's DSpark draft proposes blocks of {cfg.dspark_block_size} "
                    f"tokens, so at most {cfg.dspark_block_size} drafts can be verified per step")
        return None
    if cfg.n_mtp_layers < 1:
        return "--speculative drafts with the model's MTP block, and this model has none"
    if threshold:
        return ("--speculative-threshold applies to a DSpark draft's confidence head; this model drafts with "
                "an MTP block, which has none")
    return None


QUANT_MODE_HELP = ("numerics of the weights a checkpoint stores as FP8 / FP4: w8a8 (default: the official "
                   "code's, activations quantized to FP8 per token in blocks of 128 before every such weight) "
                   "or w8a16 (activations kept in --dtype)")


def add_quant_mode_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant-mode", choices=("w8a8", "w8a16"), default=None, help=QUANT_MODE_HELP)


def resolve_config(args: argparse.Namespace, default_preset: str | None = None):
    from .config import ConfigError, ModelConfig

    try:
        if getattr(args, "preset", None):
            return ModelConfig.preset(args.preset)
        if getattr(args, "config", None):
            return ModelConfig.from_json(args.config)
        model_dir = getattr(args, "model", None)
        if model_dir:
            from .checkpoint.hub import resolve_model_path
            from .checkpoint.layouts import config_from_json, without_mtp

            path = resolve_model_path(model_dir, weights=False)
            cfg = config_from_json(path / "config.json")
            if getattr(args, "no_mtp", False):
                cfg = without_mtp(cfg)
            return cfg if path == Path(model_dir) else cfg.replace(name=str(model_dir))   # a Hub id, not a hash
        if default_preset:
            return ModelConfig.preset(default_preset)
        shipped = default_model_dir()
        if shipped is None:
            raise UserError("no model given and no shipped model installed: pass --preset or --model DIR")
        return ModelConfig.from_json(shipped / "config.json")
    except ConfigError as e:
        raise UserError(str(e)) from None


def load_model(args: argparse.Namespace, default_preset: str | None = None, rank: int = 0, world_size: int = 1):
    """(model, tokenizer or None, description) from --preset / --model / --config / the shipped model.

    rank, world_size: a worker of several (`dsv4.parallel`): a checkpoint is read for this rank's experts
    only; a preset is built whole (every rank draws the same weights) and cut by the serving pass."""
    from . import defaults
    from .model import DeepSeekV4

    dtype = defaults.resolve_dtype(getattr(args, "dtype", None))
    device = defaults.resolve_device(getattr(args, "device", None))
    if getattr(args, "preset", None) or getattr(args, "config", None) or (default_preset and not args.model):
        cfg = resolve_config(args, default_preset)
        model = DeepSeekV4.from_config(cfg, seed=getattr(args, "seed", 0) or 0, dtype=dtype, device=device)
        return model.eval(), None, f"{cfg.name} (random weights)"
    path = Path(args.model) if getattr(args, "model", None) else default_model_dir()
    if path is None:
        raise UserError("no model given and no shipped model installed: pass --preset or --model DIR")
    from .checkpoint import load_pretrained
    from .checkpoint.hub import resolve_model_path

    path = resolve_model_path(path)         # a Hub id becomes its snapshot in the Hugging Face cache

    model = load_pretrained(path, dtype=dtype, device=device, quant_mode=getattr(args, "quant_mode", None),
                            keep_quantized=getattr(args, "keep_quantized", False),
                            mtp=not getattr(args, "no_mtp", False), rank=rank, world_size=world_size).eval()
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from .train.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(path)
    return model, tokenizer, str(path)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device and --dtype with the defaults the Python API uses too (`dsv4.defaults`)."""
    from . import defaults

    p.add_argument("--device", default=defaults.DEVICE, type=argtypes.device,
                   help="where the model runs: cpu, cuda, cuda:1 ... (default: %(default)s, also with a GPU present)")
    p.add_argument("--dtype", choices=list(defaults.DTYPES), default=defaults.DTYPE,
                   help="parameter dtype of the weights that are not fp32 by design (default: %(default)s, as "
                        "DeepSeekV4.from_config and dsv4.checkpoint.load_pretrained)")
