"""`dsv4 inspect` and `dsv4 convert`: parsers the main CLI adds, handlers that raise UserError."""

from __future__ import annotations

import argparse
import json

from .. import argtypes, options
from ..config import ConfigError, ModelConfig
from ..errors import UserError
from .layouts import LAYOUTS
from .layouts.hf_config import read_config_file
from .writer import TARGETS


def _config(args: argparse.Namespace) -> ModelConfig | None:
    try:
        if getattr(args, "config", None):
            return read_config_file(args.config)
        if getattr(args, "preset", None):
            return ModelConfig.preset(args.preset)
    except ConfigError as e:
        raise UserError(str(e)) from None
    return None


def _positional_model(model: str | None, positional: str | None, old: str, new: str) -> str | None:
    """--model, or the positional of the old spelling (with a one-line note); both: an error."""
    if model and positional:
        raise UserError(f"give the checkpoint once: {new}")
    if positional:
        import sys

        print(f"note: {old} is deprecated: use {new} (the old spelling goes in the next release)", file=sys.stderr)
    return model or positional


def add_inspect_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="show a checkpoint's layout and tensors (headers only)",
        description="Read only the safetensors headers of DIR: layout, tensor inventory "
        "by dtype, bytes, and missing/unexpected/invalid tensors against the config. "
        "With --preset NAME --expected: the inventory a release checkpoint must hold.",
    )
    options.add(p, "model", note="the checkpoint to inspect")
    p.add_argument(
        "dir",
        nargs="?",
        metavar="DIR",
        help="the checkpoint as a positional argument: the old spelling of --model, for one release",
    )
    g = p.add_mutually_exclusive_group()
    options.add(g, "preset", note="its config instead of the checkpoint's config.json")
    options.add(g, "config", note="to check the checkpoint against; none = its own config.json")
    p.add_argument("--expected", action="store_true", help="print the inventory the config requires")
    p.add_argument("--layout", choices=LAYOUTS, help="override the detected layout (default: from the files)")
    options.add(p, "json")
    p.set_defaults(func=run_inspect)
    return p


def run_inspect(args: argparse.Namespace) -> int:
    from .inspect import expected_report, format_report, inspect_dir

    cfg = _config(args)
    if args.expected:
        if cfg is None:
            raise UserError("--expected needs --preset NAME or --config FILE")
        r = expected_report(cfg, args.layout or "release")
        if not args.json:
            print(format_report(r))
            return 0
        print(json.dumps(r))
        return 0
    where = _positional_model(args.model, args.dir, "inspect DIR", "inspect --model DIR")
    if not where:
        raise UserError("inspect needs a checkpoint: --model DIR (or --preset NAME --expected)")
    from .hub import resolve_model_path

    r = inspect_dir(resolve_model_path(where), cfg, args.layout)
    print(json.dumps(r) if args.json else format_report(r))
    return 0 if r["ok"] else 2


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert",
        help="convert a checkpoint between layouts and formats",
        description="Read SRC in any layout and write DST: bf16 / fp8 (release layout), "
        "hf (transformers names), inference (official model-parallel files). Written "
        "atomically (temporary directory + rename) and verified by reading it back.",
    )
    options.add(p, "model", note="the source checkpoint")
    p.add_argument(
        "paths",
        nargs="*",
        type=argtypes.path,
        metavar="DST",
        help="where to write the converted checkpoint (a new directory); the old form SRC DST is "
        "accepted for one release",
    )
    p.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="bf16 / fp8: release layout; hf: transformers names; inference: official model-parallel files",
    )
    p.add_argument("--mp", type=argtypes.positive_int, default=1, help="model-parallel ranks for --to inference")
    p.add_argument("--layout", choices=LAYOUTS, help="override the detected layout of SRC")
    p.add_argument(
        "--expert-dtype",
        choices=("fp8", "fp4"),
        help="with --to fp8: the routed experts as FP8 or MXFP4 (default: as the source/config); refused with "
        "other targets",
    )
    p.add_argument(
        "--shard-gb",
        type=argtypes.float_in(1 / 1024, 1024.0),
        default=4.0,
        help="shard size for release/hf outputs, in GiB (1 MiB to 1 TiB)",
    )
    options.add(p, "no_mtp", note="convert without the draft (the MTP block, or a DSpark draft)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal)")
    options.add(p, "threads")
    p.set_defaults(func=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    from .writer import convert

    if args.expert_dtype is not None and args.to != "fp8":
        raise UserError(
            f"--expert-dtype applies to --to fp8 (the release layout's quantized experts); --to {args.to} writes "
            "the experts as it writes every linear"
        )
    ed = None if args.expert_dtype in (None, "fp8") else "fp4"
    if args.expert_dtype == "fp8":
        ed = "fp8"
    from .hub import resolve_model_path

    if args.model and len(args.paths) == 1:
        src, dst = args.model, args.paths[0]
    elif not args.model and len(args.paths) == 2:
        src = _positional_model(None, args.paths[0], "convert SRC DST", "convert --model SRC DST")
        dst = args.paths[1]
    else:
        raise UserError("convert needs a source and a destination: dsv4 convert --model SRC DST --to ...")
    dst = convert(
        resolve_model_path(src),
        dst,
        args.to,
        mp=args.mp,
        layout=args.layout,
        expert_dtype=None if ed == "fp8" else ed,
        shard_bytes=int(args.shard_gb * (1 << 30)),
        progress=False if args.no_progress else None,
        force_expert_dtype=ed is not None,
        mtp=not args.no_mtp,
    )
    print(f"wrote {dst} ({args.to}); verified: its headers and every tensor's bytes read back as written")
    return 0


def add_init_parser(subparsers) -> argparse.ArgumentParser:
    from .initialize import draft_names

    p = subparsers.add_parser(
        "init",
        help="write a checkpoint of random weights for any preset, in the release layout",
        description="Write DIR: a randomly initialized checkpoint of --preset or --config (with --override "
        "k=v ...) in the release layout - sharded safetensors, FP8 linears with --to fp8, MXFP4 experts with "
        "--expert-dtype fp4 - streamed tensor by tensor (host memory: about the largest tensor), atomic "
        "(temporary directory + rename) and verified by reading it back.",
    )
    p.add_argument("dir", type=argtypes.path, help="the directory to create (must not exist)")
    g = p.add_mutually_exclusive_group(required=True)
    options.add(g, "preset")
    options.add(g, "config")
    p.add_argument(
        "--override",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config fields to change, values as JSON (n_layers=4 n_routed_experts=16 "
        "compress_ratios=[4,128,0]); n_layers alone keeps the first layers' ratios",
    )
    p.add_argument(
        "--draft",
        choices=draft_names(),
        help="the draft model: mtp (the MTP block), dspark (Flash-0731's DSpark draft) or none "
        "(default: as the config has it)",
    )
    p.add_argument(
        "--to",
        choices=("bf16", "fp8"),
        help="storage of the linears: bf16 or fp8 with E8M0 block scales (default: the config's dtype)",
    )
    p.add_argument("--expert-dtype", choices=("fp4",), help="MXFP4 routed experts (default: the config's)")
    options.add(p, "seed", default=0, note="of the random weights")
    p.add_argument(
        "--shard-gb", type=argtypes.float_in(1 / 1024, 1024.0), default=4.0, help="shard size in GiB (1 MiB to 1 TiB)"
    )
    options.add(p, "json")
    p.set_defaults(func=run_init)
    return p


def run_init(args: argparse.Namespace) -> int:
    from .initialize import apply_overrides, init_checkpoint, parse_overrides

    cfg = _config(args)
    cfg = apply_overrides(cfg, parse_overrides(args.override))
    dst = init_checkpoint(
        args.dir,
        cfg,
        to=args.to,
        expert_dtype=args.expert_dtype,
        seed=args.seed,
        draft=args.draft,
        shard_bytes=int(args.shard_gb * (1 << 30)),
    )
    from .reader import plan

    p = plan(dst)
    if args.json:
        print(
            json.dumps(
                {
                    "dir": str(dst),
                    "layout": p.layout,
                    "files": len(p.files),
                    "bytes": p.nbytes,
                    "tensors": len(p.entries),
                    "config": p.cfg.to_dict(),
                }
            )
        )
    else:
        print(
            f"wrote {dst}: random weights of {cfg.name} (seed {args.seed}), {len(p.entries)} tensors in "
            f"{len(p.files)} file(s), {p.nbytes / 1e9:.2f} GB, {p.layout} layout"
        )
    return 0
