"""The `dsv4` command line: thin - it parses, calls the library, prints.

Every failure is one line `error: ...` on stderr and an exit code, by one mechanism: argument values are
checked while parsing by the types of `dsv4.argtypes` (exit 2, before anything is loaded), and `main`
turns whatever a command raises into a line and a code with `dsv4.errors.describe_error` (2 for what the
user can fix, 1 for I/O failures and the unexpected, 130 for Ctrl-C). `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from . import argtypes, options
from .errors import RunFailed, UserError, describe_error, exit_process, interrupted, watch_interrupts
from .loading import ModelSource, default_model_dir, load_model, resolve_config, speculative_problem


# ------------------------------------------------------------------------------------------ info
def cmd_info(args: argparse.Namespace) -> int:
    from .info import (
        format_measured,
        format_memory,
        format_parallel,
        human,
        measure_memory,
        memory_requirements,
        model_info,
        parallel_serving,
    )

    cfg = resolve_config(args)
    info = model_info(cfg)
    memory = memory_requirements(cfg, args)
    parallel = parallel_serving(cfg, memory)
    measured = None
    if args.measure:
        model_dir = None if args.preset or args.config else (args.model or default_model_dir())
        measured = measure_memory(cfg, args, model_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "config": cfg.to_dict(),
                    **info.to_dict(),
                    "memory": memory.to_dict(),
                    "serving_parallel": parallel,
                    **({"measured": measured} if measured is not None else {}),
                }
            )
        )
        return 0
    c = cfg
    print(
        f"{c.name}: {c.n_layers} layers (window-only {info.layer_kinds['window_only']}, CSA ratio 4 "
        f"{info.layer_kinds['csa']}, HCA ratio 128 {info.layer_kinds['hca']}) + {c.n_mtp_layers} MTP, dim {c.dim}, "
        f"vocab {c.vocab_size}"
    )
    print(
        f"  attention: {c.n_heads} heads x {c.head_dim} (rope {c.rope_head_dim}), shared KV head, q_lora "
        f"{c.q_lora_rank}, O-LoRA {c.o_groups} x {c.o_lora_rank}, window {c.window_size}, indexer "
        f"{c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}"
    )
    print(
        f"  MoE: {c.n_routed_experts} routed (top-{c.n_activated_experts}, {c.score_func}, route_scale "
        f"{c.route_scale}) + {c.n_shared_experts} shared, inter {c.moe_inter_dim}, {c.n_hash_layers} hash layers, "
        f"swiglu_limit {c.swiglu_limit}; mHC x{c.hc_mult}, {c.hc_sinkhorn_iters} Sinkhorn iterations"
    )
    print(
        f"  parameters: {human(info.total_params)} backbone (+{human(info.mtp_params)} MTP), "
        f"{human(info.active_params)} active per token, {human(info.routed_expert_params)} in routed experts"
    )
    print(
        f"  KV cache: {info.kv_bytes_per_token:.1f} B/token + {human(info.kv_fixed_bytes, 'B')} window (bf16); "
        f"at 1M tokens {info.kv_bytes_1m / 2**30:.2f} GiB bf16, {info.kv_bytes_1m_fp8 / 2**30:.2f} GiB FP8"
    )
    print(f"  forward matmul FLOPs per token: {human(info.flops_per_token)} (attention not included)")
    lines = format_memory(memory)
    lines[5:5] = format_parallel(parallel, memory.settings["gpu_memory"])  # after the one-device line
    for line in lines + (format_measured(measured) if measured is not None else []):
        print(line)
    return 0


# ------------------------------------------------------------------------------------------ generate
MAX_PROMPT_FILE_BYTES = 16 << 20  # far past any context; a larger file is refused, not read


def _prompt_text(args) -> str:
    """The prompt from the argument or --prompt-file (UTF-8, refused otherwise: one line, exit 2)."""
    if args.prompt_file is None:
        return args.prompt or ""
    if args.prompt:
        raise UserError("give the prompt as an argument or with --prompt-file, not both")
    from .safe_paths import read_bytes

    raw = read_bytes(args.prompt_file, MAX_PROMPT_FILE_BYTES, f"--prompt-file {args.prompt_file}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None


def _generate_tokenizer(args):
    """The tokenizer of --model / the shipped model, without loading any weights (None: byte ids)."""
    from .loading import default_model_dir

    if getattr(args, "preset", None) or getattr(args, "config", None):
        return None
    path = Path(args.model) if args.model else default_model_dir()
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    from .tokenizer import Tokenizer

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


def fit_prompt(
    ids: list[int], max_new_tokens: int, context: int, limit_name: str, truncate: bool, keep_first: int | None = None
) -> list[int]:
    """The prompt if it leaves room for max_new_tokens within `context` tokens; else its last tokens that
    do (when `truncate`; the first token, BOS, is kept), else a UserError with the numbers."""
    room = context - max_new_tokens
    if len(ids) <= room:
        return ids
    if room < 1:
        raise UserError(
            f"--max-new-tokens {max_new_tokens} does not fit {limit_name} of {context} tokens "
            f"(prompt + output): at most {context - 1} new tokens"
        )
    if not truncate:
        raise UserError(
            f"the prompt has {len(ids)} tokens and --max-new-tokens asks for {max_new_tokens} more, "
            f"but {limit_name} is {context} tokens (prompt + output): at most {room} prompt tokens "
            f"fit. Shorten the prompt, lower --max-new-tokens, or pass --truncate-prompt to keep its "
            f"last {room} tokens"
        )
    if keep_first is not None and ids[0] == keep_first and room >= 2:
        return [ids[0]] + ids[len(ids) - room + 1 :]
    return ids[len(ids) - room :]


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    # everything the prompt needs is checked before the weights are read
    if args.prompt is None and args.prompt_file is None and args.prompt_ids is None:
        raise UserError(
            "generate needs a prompt: give it as an argument, with --prompt-file FILE or with --prompt-ids IDS"
        )
    cfg = resolve_config(args)
    if args.top_k > cfg.vocab_size:
        raise UserError(f"--top-k {args.top_k} exceeds the model's vocabulary of {cfg.vocab_size} tokens (0 = off)")
    problem = speculative_problem(cfg, args.speculative, args.speculative_threshold)
    if problem:
        raise UserError(problem)
    text = _prompt_text(args)
    tokenizer = _generate_tokenizer(args)
    ids = _encode_prompt(args, text, tokenizer, cfg)
    context, limit_name = cfg.max_seq_len, "the model's context (max_position_embeddings)"
    if args.max_model_len is not None:
        if args.max_model_len > cfg.max_seq_len:
            raise UserError(
                f"--max-model-len {args.max_model_len} exceeds the model's context "
                f"(max_position_embeddings) of {cfg.max_seq_len} tokens"
            )
        context, limit_name = args.max_model_len, "--max-model-len"
    fitted = fit_prompt(ids, args.max_new_tokens, context, limit_name, args.truncate_prompt, cfg.bos_token_id)
    if len(fitted) < len(ids):
        print(
            f"note: the prompt was cut to its last {len(fitted)} of {len(ids)} tokens (--truncate-prompt)",
            file=sys.stderr,
        )
        ids = fitted
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else text

    # --seed is the sampling seed, or a fresh one (greedy decoding draws nothing); a preset's random weights
    # are those of seed 0, so that the printed seed reproduces the text
    import secrets

    seed = args.seed if args.seed is not None else secrets.randbits(63) if args.temperature > 0 else 0
    torch.manual_seed(seed)
    engine = None
    source = dataclasses.replace(ModelSource.from_args(args), seed=0)
    if args.tensor_parallel_size > 1:  # N worker processes, this one rank 0 (`dsv4.serve.workers`)
        from .serve.startup import EngineSpec
        from .serve.workers import build_workers

        spec = EngineSpec.from_args(
            args,
            source=source,
            max_num_seqs=1,
            max_model_len=min(len(ids) + args.max_new_tokens, context),
            max_batch_tokens=None,
            page_size=None,
            cache_pages=None,
            prefix_caching=False,
            detokenize=False,
        )
        engine, info = build_workers(spec, own_process=False)
        model, desc = engine.model, info["desc"]
    else:
        model, tokenizer, desc = load_model(source)
    # the loaded model's draft (a layout without one, e.g. transformers', drops it), before anything is printed
    problem = speculative_problem(model.cfg, args.speculative, args.speculative_threshold)
    if problem:
        if engine is not None:
            engine.close()
        raise UserError(problem)
    try:
        return _generate_and_print(args, model, tokenizer, desc, ids, text, seed, engine)
    finally:
        if engine is not None:
            engine.close()


def _generate_and_print(
    args, model, tokenizer, desc: str, ids: list[int], text: str | None, seed: int, engine=None
) -> int:
    from .engine import generate

    healed = _heal(args, tokenizer, ids)
    stream = not args.json and tokenizer is not None
    printed = [""]
    out_ids: list[int] = []

    def on_token(_row: int, tok: int) -> None:
        out_ids.append(tok)
        if stream:
            text = healed.completion(tokenizer.decode(out_ids))
            sys.stdout.write(text[len(printed[0]) :])
            sys.stdout.flush()
            printed[0] = text

    if stream:
        sys.stdout.write(text)
    from .check.finite_logits import NonFiniteLogits, first_nonfinite_module, watch_logits

    try:
        with watch_logits(model) as watch:
            tokens = generate(
                model,
                [healed],
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=seed,
                stop_at_eos=not args.no_stop,
                on_token=on_token,
                cuda_graph=args.cuda_graph and model.embed.weight.device.type == "cuda",
                speculative=args.speculative,
                speculative_threshold=args.speculative_threshold,
                deterministic=args.deterministic,
                tokenizer=tokenizer,
                engine=engine,
            )[0]
        bad = watch.seen()
    except NonFiniteLogits:
        bad, tokens = True, out_ids
    if bad:  # say so, instead of printing what argmax(NaN) = token 0 gave
        if stream:
            print()
        where = first_nonfinite_module(model, healed.prompt + tokens)
        raise RunFailed(
            f"the model's logits turned non-finite (NaN/Inf) after {len(tokens)} generated tokens: "
            f"{where}; check the weights with `dsv4 check nonfinite`"
        )
    text = healed.completion(tokenizer.decode(tokens)) if tokenizer is not None else None
    if args.json:
        print(
            json.dumps(
                {
                    "model": desc,
                    "prompt_ids": healed.prompt,
                    "ids": tokens,
                    "text": text,
                    "healed_text": healed.text,
                    "seed": seed,
                }
            )
        )
    elif stream:
        print()
    else:
        print(f"[{desc}: no tokenizer, token ids]")
        print(" ".join(map(str, tokens)))
    return 0


def _heal(args, tokenizer, ids: list[int]):
    """The prompt as the model reads it: a text prompt healed (`dsv4.engine.healing`) unless
    --no-token-healing; --prompt-ids as given."""
    from .engine.healing import Healed, Vocabulary, heal

    if tokenizer is None or args.prompt_ids is not None or not args.token_healing:
        return Healed(list(ids))
    return heal(Vocabulary.of(tokenizer), ids)


# ------------------------------------------------------------------------------------------ check
def cmd_teacher_forcing(args: argparse.Namespace) -> int:
    import torch

    from .check.teacher_forcing import teacher_forcing

    n, k = args.seq_len, args.prefill if args.prefill is not None else min(7, args.seq_len - 1)
    if not 1 <= k <= n:
        raise UserError(f"--prefill must be in [1, --seq-len={n}], got {k}")
    ctx = resolve_config(args, default_preset="tiny").max_seq_len
    if n > ctx:
        raise UserError(f"--seq-len {n} exceeds the model's context (max_position_embeddings) of {ctx} tokens")
    model, _, desc = load_model(args, default_preset="tiny")
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, n), generator=gen)
    rep = teacher_forcing(
        model,
        tokens.to(model.embed.weight.device),
        k,
        tolerance=args.tolerance,
        force_decisions=not args.no_force,
        exact=not args.fast_accumulation,
        progress=not args.json,
    )
    if args.json:
        d = rep.to_dict()
        d.pop("per_position")
        print(json.dumps({"model": desc, **d}))
    else:
        verdict = "agree" if rep.ok else "DIVERGE"
        print(
            f"teacher forcing on {desc}: {n} tokens x batch {args.batch}, prefill {k} + {n - k} decode steps: "
            f"{verdict} (max relative logit error {rep.max_rel_error:.2e}, tolerance {rep.tolerance:.0e})"
        )
        if rep.forced_flips:
            print(
                f"  near-tie decisions the decode path would have taken differently (forced to the prefill's): "
                f"{rep.forced_flips}"
            )
        if not rep.ok:
            print(
                f"  first divergence: row {rep.first_row}, position {rep.first_position}, "
                f"stage {rep.first_stage or 'unknown'} (relative error {rep.stage_error or float('nan'):.2e})"
            )
    return 0 if rep.ok else 1


# ------------------------------------------------------------------------------------------ parser
class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (`error: argument --top-p: ...`) and exit 2, like
    every other error of the CLI; the full usage is one `--help` away. Every option's help shows its default
    (`options.HelpFormatter`); subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", options.HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# one line per command: `dsv4 --help` lists these without importing any command's module (torch included)
COMMANDS: dict[str, str] = {
    "info": "config summary, parameters, memory and GPUs needed to serve and train (no weights allocated)",
    "generate": "continue a prompt (greedy or sampled)",
    "check": "verification: teacher forcing, compare, determinism, conformance, ...",
    "inspect": "show a checkpoint's layout and tensors (headers only)",
    "convert": "convert a checkpoint between layouts and formats",
    "init": "write a checkpoint of random weights for any preset, in the release layout",
    "train": "train or continue-train a V4 model (Muon + AdamW, MTP, indexer and balance losses)",
    "eval": "held-out loss, code-completion and chat-answer quality of a trained model",
    "serve": "an OpenAI-compatible HTTP server (continuous batching, streaming)",
    "chat": "chat in the terminal with a model (loaded here, or a running server)",
    "bench": "benchmarks that print ratios against measured limits",
}


def _add_info(sub) -> None:
    p = sub.add_parser("info", help=COMMANDS["info"], description=COMMANDS["info"] + ".")
    options.model_options(p, "the shipped model")
    options.add(p, "json")
    options.add(p, "threads", note="for --measure")
    from .info import add_memory_args

    add_memory_args(p)
    p.set_defaults(func=cmd_info)


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help=COMMANDS["generate"],
        description="Continue a prompt with a model: greedy by default, sampled with --temperature.",
    )
    options.model_options(p, "the shipped model")
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        type=argtypes.text,
        help="prompt text (or --prompt-file / --prompt-ids; one of the three is needed)",
    )
    p.add_argument("--prompt-file", type=argtypes.path, help="read the prompt from this UTF-8 file")
    p.add_argument("--prompt-ids", type=argtypes.comma_ints(0), help="comma-separated token ids instead of text")
    options.add(p, "max_new_tokens")
    options.add(p, "max_model_len")
    p.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="keep the last tokens of a prompt that does not fit the context (default: refuse it)",
    )
    options.add(p, "temperature", default=0.0)
    options.add(p, "top_p")
    options.add(p, "top_k")
    options.add(p, "seed", note="of the sampling (--temperature > 0); none = a fresh one, printed with --json")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    options.add(p, "token_healing")
    options.add(p, "cuda_graph")
    options.add(p, "speculative")
    options.add(p, "speculative_threshold")
    options.device_options(p)
    options.add(p, "quant_mode")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch- and split-invariant numbers (float64 accumulation on the reference ops; slower): "
        "the tokens do not depend on --tensor-parallel-size",
    )
    options.add(p, "tensor_parallel_size")
    options.add(p, "enable_expert_parallel")
    options.add(p, "worker_timeout")
    options.add(p, "json")
    p.set_defaults(func=cmd_generate)


def _add_check(sub) -> None:
    pc = sub.add_parser("check", help=COMMANDS["check"], description=COMMANDS["check"].capitalize() + ".")
    csub = pc.add_subparsers(dest="check_command", metavar="CHECK")
    p = csub.add_parser(
        "teacher-forcing",
        help="one prefill vs prefill + single-token decode steps",
        description="One prefill of N tokens against a prefill of k tokens followed by N-k "
        "single-token decode steps: the logits must agree at every position.",
    )
    options.model_options(p, "the tiny preset")
    options.add(
        p, "seq_len", default=300, note="300 crosses the window, several ratio-4 groups and two ratio-128 groups"
    )
    p.add_argument(
        "--prefill",
        type=argtypes.positive_int,
        default=None,
        help="tokens in the prefill before decoding (default 7, or --seq-len - 1 where that is less)",
    )
    p.add_argument("--batch", type=argtypes.positive_int, default=1, help="sequences checked at once")
    options.add(p, "seed", default=0, note="of the random tokens (and of a preset's random weights)")
    p.add_argument("--tolerance", type=argtypes.positive_float, default=1e-4, help="max relative logit error")
    p.add_argument(
        "--no-force",
        action="store_true",
        help="let the decode path take its own top-k / routing decisions (near-ties may then flip)",
    )
    p.add_argument(
        "--fast-accumulation",
        action="store_true",
        help="accumulate in the working precision instead of float64 (batching then changes rounding)",
    )
    options.device_options(p)
    options.add(p, "quant_mode")
    options.add(p, "json")
    p.set_defaults(func=cmd_teacher_forcing)
    _optional(lambda: __import__("dsv4.check.cli", fromlist=["x"]).add_check_parsers(csub))


def _add_bench(sub) -> None:
    pb = sub.add_parser("bench", help=COMMANDS["bench"], description=COMMANDS["bench"].capitalize() + ".")
    bsub = pb.add_subparsers(dest="bench_command", metavar="BENCH")
    _optional(lambda: __import__("dsv4.bench.kernels", fromlist=["x"]).add_bench_kernels_parser(bsub))
    _optional(lambda: __import__("dsv4.bench.ops", fromlist=["x"]).add_bench_parsers(bsub))
    _optional(lambda: __import__("dsv4.bench.e2e", fromlist=["x"]).add_bench_parsers(bsub))
    _optional(lambda: __import__("dsv4.bench.w8a8", fromlist=["x"]).add_bench_parsers(bsub))
    _optional(lambda: __import__("dsv4.bench.int8", fromlist=["x"]).add_bench_parsers(bsub))
    from .bench.engine import add_bench_engine_parser
    from .bench.serve import add_bench_serve_parser

    add_bench_serve_parser(bsub)
    add_bench_engine_parser(bsub)


def _from(module: str, fn: str):
    return lambda sub: _optional(lambda: getattr(__import__(module, fromlist=["x"]), fn)(sub))


BUILDERS = {
    "info": _add_info,
    "generate": _add_generate,
    "check": _add_check,
    "inspect": _from("dsv4.checkpoint.cli", "add_inspect_parser"),
    "convert": _from("dsv4.checkpoint.cli", "add_convert_parser"),
    "init": _from("dsv4.checkpoint.cli", "add_init_parser"),
    "train": _from("dsv4.train.cli", "add_train_parser"),
    "eval": _from("dsv4.eval.cli", "add_eval_parser"),
    "serve": _from("dsv4.serve.cli", "add_serve_parser"),
    "chat": _from("dsv4.serve.chat_cli", "add_chat_parser"),
    "bench": _add_bench,
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line. With `argv`, only the command it names is built in full; the others are one-line
    stubs, so that `dsv4 --help` imports none of the commands' modules (torch among them) and answers at
    once. Without, the whole tree (for tests and documentation)."""
    parser = Parser(prog="dsv4", description="Run, train, serve and verify DeepSeek-V4 models on any PyTorch device.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also accepted after the command; or DSV4_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, summary in COMMANDS.items():
        if wanted is None or wanted == name:
            BUILDERS[name](sub)
        if name not in sub.choices:
            sub.add_parser(name, help=summary, add_help=False)  # a stub: `dsv4 NAME ...` builds it in full
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
    watch_interrupts()
    try:
        parser = build_parser(argv)  # (Ctrl-C while the subcommands' modules load: 130 below)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            if e.code in (0, None):  # --help / --version: printed, and exit as argparse does
                raise
            return e.code if isinstance(e.code, int) else 2  # a usage error: its one line is printed
        if not getattr(args, "func", None):
            parser.print_help()
            return 0 if args.command is None else 2
        if getattr(args, "threads", None) is not None:  # every command that computes takes --threads
            from .defaults import set_threads

            set_threads(args.threads)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        if debug:
            raise
        if interrupted():  # a Ctrl-C that a library turned into another error on its way up
            print("interrupted", file=sys.stderr)
            return 130
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


def entry() -> None:
    """The `dsv4` console script: `main`, then the exit (130 after Ctrl-C, see `dsv4.errors.exit_process`)."""
    exit_process(main())


if __name__ == "__main__":
    entry()
