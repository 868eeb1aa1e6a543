"""The `dsv4` command line: thin - it parses, calls the library, prints.

Every failure is one line `error: ...` on stderr and an exit code, by one mechanism: argument values are
checked while parsing by the types of `dsv4.argtypes` (exit 2, before anything is loaded), and `main`
turns whatever a command raises into a line and a code with `dsv4.errors.describe_error` (2 for what the
user can fix, 1 for I/O failures and the unexpected, 130 for Ctrl-C). `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import argtypes
from .errors import RunFailed, UserError, describe_error
from .loading import add_device_args, add_model_args, add_quant_mode_arg, default_model_dir, load_model, resolve_config


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
MAX_PROMPT_FILE_BYTES = 16 << 20           # far past any context; a larger file is refused, not read
def _prompt_text(args) -> str:
    """The prompt from the argument or --prompt-file (UTF-8, refused otherwise: one line, exit 2)."""
    if args.prompt_file is None:
        return args.prompt
    if args.prompt:
        raise UserError("give the prompt as an argument or with --prompt-file, not both")
    from .safe_paths import read_bytes

    raw = read_bytes(args.prompt_file, MAX_PROMPT_FILE_BYTES, f"--prompt-file {args.prompt_file}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start}: "
                        f"{raw[e.start:e.start + 1]!r})") from None


def _generate_tokenizer(args):
    """The tokenizer of --model / the shipped model, without loading any weights (None: byte ids)."""
    from .loading import default_model_dir

    if getattr(args, "preset", None) or getattr(args, "config", None):
        return None
    path = Path(args.model) if args.model else default_model_dir()
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    from .train.tokenizer import Tokenizer

    return Tokenizer.from_file(path)


def _encode_prompt(args, text: str, tokenizer, cfg) -> list[int]:
    if args.prompt_ids is not None:
        ids = list(args.prompt_ids)
    elif tokenizer is not None:
        ids = [tokenizer.bos_id] + tokenizer.encode(text)
    else:
        # no tokenizer (a preset with random weights): UTF-8 bytes as ids
        ids = [cfg.bos_token_id] + [b % cfg.vocab_size for b in text.encode()]
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def fit_prompt(ids: list[int], max_new_tokens: int, context: int, limit_name: str, truncate: bool,
               keep_first: int | None = None) -> list[int]:
    """The prompt if it leaves room for max_new_tokens within `context` tokens; else its last tokens that
    do (when `truncate`; the first token, BOS, is kept), else a UserError with the numbers."""
    room = context - max_new_tokens
    if len(ids) <= room:
        return ids
    if room < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} does not fit {limit_name} of {context} tokens "
                        f"(prompt + output): at most {context - 1} new tokens")
    if not truncate:
        raise UserError(f"the prompt has {len(ids)} tokens and --max-new-tokens asks for {max_new_tokens} more, "
                        f"but {limit_name} is {context} tokens (prompt + output): at most {room} prompt tokens "
                        f"fit. Shorten the prompt, lower --max-new-tokens, or pass --truncate-prompt to keep its "
                        f"last {room} tokens")
    if keep_first is not None and ids[0] == keep_first and room >= 2:
        return [ids[0]] + ids[len(ids) - room + 1:]
    return ids[len(ids) - room:]


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from .engine import generate

    # everything the prompt needs is checked before the weights are read
    cfg = resolve_config(args)
    if args.top_k > cfg.vocab_size:
        raise UserError(f"--top-k {args.top_k} exceeds the model's vocabulary of {cfg.vocab_size} tokens "
                        f"(0 = off)")
    if args.speculative and cfg.n_mtp_layers < 1:
        raise UserError("--speculative drafts with the model's MTP block, and this model has none")
    text = _prompt_text(args)
    tokenizer = _generate_tokenizer(args)
    ids = _encode_prompt(args, text, tokenizer, cfg)
    context, limit_name = cfg.max_seq_len, "the model's context (max_position_embeddings)"
    if args.max_model_len is not None:
        if args.max_model_len > cfg.max_seq_len:
            raise UserError(f"--max-model-len {args.max_model_len} exceeds the model's context "
                            f"(max_position_embeddings) of {cfg.max_seq_len} tokens")
        context, limit_name = args.max_model_len, "--max-model-len"
    fitted = fit_prompt(ids, args.max_new_tokens, context, limit_name, args.truncate_prompt, cfg.bos_token_id)
    if len(fitted) < len(ids):
        print(f"note: the prompt was cut to its last {len(fitted)} of {len(ids)} tokens (--truncate-prompt)",
              file=sys.stderr)
        ids = fitted
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else text

    torch.manual_seed(args.seed)
    model, tokenizer, desc = load_model(args)
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
        sys.stdout.write(text)
    from .check.finite_logits import NonFiniteLogits, first_nonfinite_module, watch_logits

    try:
        with watch_logits(model) as watch:
            tokens = generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop_at_eos=not args.no_stop,
                              on_token=on_token, cuda_graph=args.cuda_graph, speculative=args.speculative)[0]
        bad = watch.seen()
    except NonFiniteLogits:
        bad, tokens = True, out_ids
    if bad:                                  # say so, instead of printing what argmax(NaN) = token 0 gave
        if stream:
            print()
        where = first_nonfinite_module(model, ids + tokens)
        raise RunFailed(f"the model's logits turned non-finite (NaN/Inf) after {len(tokens)} generated tokens: "
                        f"{where}; check the weights with `dsv4 check nonfinite`")
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

    n, k = args.tokens, args.prefill
    if not 1 <= k <= n:
        raise UserError(f"--prefill must be in [1, --tokens={n}], got {k}")
    ctx = resolve_config(args, default_preset="tiny").max_seq_len
    if n > ctx:
        raise UserError(f"--tokens {n} exceeds the model's context (max_position_embeddings) of {ctx} tokens")
    model, _, desc = load_model(args, default_preset="tiny")
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
class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (`error: argument --top-p: ...`) and exit 2, like
    every other error of the CLI; the full usage is one `--help` away."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dsv4", description="Run, train, serve and verify DeepSeek-V4 models on any PyTorch device.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also accepted after the command; or DSV4_DEBUG=1)")
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
    p.add_argument("prompt", nargs="?", default="", type=argtypes.text, help="prompt text")
    p.add_argument("--prompt-file", type=argtypes.path, help="read the prompt from this UTF-8 file")
    p.add_argument("--prompt-ids", type=argtypes.comma_ints(0), help="comma-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=64)
    p.add_argument("--max-model-len", type=argtypes.int_in(2), default=None,
                   help="context limit, prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="keep the last tokens of a prompt that does not fit the context (default: refuse it)")
    p.add_argument("--temperature", type=argtypes.temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=argtypes.top_p, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=argtypes.top_k, default=0, help="0 = off")
    p.add_argument("--seed", type=argtypes.seed_int, default=0)
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--cuda-graph", action="store_true", help="replay decode steps from a CUDA graph (CUDA only)")
    p.add_argument("--speculative", type=argtypes.int_in(0, 15), default=0, metavar="K",
                   help="speculative decoding: the MTP block drafts K tokens per step, verified in one pass "
                        "(same output; 0 = off, the default)")
    add_device_args(p)
    add_quant_mode_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    pc = sub.add_parser("check", help="verification: teacher forcing, compare, determinism, conformance, ...")
    csub = pc.add_subparsers(dest="check_command", metavar="CHECK")
    p = csub.add_parser("teacher-forcing", help="one prefill vs prefill + single-token decode steps")
    add_model_args(p, "the tiny preset")
    p.add_argument("--tokens", type=argtypes.int_in(2), default=300,
                   help="sequence length (default 300: crosses the window, several ratio-4 groups and two ratio-128 "
                        "groups)")
    p.add_argument("--prefill", type=argtypes.positive_int, default=7, help="tokens in the prefill before decoding")
    p.add_argument("--batch", type=argtypes.positive_int, default=1)
    p.add_argument("--seed", type=argtypes.seed_int, default=0)
    p.add_argument("--tolerance", type=argtypes.positive_float, default=1e-4, help="max relative logit error")
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
    from .eval.cli import add_eval_parser

    add_eval_parser(sub)
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
    """Parse, run, and turn every failure into one line on stderr and an exit code (see `dsv4.errors`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _take_debug(argv)
    try:
        parser = build_parser()                 # (Ctrl-C while the subcommands' modules load: 130 below)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            if e.code in (0, None):             # --help / --version: printed, and exit as argparse does
                raise
            return e.code if isinstance(e.code, int) else 2   # a usage error: its one line is printed
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if args.command is None else 2
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:                                              # noqa: BLE001 - one line, not a traceback
        if debug:
            raise
        code, line = describe_error(e)
        print(f"error: {line}", file=sys.stderr)
        return code


def _take_debug(argv: list[str]) -> bool:
    """--debug anywhere before a `--` (removed from argv: every command accepts it), or DSV4_DEBUG=1."""
    import os

    end = argv.index("--") if "--" in argv else len(argv)
    found = "--debug" in argv[:end]
    while "--debug" in argv[:end]:
        argv.remove("--debug")
        end -= 1
    return found or os.environ.get("DSV4_DEBUG", "") not in ("", "0")


if __name__ == "__main__":
    sys.exit(main())
