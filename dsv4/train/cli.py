"""`dsv4 train`: argument parsing for the trainer (the top-level CLI registers it with add_train_parser)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from .. import argtypes, options
from ..errors import UserError
from .settings import QUICK_CPU_DEFAULTS, STANDARD_DEFAULTS, TrainConfig

# flag -> TrainConfig field, for the flags whose names differ from the field
_BOOL_FLAGS = ("activation_checkpointing", "compile", "cuda_graph", "deterministic", "fp4_experts")


def _default(name: str) -> str:
    """The help text's note on a setting whose default depends on the preset and device."""
    return f"default {STANDARD_DEFAULTS[name]}; {QUICK_CPU_DEFAULTS[name]} for the tiny preset on a CPU"


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train or continue-train a V4 model (Muon + AdamW, MTP, indexer and balance losses)",
        description="Train a DeepSeek-V4 model. Default data: the Python standard library's .py files "
        "(offline). Settings come from --config (JSON or TOML) and then from flags. Settings "
        "given nowhere take defaults that depend on the run: the tiny preset on a CPU gets a "
        "quick profile (a couple of minutes on two cores, a clear held-out loss drop), every "
        "other run the standard one (each flag below lists both).",
    )
    p.add_argument(
        "--train-config",
        metavar="FILE",
        type=argtypes.path,
        help="training settings file (.json or .toml) with TrainConfig keys; a [model] table "
        "overrides ModelConfig fields (the old spelling --config, for one release, is told apart "
        "from a model config.json by its keys)",
    )
    g = p.add_mutually_exclusive_group()
    options.add(g, "preset", note="trained from scratch; none = tiny")
    options.add(g, "config", deprecated=("--model-config",), note="trained from scratch")
    options.add(g, "model", deprecated=("--init-from",), note="continue-train (fine-tune) it")
    options.add(p, "no_mtp", default=None)
    p.add_argument(
        "--draft",
        choices=("none", "mtp", "dspark"),
        help="the speculative draft to train: mtp (the first release's MTP block), dspark "
        "(Flash-0731's DSpark draft: 3 stages over the last three layers, blocks of 5) or none; "
        "default: the model's own (with --model, a draft the checkpoint lacks starts random)",
    )
    p.add_argument(
        "--freeze-main",
        dest="freeze_main",
        action="store_const",
        const=True,
        help="train the draft alone: the main model's weights stay as they are",
    )
    p.add_argument(
        "--dspark-anchors", type=argtypes.positive_int, help="DSpark blocks drawn per training sequence (default 16)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a ModelConfig field, e.g. --set n_layers=6 (repeatable; JSON values)",
    )
    p.add_argument("--data", nargs="+", help="text files or directories (default: the Python stdlib)")
    p.add_argument(
        "--max-docs",
        type=argtypes.nonneg_int,
        help=f"use at most this many documents, spread evenly (0 = all; {_default('max_docs')})",
    )
    p.add_argument(
        "--tokenizer-docs",
        type=argtypes.positive_int,
        help=f"documents sampled to train the tokenizer ({_default('tokenizer_docs')})",
    )
    p.add_argument("--tokenizer", help="tokenizer.json or its directory (default: train a byte-level BPE)")
    p.add_argument("--steps", type=argtypes.positive_int, help=_default("steps"))
    p.add_argument(
        "--batch-size", type=argtypes.positive_int, help=f"global batch size in sequences ({_default('batch_size')})"
    )
    p.add_argument(
        "--grad-accum",
        type=argtypes.positive_int,
        metavar="N",
        help="micro-batches per optimizer step: forward + backward on N batches of --batch-size sequences, "
        "their gradients summed (each loss weighted 1/N), then one update; N x --batch-size sequences a step "
        "at one batch's activation memory (default 1)",
    )
    options.add(p, "seq_len", note=_default("seq_len"))
    p.add_argument(
        "--lr", type=argtypes.positive_float, help=f"peak learning rate of Muon and AdamW ({_default('lr')})"
    )
    p.add_argument("--warmup", type=argtypes.nonneg_int, help=f"linear warmup steps ({_default('warmup')})")
    p.add_argument(
        "--schedule",
        choices=("cosine", "wsd", "constant"),
        help="learning-rate schedule after the warmup (default cosine)",
    )
    p.add_argument("--weight-decay", type=argtypes.nonneg_float, help="decoupled weight decay (default 0.1)")
    p.add_argument("--grad-clip", type=argtypes.nonneg_float, help="0 = off")
    p.add_argument(
        "--mtp-weight",
        type=argtypes.nonneg_float,
        help="weight of the draft's loss (MTP block or DSpark draft) next to the main model's (default 0.3)",
    )
    p.add_argument(
        "--indexer-weight", type=argtypes.nonneg_float, help="weight of the Lightning Indexer's KL loss (default 1.0)"
    )
    p.add_argument("--balance-alpha", type=argtypes.nonneg_float, help="sequence-wise balance loss weight (0 = off)")
    p.add_argument("--bias-gamma", type=argtypes.nonneg_float, help="aux-loss-free router bias update speed (0 = off)")
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        help="compute precision: bf16 autocast or fp32 (default auto: bf16 on a GPU, fp32 on a CPU)",
    )
    p.add_argument(
        "--no-fp8-kv-sim",
        dest="fp8_kv_sim",
        action="store_const",
        const=False,
        help="turn off the FP8 round trip of KV (QAT)",
    )
    p.add_argument(
        "--no-fp4-indexer-sim",
        dest="fp4_indexer_sim",
        action="store_const",
        const=False,
        help="turn off the FP4 round trip in the indexer (QAT)",
    )
    p.add_argument(
        "--fp4-experts",
        action="store_true",
        default=None,
        help="FP4 fake-quant of routed expert weights (straight-through gradients)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each block's activations in the backward pass (default off)",
    )
    p.add_argument(
        "--head-precision",
        choices=("fp32", "bf16"),
        default=None,
        help="the vocabulary heads' products under bf16 autocast: fp32 (default; the spec's fp32 logits, "
        "three bf16 products per term forward and nine backward) or bf16 (one product per term, summed in "
        "fp32, fp32 logits; needs --precision bf16). Inference is not affected",
    )
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile each block")
    options.add(
        p,
        "cuda_graph",
        default=None,
        note="here forward + losses + backward from one graph captured at the first step (one GPU, fixed "
        "batch shape; the optimizer step stays eager): removes the host's kernel-launch time, which "
        "dominates small models; off by default",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="bit-reproducible run (set before compilation); resume reproduces the losses",
    )
    p.add_argument("--backend", help="ops backend for every op (e.g. reference, triton)")
    options.add(p, "device", default=None, note="default: the --train-config file's, else auto")
    options.add(p, "seed", note="of the weights, the data order and the tokenizer sample; none = 0")
    p.add_argument(
        "--held-out-pct",
        type=argtypes.float_in(0.0, 100.0, hi_open=True),
        help="percent of the documents held out for evaluation, by a hash of their names (default 2)",
    )
    p.add_argument(
        "--eval-every", type=argtypes.nonneg_int, help=f"steps between held-out evaluations ({_default('eval_every')})"
    )
    p.add_argument(
        "--eval-windows",
        type=argtypes.positive_int,
        help=f"held-out windows of --seq-len tokens per evaluation ({_default('eval_windows')})",
    )
    p.add_argument(
        "--diag-every",
        type=argtypes.nonneg_int,
        help=f"steps between mHC / Muon diagnostics (0 = off; {_default('diag_every')})",
    )
    p.add_argument(
        "--save-every", type=argtypes.int_in(-1), help="checkpoint every N steps (0 = only at the end, -1 = never)"
    )
    p.add_argument(
        "--out", type=argtypes.path, help="run directory (metrics.jsonl, loss.png, checkpoints/); default runs/train"
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        help="resume from a checkpoint dir, or (no value) from the run directory's latest",
    )
    p.add_argument(
        "--export", type=argtypes.path, help="write a bf16 inference checkpoint with tokenizer here at the end"
    )
    p.add_argument("--sample-prompt", type=argtypes.text, help="text to continue greedily at the end ('' = none)")
    p.add_argument("--cache-dir", type=argtypes.path, help="where tokenized data is cached (default <out>/cache)")
    p.add_argument("--peak-tflops", type=argtypes.positive_float, help="device peak for MFU (default: known GPUs)")
    p.add_argument(
        "--time-budget-s", type=argtypes.positive_float, help="shorten --steps so training fits this many seconds"
    )
    p.add_argument(
        "--stop-after-s",
        type=argtypes.positive_float,
        help="end this invocation after this many seconds of training steps, saving a checkpoint that --resume "
        "continues from with the same schedule (a long run in stages; the run's end exports and samples)",
    )
    options.add(p, "threads", default=None)
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        default=None,
        help="skip a batch whose loss or gradients are NaN/Inf and go on (default: stop the run with "
        "exit 1 naming the step)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_const",
        const=False,
        help="no progress bar: a line every 10 steps instead (default: a bar on a terminal)",
    )
    options.add(p, "json", note="the final summary")
    p.set_defaults(func=run_train)
    return p


def _training_settings(path: str) -> bool:
    """Whether --config FILE is a training settings file (the old meaning of train's --config): TOML, or a
    JSON object whose keys are all TrainConfig fields. Otherwise it is a model config.json."""
    from ..safe_paths import MAX_TEXT_BYTES, read_bytes

    if path.endswith(".toml"):
        return True
    try:
        raw = json.loads(read_bytes(path, MAX_TEXT_BYTES, f"--config {path}"))
    except ValueError:
        return False  # the model config reader says what is wrong with it
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return isinstance(raw, dict) and bool(raw) and set(raw) <= fields


def checked_values(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A settings file's values through the checks of the `dsv4 train` flags of the same names: a number, an
    on/off setting or a choice the command line refuses (`steps: -5`, `lr: "0.1"`, `batch_size: 0`, `schedule:
    "linear"`) is refused here too, in one line naming the file and the key. Paths and devices are checked
    where the run uses them; keys with no flag of their own pass as they are."""
    flags = {a.dest: a for a in add_train_parser(argparse.ArgumentParser().add_subparsers())._actions}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    kinds = {name: str(f.type) for name, f in fields.items()}
    out = dict(raw)
    for name, value in raw.items():
        a = flags.get(name)
        if a is None or value is None or name in ("model", "init_from", "model_config"):
            continue  # (`model` is the [model] overrides here, a checkpoint on the command line)
        if name in fields and value == fields[name].default and type(value) is type(fields[name].default):
            continue  # a setting's default (0.0 = off) is always valid, as a saved run's settings write it
        if a.nargs == 0:  # an on/off flag
            if not isinstance(value, bool):
                raise UserError(f"{source}: {name}: must be true or false, got {value!r}")
            continue
        if a.nargs == "+":  # a list of paths
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UserError(f"{source}: {name}: must be a list of strings")
            continue
        if isinstance(value, (bool, list, dict)):
            raise UserError(f"{source}: {name}: must be a single value, got {value!r}")
        kind = kinds.get(name, "").split(" ")[0]
        if kind in ("int", "float"):  # (checks of paths and devices wait for the run, as the flags' values do)
            if isinstance(value, str):
                raise UserError(f"{source}: {name}: must be a number, not the string {value!r}")
            if a.type is not None:
                try:
                    value = a.type(str(value))
                except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                    raise UserError(f"{source}: {name}: {e}") from None
        elif kind == "str" and not isinstance(value, str):
            raise UserError(f"{source}: {name}: must be a string, got {value!r}")
        if a.choices is not None and value not in a.choices:
            raise UserError(f"{source}: {name}: must be one of {', '.join(map(str, a.choices))}, got {value!r}")
        out[name] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import sys

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    over: dict[str, Any] = {}
    for name in fields:
        v = getattr(args, name, None)
        if v is not None and name not in ("model", "init_from", "model_config"):
            over[name] = v
    if getattr(args, "model", None):
        over["init_from"] = args.model
    train_config = getattr(args, "train_config", None)
    if getattr(args, "config", None):
        if _training_settings(args.config) and not train_config:
            print(
                "note: --config for training settings is deprecated: use --train-config (--config is a model "
                "config.json on every command; the old meaning goes in the next release)",
                file=sys.stderr,
            )
            train_config = args.config
        else:
            over["model_config"] = args.config
    if args.set:
        model = {}
        for item in args.set:
            if "=" not in item:
                raise UserError(f"--set expects FIELD=VALUE, got '{item}'")
            k, v = item.split("=", 1)
            try:
                model[k.strip()] = json.loads(v)
            except json.JSONDecodeError:
                model[k.strip()] = v
        over["model"] = model
    if train_config:
        cfg = TrainConfig.from_file(train_config, check=checked_values)
        if "model" in over:
            over["model"] = {**cfg.model, **over["model"]}
        return dataclasses.replace(cfg, **over)
    return TrainConfig.from_dict(over)


def run_train(args: argparse.Namespace) -> int:
    from .trainer import Trainer

    trainer = Trainer(config_from_args(args))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()  # every rank leaves the process group together
    if trainer.rank != 0:  # under torchrun rank 0 alone reports
        return 0
    if getattr(args, "json", False):
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k}: {v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m dsv4.train.cli ...`) for use before the top-level CLI wires it."""
    import sys

    parser = argparse.ArgumentParser(prog="dsv4")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
