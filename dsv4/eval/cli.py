"""`dsv4 eval`: how good is a trained model? Held-out loss, code completions and chat answers, one command each.

    dsv4 eval heldout      [--model DIR] [--data PATH ...] [--held-out-pct 2]
    dsv4 eval completions  [--model DIR] [--data PATH ...] [--prompts 100] [--samples 5]
    dsv4 eval chat         [--model DIR] [--data PATH ...] [--prompts 100] [--samples 5]

All default to the shipped model and its training corpus (the Python standard library, 2% held out),
so the numbers in BENCHMARKS.md for the shipped model come from these commands as written.
"""

from __future__ import annotations

import argparse
import json
import time

from .. import argtypes, options
from ..errors import UserError
from ..loading import add_device_args, add_model_args, add_quant_mode_arg, load_model


def _common(p: argparse.ArgumentParser) -> None:
    add_model_args(p, "the shipped model")
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        type=argtypes.path,
        help="the corpus the model was trained on: files or directories (default: the Python stdlib, as `dsv4 train`)",
    )
    p.add_argument(
        "--held-out-pct",
        type=argtypes.float_in(0.0, 100.0, hi_open=True),
        default=2.0,
        help="the training run's --held-out-pct (default: %(default)s, the shipped recipe's)",
    )
    add_device_args(p)
    add_quant_mode_arg(p)
    options.add(p, "json")


def add_eval_parser(sub) -> None:
    pe = sub.add_parser("eval", help="held-out loss, code-completion and chat-answer quality of a trained model")
    esub = pe.add_subparsers(dest="eval_command", metavar="EVAL")
    p = esub.add_parser("heldout", help="held-out cross-entropy: nats per token and bits per byte")
    _common(p)
    options.add(p, "seq_len", default=512, note="the scoring window")
    options.renamed(
        p,
        "--token-budget",
        "--max-tokens",
        type=argtypes.int_in(0),
        default=0,
        dest="token_budget",
        help="only the held-out documents that fit in this many tokens, in order: a quick look, "
        "biased to short files (0 = all, the default)",
    )
    p.set_defaults(func=cmd_heldout)
    p = esub.add_parser(
        "completions",
        help="does the model finish held-out functions with bodies that parse, and well-known ones correctly",
    )
    _generation_args(p, "held-out functions (signature + one-line docstring) to complete", 80, "written functions")
    options.add(p, "token_healing", note="every prompt")
    p.set_defaults(func=cmd_completions)
    p = esub.add_parser(
        "chat",
        help="asked for a function in the V4 chat format (signature + docstring line), does the model answer "
        "with code that parses, and with well-known ones that work",
    )
    _generation_args(p, "held-out functions to ask for", 160, "answers")
    p.set_defaults(func=cmd_chat)


def _generation_args(p: argparse.ArgumentParser, prompts_help: str, max_new: int, shown: str) -> None:
    _common(p)
    p.add_argument("--prompts", type=argtypes.positive_int, default=100, help=f"{prompts_help} (default %(default)s)")
    p.add_argument(
        "--samples",
        type=argtypes.positive_int,
        default=5,
        help="samples per well-known function of the functional check (default %(default)s)",
    )
    options.add(p, "max_new_tokens", default=max_new, note="per answer")
    options.add(p, "temperature", default=0.7)
    options.add(p, "top_p", default=0.9)
    options.add(p, "seed", default=0, note="prompt i samples with seed + i (fixed: the figures are reproducible)")
    p.add_argument(
        "--show",
        type=argtypes.int_in(0),
        default=0,
        help=f"print this many {shown}, then this many of the well-known functions' samples (the first of each "
        "function first), each marked right or wrong",
    )


def _documents(args: argparse.Namespace):
    from ..train.data import find_documents
    from .heldout import held_out_documents

    held = held_out_documents(find_documents(args.data), args.held_out_pct)
    if not held:
        raise UserError(f"no held-out documents at --held-out-pct {args.held_out_pct}: raise it")
    return held


def _load(args: argparse.Namespace):
    model, tokenizer, desc = load_model(args)
    if tokenizer is None:
        raise UserError("this model has no tokenizer.json: the evaluations read text (pass --model DIR with one)")
    return model, tokenizer, desc


def _sampling(args: argparse.Namespace) -> dict:
    """The generation settings `completions` and `chat` share."""
    return dict(
        n_prompts=args.prompts,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        progress=not args.json,
    )


def _print_samples(samples: list[tuple[str, bool, str]], n: int, per_task: int) -> None:
    """n of the well-known functions' samples, round-robin over the functions (each one's first sample, then
    each one's second, ...), each with its verdict."""
    order = sorted(range(len(samples)), key=lambda i: (i % per_task, i // per_task))
    for i in order[:n]:
        name, ok, text = samples[i]
        print(f"---- {name}, sample {i % per_task + 1}: {'right' if ok else 'wrong'} " + "-" * 30)
        print(text.rstrip("\n"))


def _print_functional(s: dict, samples: int) -> None:
    print(
        f"  well-known functions right: {s['functional_right']} of {s['functional_samples']} samples "
        f"({100 * s['functional_fraction']:.0f}%; {len(s['functional_by_task'])} functions x {samples})"
    )
    print("    " + ", ".join(f"{k} {v}/{samples}" for k, v in s["functional_by_task"].items()))


def cmd_heldout(args: argparse.Namespace) -> int:
    from .heldout import held_out_loss

    docs = _documents(args)
    model, tokenizer, desc = _load(args)
    t0 = time.perf_counter()
    r = held_out_loss(
        model,
        tokenizer,
        docs,
        seq_len=min(args.seq_len, model.cfg.max_seq_len),
        max_tokens=args.token_budget,
        progress=not args.json,
    )
    out = {
        "model": desc,
        "documents": r.documents,
        "tokens": r.tokens,
        "bytes": r.bytes,
        "nats_per_token": r.nats_per_token,
        "bits_per_byte": r.bits_per_byte,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"held-out loss of {desc}: {r.nats_per_token:.4f} nats/token, {r.bits_per_byte:.4f} bits/byte "
            f"({r.documents} documents, {r.tokens} tokens, {r.bytes} bytes; {out['seconds']:.0f} s)"
        )
    return 0


def cmd_completions(args: argparse.Namespace) -> int:
    from .completions import evaluate_completions

    docs = _documents(args)
    model, tokenizer, desc = _load(args)
    rep = evaluate_completions(model, tokenizer, docs, **_sampling(args), token_healing=args.token_healing)
    if args.json:
        print(json.dumps({"model": desc, "token_healing": args.token_healing, **rep.summary()}))
        return 0
    s = rep.summary()
    print(
        f"completions of {desc} (temperature {args.temperature}, top-p {args.top_p}, "
        f"{args.max_new_tokens} new tokens, seed {args.seed}, token healing "
        f"{'on' if args.token_healing else 'off'}):"
    )
    print(
        f"  held-out functions with a body that parses: {s['with_body']} of {s['prompts']} "
        f"({100 * s['with_body_fraction']:.0f}%)"
    )
    print(
        f"  the same prompts ending in a newline: {s['with_body_newline']} of {s['prompts']} "
        f"({100 * s['with_body_newline_fraction']:.0f}%)"
    )
    _print_functional(s, args.samples)
    for fn in rep.written[: args.show]:
        print("-" * 60)
        print(fn, end="")
    _print_samples(rep.samples, args.show, args.samples)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import evaluate_chat

    docs = _documents(args)
    model, tokenizer, desc = _load(args)
    rep = evaluate_chat(model, tokenizer, docs, **_sampling(args))
    s = rep.summary()
    if args.json:
        print(json.dumps({"model": desc, **s}))
        return 0
    print(
        f"chat answers of {desc} (temperature {args.temperature}, top-p {args.top_p}, "
        f"{args.max_new_tokens} new tokens, seed {args.seed}):"
    )
    print(
        f"  held-out functions answered with code defining them: {s['with_code']} of {s['requests']} "
        f"({100 * s['with_code_fraction']:.0f}%)"
    )
    _print_functional(s, args.samples)
    for answer in rep.answers[: args.show]:
        print("-" * 60)
        print(answer)
    _print_samples(rep.samples, args.show, args.samples)
    return 0
