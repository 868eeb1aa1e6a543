"""`dsv4 check {compare, determinism, nonfinite, ranges, conformance}`: argument parsing and printing only.

`add_check_parsers(subparsers)` adds the subcommands; each sets `func(args) -> exit code`.
Exit codes: 0 = the check passed, 1 = it found a divergence / drift / non-finite value / escaped mutant;
user errors raise `dsv4.errors.UserError`.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from .. import argtypes, options
from ..errors import UserError


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    options.add(g, "preset", default="tiny", note="with random weights, the default")
    options.add(g, "model", deprecated=("--checkpoint",), note="instead of a random model")
    options.add(p, "seed", default=0, note="of the weights and tokens")
    p.add_argument("--batch", type=argtypes.positive_int, default=2, help="sequences per run (default 2)")
    options.add(p, "seq_len", default=40)
    p.add_argument(
        "--full-size",
        action="store_true",
        help="keep the preset's window and compression ratio (default: shrink them to 16 so short "
        "sequences cross every boundary)",
    )
    options.add(p, "json")
    options.add(p, "quant_mode", note="with --model")
    options.add(p, "threads")


def add_check_parsers(sub) -> None:
    """Add compare / determinism / nonfinite / ranges / conformance to the `dsv4 check` subparsers."""
    p = sub.add_parser(
        "compare",
        help="run two configurations stage by stage; name the first divergence",
        description="A is the run under test, B the reference. Give exactly one of the modes.",
    )
    _common(p)
    mode = p.add_argument_group("modes (one)")
    mode.add_argument("--backends", help="A,B ops backends, e.g. triton,reference")
    mode.add_argument("--dtypes", help="A,B dtypes, e.g. bf16,fp32")
    mode.add_argument("--compile", action="store_true", help="A = torch.compile(model), B = eager")
    p.add_argument(
        "--compiler",
        default="inductor",
        help="torch.compile backend for --compile (default inductor; aot_eager is fast)",
    )
    mode.add_argument("--checkpoints", help="A,B checkpoint directories")
    mode.add_argument(
        "--quantized",
        action="store_true",
        help="with --model: A keeps FP8/FP4 weights quantized, B dequantizes them at load (both with --quant-mode)",
    )
    mode.add_argument(
        "--quant-modes",
        metavar="A,B",
        help="with --model: A,B numerics of its FP8/FP4 weights, e.g. w8a8,w8a16 or int8,w8a8 "
        "(W8A8 = the official code's: FP8 activations; W8A16 = activations in --dtype; INT8 = "
        "per-row INT8 weights, per-token INT8 activations)",
    )
    mode.add_argument(
        "--perturb",
        metavar="PARAM[:EPS]",
        help="A = a copy with one parameter nudged by EPS (default 1e-2) times its RMS",
    )
    mode.add_argument(
        "--external",
        metavar="MODULE:CALLABLE",
        help="A = an external implementation: callable(model) -> runner(tokens) -> logits or "
        "(logits, stages); 'hf' = Hugging Face transformers' DeepseekV4ForCausalLM",
    )
    mode.add_argument("--plant", metavar="ZID", help="A = the model with bug-zoo mutant ZID planted (e.g. Z07)")
    options.add(p, "dtype", default="fp32", choices=("fp32", "bf16"), note="of both sides when not comparing dtypes")
    p.add_argument("--tolerance", help="exact | fp32 | bf16 | fp16 | a relative L2 bound (default: by dtype)")
    p.add_argument(
        "--no-force",
        action="store_true",
        help="let A take its own top-k / routing decisions (default: A takes B's and flips are counted)",
    )
    p.add_argument("--rows", type=argtypes.positive_int, default=12, help="stages shown around the first divergence")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("determinism", help="N runs of forward + backward: hashes of outputs, stages, gradients")
    _common(p)
    p.add_argument("--runs", type=argtypes.int_in(2), default=3, help="runs whose hashes must agree")
    p.add_argument("--backend", help="ops backend for every op that has it (default: per-op default)")
    p.add_argument(
        "--no-deterministic-mode", action="store_true", help="do not switch on dsv4 / torch deterministic mode"
    )
    p.add_argument("--plant", metavar="ZID", help="plant bug-zoo mutant ZID (e.g. Z18)")
    p.add_argument(
        "--locate",
        action="store_true",
        help="on drift, trace every aten op of two runs and name the first nondeterministic one",
    )
    p.set_defaults(func=cmd_determinism)

    p = sub.add_parser("nonfinite", help="stop at the first op / module producing NaN or Inf and name it")
    _common(p)
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--no-aten", action="store_true", help="skip the per-aten-op NaN hook (faster)")
    p.add_argument("--plant", metavar="ZID", help="plant bug-zoo mutant ZID")
    p.set_defaults(func=cmd_nonfinite)

    p = sub.add_parser(
        "ranges",
        help="how large the activations get, op by op, against FP16's range (an fp32 "
        "and an fp16 run of the same weights)",
    )
    _common(p)
    p.add_argument(
        "--text",
        type=argtypes.path,
        help="with a --checkpoint that has a tokenizer: this UTF-8 file's first --seq-len tokens (one "
        "sequence) instead of random tokens",
    )
    p.add_argument("--rows", type=argtypes.positive_int, default=25, help="fp16 rows shown (default 25)")
    p.set_defaults(func=cmd_ranges)

    p = sub.add_parser(
        "conformance",
        help="the bug zoo (docs/bugzoo.md): every entry planted as a mutant, and the checks that must catch it",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the bug zoo table (bug, symptom, checks, mutant per entry) and run nothing",
    )
    options.add(p, "preset", default="tiny")
    options.add(p, "seed", default=0, note="of the check model and its inputs")
    p.add_argument("--only", help="comma-separated bug-zoo ids (default: all)")
    p.add_argument("--full", action="store_true", help="also run the slow torch.compile checks")
    p.add_argument("--compiler", default="aot_eager", help="torch.compile backend under test (default aot_eager)")
    options.add(
        p,
        "device",
        note="the model, the inputs and the checks run there; each op runs its default backend there (Triton on CUDA)",
    )
    options.add(p, "threads")
    p.add_argument(
        "--backend",
        help="prefer this ops backend for every op that has it (e.g. triton); an error when it cannot run on --device",
    )
    options.add(
        p, "dtype", note="of the check model; auto here: fp32, or bf16 where the fast mHC / MoE backends need them"
    )
    p.add_argument(
        "--checks",
        help="comma-separated checks to run (default: all); mutants none of whose checks run are reported as skipped",
    )
    options.add(p, "json")
    p.set_defaults(func=cmd_conformance)


# ------------------------------------------------------------------------------ helpers
def _emit(args, report, ok: bool) -> int:
    if args.json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        print(report.render() if hasattr(report, "render") else report.summary())
    return 0 if ok else 1


def _cfg(args):
    from .inputs import check_config

    try:
        from ..config import ModelConfig

        cfg = ModelConfig.preset(args.preset)
    except (KeyError, ValueError) as e:
        raise UserError(f"unknown preset '{args.preset}': {e}") from None
    return cfg if args.full_size else check_config(cfg)


def _model(args, dtype=torch.float32, **cfg_changes):
    from .compare import build_model

    if args.model:
        return build_model(checkpoint=args.model, dtype=dtype, quant_mode=args.quant_mode)
    cfg = _cfg(args)
    if cfg_changes:
        cfg = cfg.replace(**cfg_changes)
    return build_model(cfg=cfg, dtype=dtype, seed=args.seed)


def _tokens(args, model):
    from .inputs import random_tokens

    if args.batch < 1 or args.seq_len < 2:
        raise UserError("--batch must be >= 1 and --seq-len >= 2")
    if args.seq_len > model.cfg.max_seq_len:
        raise UserError(
            f"--seq-len {args.seq_len} exceeds the model's context (max_position_embeddings) of "
            f"{model.cfg.max_seq_len} tokens"
        )
    return random_tokens(model.cfg, args.batch, args.seq_len, args.seed)


def _mutant(zid: str | None):
    if zid is None:
        return None
    from .mutants import MUTANTS

    by_id = {m.id: m for m in MUTANTS}
    m = by_id.get(zid.upper())
    if m is None:
        raise UserError(f"unknown bug-zoo id '{zid}' ({MUTANTS[0].id}..{MUTANTS[-1].id})")
    if m.pending:
        raise UserError(f"{m.id} cannot be planted yet: {m.pending}")
    return m


def _plant_ctx(m, model, tokens):
    if m is None:
        return contextlib.nullcontext()
    from .zoo import Context

    return m.plant(Context(model.cfg, model, tokens))


# ------------------------------------------------------------------------------ commands
def cmd_compare(args) -> int:
    from .compare import (
        Side,
        backend_choice,
        build_model,
        compare,
        load_external,
        parse_dtype,
        parse_tolerance,
        perturbed,
    )

    modes = [
        m
        for m in (
            "backends",
            "dtypes",
            "compile",
            "checkpoints",
            "quantized",
            "quant_modes",
            "perturb",
            "external",
            "plant",
        )
        if getattr(args, m)
    ]
    if len(modes) != 1:
        raise UserError(
            "give exactly one of --backends, --dtypes, --compile, --checkpoints, --quantized, "
            f"--quant-modes, --perturb, --external, --plant (got {len(modes) or 'none'})"
        )
    mode = modes[0]
    dtype = parse_dtype(args.dtype)
    tol = parse_tolerance(args.tolerance)
    notes: list[str] = []

    if mode == "dtypes":
        da, db = (parse_dtype(x) for x in _pair(args.dtypes, "--dtypes"))
        a_model, b_model = _model(args, da), _model(args, db)
        a, b = (
            Side(f"model[{args.dtypes.split(',')[0]}]", a_model),
            Side(f"model[{args.dtypes.split(',')[1]}]", b_model),
        )
    elif mode == "checkpoints":
        pa, pb = _pair(args.checkpoints, "--checkpoints")
        qm = args.quant_mode
        a = Side(pa, build_model(checkpoint=pa, dtype=dtype, quant_mode=qm))
        b = Side(pb, build_model(checkpoint=pb, dtype=dtype, quant_mode=qm))
    elif mode == "quantized":
        if not args.model:
            raise UserError("--quantized compares a quantized checkpoint with itself dequantized: give --model")
        qm = args.quant_mode
        a = Side("quantized", build_model(checkpoint=args.model, dtype=dtype, keep_quantized=True, quant_mode=qm))
        b = Side("dequantized", build_model(checkpoint=args.model, dtype=dtype, quant_mode=qm))
        notes.append(f"both sides {a.model.cfg.quant_mode.upper()}")
    elif mode == "quant_modes":
        if not args.model:
            raise UserError("--quant-modes compares the numerics of a checkpoint's FP8/FP4 weights: give --model")
        qa, qb = _pair(args.quant_modes, "--quant-modes")
        for q in (qa, qb):
            if q not in ("w8a8", "w8a16", "int8"):
                raise UserError(f"--quant-modes takes w8a8 / w8a16 / int8, got '{q}'")
        a = Side(qa.upper(), build_model(checkpoint=args.model, dtype=dtype, quant_mode=qa))
        b = Side(qb.upper(), build_model(checkpoint=args.model, dtype=dtype, quant_mode=qb))
        from ..model.quant import quantized_modules

        n = len(quantized_modules(a.model))
        if n == 0:
            notes.append("the checkpoint stores no FP8/FP4 weight: both sides compute the same")
        else:
            notes.append(f"{n} modules stored FP8/FP4; W8A8 quantizes their input activations, W8A16 does not")
    elif mode == "external":
        no_sim = {"fp8_kv_sim": False, "fp4_indexer_sim": False} if args.external in ("hf", "transformers") else {}
        if args.model and no_sim:
            from ..checkpoint import CheckpointError, load_pretrained
            from ..checkpoint.hub import resolve_model_path
            from ..checkpoint.layouts import load_config

            try:
                cfg = load_config(resolve_model_path(args.model, weights=False)).replace(**no_sim)
                model = load_pretrained(args.model, dtype=torch.float32, config=cfg, quant_mode=args.quant_mode)
            except (CheckpointError, FileNotFoundError) as e:
                raise UserError(f"cannot load checkpoint '{args.model}': {e}") from None
        else:
            model = _model(args, torch.float32, **({} if args.model else no_sim))
        if no_sim:
            notes.append(
                "dsv4 side built with fp8_kv_sim=False, fp4_indexer_sim=False (transformers simulates "
                "no QAT quantization)"
            )
        label = "transformers" if args.external in ("hf", "transformers") else args.external
        a, b = Side(label, external=load_external(args.external, model)), Side("dsv4", model)
    else:
        model = _model(args, dtype)
        if mode == "backends":
            na, nb = _pair(args.backends, "--backends")
            (ca, miss_a), (cb, miss_b) = backend_choice(na), backend_choice(nb)
            for name, miss in ((na, miss_a), (nb, miss_b)):
                if miss:
                    notes.append(f"ops without a '{name}' backend use their default: {', '.join(miss)}")
            a, b = Side(na, model, backend=ca), Side(nb, model, backend=cb)
        elif mode == "compile":
            a, b = Side(f"compiled[{args.compiler}]", model, compile=args.compiler), Side("eager", model)
        elif mode == "perturb":
            name, _, eps = args.perturb.partition(":")
            try:
                eps_v = float(eps) if eps else 1e-2
            except ValueError:
                raise UserError(f"--perturb wants PARAM[:EPS], got '{args.perturb}'") from None
            a, b = Side(f"perturbed {name}", perturbed(model, name, eps_v, args.seed)), Side("reference", model)
        else:  # plant
            m = _mutant(args.plant)
            a, b = Side(f"mutant {m.id} ({m.title})", model), Side("reference", model)
    tokens = _tokens(args, b.model if b.model is not None else a.model)
    if mode == "plant":
        a.context = lambda: _plant_ctx(m, model, tokens)
    report = compare(a, b, tokens, tol, force_decisions=not args.no_force)
    report.notes += notes
    if args.json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        print(report.render(args.rows))
    return 0 if report.ok else 1


def _pair(value: str, flag: str) -> tuple[str, str]:
    parts = [v.strip() for v in value.split(",")]
    if len(parts) != 2 or not all(parts):
        raise UserError(f"{flag} wants two comma-separated values A,B, got '{value}'")
    return parts[0], parts[1]


def cmd_determinism(args) -> int:
    from .compare import backend_choice
    from .determinism import determinism

    model = _model(args)
    tokens = _tokens(args, model)
    backend = backend_choice(args.backend)[0] if args.backend else None
    if args.runs < 2:
        raise UserError("--runs must be >= 2")
    with _plant_ctx(_mutant(args.plant), model, tokens):
        report = determinism(
            model, tokens, runs=args.runs, backend=backend, deterministic_mode=not args.no_deterministic_mode
        )
        if not report.ok and args.locate:
            from .determinism import locate_nondeterminism

            report.first_op = locate_nondeterminism(
                model, tokens, backend, deterministic_mode=not args.no_deterministic_mode
            )
    if args.backend:
        report.backend = args.backend
    return _emit(args, report, report.ok)


def cmd_nonfinite(args) -> int:
    from .nonfinite import find_nonfinite

    model = _model(args)
    tokens = _tokens(args, model)
    with _plant_ctx(_mutant(args.plant), model, tokens):
        report = find_nonfinite(model, tokens, backward=not args.no_backward, aten=not args.no_aten)
    return _emit(args, report, report.ok)


def cmd_ranges(args) -> int:
    from .ranges import activation_ranges

    model32, model16 = _model(args, torch.float32), _model(args, torch.float16)
    if args.text is None:
        tokens = _tokens(args, model32)
    else:
        from pathlib import Path

        from ..tokenizer import Tokenizer

        if not args.checkpoint or not (Path(args.checkpoint) / "tokenizer.json").is_file():
            raise UserError("--text needs a --checkpoint directory with a tokenizer.json")
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--text {args.text}: cannot read it as UTF-8 text: {e}") from None
        tok = Tokenizer.from_file(Path(args.checkpoint))
        tokens = torch.tensor([([tok.bos_id] + tok.encode(text))[: args.seq_len]])
    report = activation_ranges(model32, model16, tokens)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.render(args.rows))
    return 0 if report.ok else 1


def _device(name: str) -> torch.device:
    from ..defaults import resolve_device

    return resolve_device(name)


def cmd_conformance(args) -> int:
    from .. import ops
    from .conformance import run_conformance
    from .mutants import MUTANTS, catalogue
    from .zoo import CHECKS

    if args.list:
        print(catalogue())
        return 0
    ids = [x.strip().upper() for x in args.only.split(",") if x.strip()] if args.only is not None else None
    if ids is not None:
        known = [m.id for m in MUTANTS]
        if not ids:
            raise UserError(f"--only: no bug-zoo id given (known: {', '.join(known)})")
        if set(ids) - set(known):
            raise UserError(f"--only: unknown bug-zoo ids {sorted(set(ids) - set(known))} (known: {', '.join(known)})")
    checks = [x.strip() for x in args.checks.split(",") if x.strip()] if args.checks else None
    if checks is not None and set(checks) - set(CHECKS):
        raise UserError(f"unknown checks {sorted(set(checks) - set(CHECKS))} (known: {', '.join(CHECKS)})")
    try:
        from ..config import ModelConfig

        cfg = ModelConfig.preset(args.preset)
    except (KeyError, ValueError) as e:
        raise UserError(f"unknown preset '{args.preset}': {e}") from None
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    from ..progress import bar

    shown = None

    def progress(done: int, total: int, what: str) -> None:  # a bar on a terminal (not with --json)
        nonlocal shown
        if shown is None:
            shown = bar(total, "conformance", enabled=not getattr(args, "json", False), unit="step")
        shown.update(done - shown.n)
        shown.set_postfix_str(what, refresh=True)
        if done >= total:
            shown.close()

    try:
        report = run_conformance(
            cfg,
            ids=ids,
            seed=args.seed,
            compiler=args.compiler,
            full=args.full,
            device=_device(args.device),
            backend=args.backend,
            dtype=dtype,
            checks=checks,
            progress=progress,
        )
    except ops.BackendUnavailable as e:
        raise UserError(str(e)) from None
    finally:
        if shown is not None:
            shown.close()
    return _emit(args, report, report.ok)
