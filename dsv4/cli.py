"""The `dsv4` command line: thin - it parses, calls the library, prints.

User errors (bad flags, broken files, config mismatches) print one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import UserError

ASSETS = Path(__file__).parent / "assets"


# ------------------------------------------------------------------------------------------ models
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
    g.add_argument("--preset", help="a built-in architecture with random weights: tiny, small, flash, pro")
    g.add_argument("--model", metavar="DIR|ID", help=f"a checkpoint directory or a Hugging Face Hub id org/name[@rev] "
                   f"(default: {default_hint})")
    g.add_argument("--config", metavar="FILE", help="a config.json (official or Hugging Face keys)")


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

            path = resolve_model_path(model_dir, weights=False)
            cfg = ModelConfig.from_json(path / "config.json")
            return cfg if path == Path(model_dir) else cfg.replace(name=str(model_dir))   # a Hub id, not a hash
        if default_preset:
            return ModelConfig.preset(default_preset)
        shipped = default_model_dir()
        if shipped is None:
            raise UserError("no model given and no shipped model installed: pass --preset or --model DIR")
        return ModelConfig.from_json(shipped / "config.json")
    except ConfigError as e:
        raise UserError(str(e)) from None


def load_model(args: argparse.Namespace, default_preset: str | None = None):
    """(model, tokenizer or None, description) from --preset / --model / --config / the shipped model."""
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
                            keep_quantized=getattr(args, "keep_quantized", False)).eval()
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from .train.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(path)
    return model, tokenizer, str(path)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device and --dtype with the defaults the Python API uses too (`dsv4.defaults`)."""
    from . import defaults

    p.add_argument("--device", default=defaults.DEVICE,
                   help="where the model runs: cpu, cuda, cuda:1 ... (default: %(default)s, also with a GPU present)")
    p.add_argument("--dtype", choices=list(defaults.DTYPES), default=defaults.DTYPE,
                   help="parameter dtype of the weights that are not fp32 by design (default: %(default)s, as "
                        "DeepSeekV4.from_config and dsv4.checkpoint.load_pretrained)")


# ------------------------------------------------------------------------------------------ info
def cmd_info(args: argparse.Namespace) -> int:
    from .info import format_measured, format_memory, human, measure_memory, memory_requirements, model_info

    cfg = resolve_config(args)
    info = model_info(cfg)
    memory = memory_requirements(cfg, args)
    measured = None
    if args.measure:
        model_dir = None if args.preset or args.config else (args.model or default_model_dir())
        measured = measure_memory(cfg, args, model_dir)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), **info.to_dict(), "memory": memory.to_dict(),
                          **({"measured": measured} if measured is not None else {})}))
        return 0
    c = cfg
    print(f"{c.name}: {c.n_layers} layers (window-only {info.layer_kinds['window_only']}, CSA ratio 4 "
          f"{info.layer_kinds['csa']}, HCA ratio 128 {info.layer_kinds['hca']}) + {c.n_mtp_layers} MTP, dim {c.dim}, "
          f"vocab {c.vocab_size}")
    print(f"  attention: {c.n_heads} heads x {c.head_dim} (rope {c.rope_head_dim}), shared KV head, q_lora "
          f"{c.q_lora_rank}, O-LoRA {c.o_groups} x {c.o_lora_rank}, window {c.window_size}, indexer "
          f"{c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}")
    print(f"  MoE: {c.n_routed_experts} routed (top-{c.n_activated_experts}, {c.score_func}, route_scale "
          f"{c.route_scale}) + {c.n_shared_experts} shared, inter {c.moe_inter_dim}, {c.n_hash_layers} hash layers, "
          f"swiglu_limit {c.swiglu_limit}; mHC x{c.hc_mult}, {c.hc_sinkhorn_iters} Sinkhorn iterations")
    print(f"  parameters: {human(info.total_params)} backbone (+{human(info.mtp_params)} MTP), "
          f"{human(info.active_params)} active per token, {human(info.routed_expert_params)} in routed experts")
    print(f"  KV cache: {info.kv_bytes_per_token:.1f} B/token + {human(info.kv_fixed_bytes, 'B')} window (bf16); "
          f"at 1M tokens {info.kv_bytes_1m / 2**30:.2f} GiB bf16, {info.kv_bytes_1m_fp8 / 2**30:.2f} GiB FP8")
    print(f"  forward matmul FLOPs per token: {human(info.flops_per_token)} (attention not included)")
    for line in format_memory(memory) + (format_measured(measured) if measured is not None else []):
        print(line)
    return 0


# ------------------------------------------------------------------------------------------ generate
def _encode_prompt(args, tokenizer, cfg) -> list[int]:
    if args.prompt_ids:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UserError("--prompt-ids takes comma-separated integers, e.g. 0,15,27") from None
    elif tokenizer is not None:
        ids = [tokenizer.bos_id] + tokenizer.encode(args.prompt)
    else:
        # no tokenizer (a preset with random weights): UTF-8 bytes as ids
        ids = [cfg.bos_token_id] + [b % cfg.vocab_size for b in args.prompt.encode()]
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import generate

    torch.manual_seed(args.seed)
    model, tokenizer, desc = load_model(args)
    cfg = model.cfg
    ids = _encode_prompt(args, tokenizer, cfg)
    stream = not args.json and tokenizer is not None
    printed = [""]
    out_ids: list[int] = []

    def on_token(_row: int, tok: int) -> None:
        out_ids.append(tok)
        if stream:
            text = tokenizer.decode(out_ids)
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    if stream:
        sys.stdout.write(args.prompt)
    tokens = generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop_at_eos=not args.no_stop,
                      on_token=on_token, cuda_graph=args.cuda_graph)[0]
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"model": desc, "prompt_ids": ids, "ids": tokens, "text": text}))
    elif stream:
        print()
    else:
        print(f"[{desc}: no tokenizer, token ids]")
        print(" ".join(map(str, tokens)))
    return 0


# ------------------------------------------------------------------------------------------ check
def cmd_teacher_forcing(args: argparse.Namespace) -> int:
    import torch

    from .check.teacher_forcing import teacher_forcing

    model, _, desc = load_model(args, default_preset="tiny")
    n, k = args.tokens, args.prefill
    if not 1 <= k <= n:
        raise UserError(f"--prefill must be in [1, --tokens={n}], got {k}")
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, n), generator=gen)
    rep = teacher_forcing(model, tokens.to(model.embed.weight.device), k, tolerance=args.tolerance,
                          force_decisions=not args.no_force, exact=not args.fast_accumulation)
    if args.json:
        d = rep.to_dict()
        d.pop("per_position")
        print(json.dumps({"model": desc, **d}))
    else:
        verdict = "agree" if rep.ok else "DIVERGE"
        print(f"teacher forcing on {desc}: {n} tokens x batch {args.batch}, prefill {k} + {n - k} decode steps: "
              f"{verdict} (max relative logit error {rep.max_rel_error:.2e}, tolerance {rep.tolerance:.0e})")
        if rep.forced_flips:
            print(f"  near-tie decisions the decode path would have taken differently (forced to the prefill's): "
                  f"{rep.forced_flips}")
        if not rep.ok:
            print(f"  first divergence: row {rep.first_row}, position {rep.first_position}, "
                  f"stage {rep.first_stage or 'unknown'} (relative error {rep.stage_error or float('nan'):.2e})")
    return 0 if rep.ok else 1


# ------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4", description="Run, train, serve and verify DeepSeek-V4 models on any PyTorch device.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="config summary, parameters, memory and GPUs needed to serve and train (no weights "
                                    "allocated)")
    add_model_args(p, "the shipped model")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from .info import add_memory_args

    add_memory_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="continue a prompt (greedy or sampled)")
    add_model_args(p, "the shipped model")
    p.add_argument("prompt", nargs="?", default="", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--cuda-graph", action="store_true", help="replay decode steps from a CUDA graph (CUDA only)")
    add_device_args(p)
    add_quant_mode_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    pc = sub.add_parser("check", help="verification: teacher forcing, compare, determinism, conformance, ...")
    csub = pc.add_subparsers(dest="check_command", metavar="CHECK")
    p = csub.add_parser("teacher-forcing", help="one prefill vs prefill + single-token decode steps")
    add_model_args(p, "the tiny preset")
    p.add_argument("--tokens", type=int, default=300, help="sequence length (default 300: crosses the window, "
                   "several ratio-4 groups and two ratio-128 groups)")
    p.add_argument("--prefill", type=int, default=7, help="tokens in the prefill before decoding")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4, help="max relative logit error")
    p.add_argument("--no-force", action="store_true",
                   help="let the decode path take its own top-k / routing decisions (near-ties may then flip)")
    p.add_argument("--fast-accumulation", action="store_true",
                   help="accumulate in the working precision instead of float64 (batching then changes rounding)")
    add_device_args(p)
    add_quant_mode_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_teacher_forcing)
    _optional(lambda: __import__("dsv4.check.cli", fromlist=["x"]).add_check_parsers(csub))

    _optional(lambda: __import__("dsv4.checkpoint.cli", fromlist=["x"]).add_inspect_parser(sub))
    _optional(lambda: __import__("dsv4.checkpoint.cli", fromlist=["x"]).add_convert_parser(sub))
    _optional(lambda: __import__("dsv4.train.cli", fromlist=["x"]).add_train_parser(sub))
    from .serve.cli import add_serve_parsers

    add_serve_parsers(sub)

    pb = sub.add_parser("bench", help="benchmarks that print ratios against measured limits")
    bsub = pb.add_subparsers(dest="bench_command", metavar="BENCH")
    _optional(lambda: __import__("dsv4.bench.kernels", fromlist=["x"]).add_bench_kernels_parser(bsub))
    _optional(lambda: __import__("dsv4.bench.ops", fromlist=["x"]).add_bench_parsers(bsub))
    _optional(lambda: __import__("dsv4.bench.e2e", fromlist=["x"]).add_bench_parsers(bsub))
    _optional(lambda: __import__("dsv4.bench.w8a8", fromlist=["x"]).add_bench_parsers(bsub))
    from .bench.serve import add_bench_serve_parser

    add_bench_serve_parser(bsub)
    return parser


def _optional(add) -> None:
    """Subcommands whose module needs an optional dependency are left out when it is missing."""
    try:
        add()
    except ImportError:
        pass


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
