"""The command line's shared options: one table, one name and one meaning each, used by every subcommand.

An option that more than one command takes (the model source, the device, the dtype, token counts, the
sequence length, the seed, threads, JSON output, sampling) is defined once here and added with `add(p,
"name", ...)`; a command may change its default (`default=`) and say what it means there (`note=`), never
its name or its type. The names are the ones users know: vLLM's and transformers' (`--model`,
`--max-new-tokens`, `--seed`, `--dtype`, `--device`, `--tensor-parallel-size`, ...).

Old spellings stay accepted for one release as `deprecated` aliases: using one prints a one-line note
(`note: --max-tokens is deprecated: use --max-new-tokens`) and works as the new name. Options that other
work adds (`--tensor-parallel-size`, `--enable-expert-parallel`, `--quant`, fp16 in `--dtype`) are one
entry here each (or one more item of `DTYPES`), added to the commands that run a model through
`model_options`, `engine_options` or `sampling_options`. Importing this module loads no torch.

Every help line shows its default (`HelpFormatter`); `tests/cli/test_cli_options.py` walks every parser and
fails on an option without help, a shared name defined outside this table, or an old spelling that is
not a declared alias.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from . import argtypes

DTYPES = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on a GPU, fp32 on a CPU; fp16 for hardware without bf16


@dataclass(frozen=True)
class Opt:
    flag: str  # the one name
    help: str  # the one meaning
    kwargs: dict[str, Any] = field(default_factory=dict)  # type, default, choices, action, metavar
    deprecated: tuple[str, ...] = ()  # old spellings, accepted for one release with a note


SHARED: dict[str, Opt] = {
    o.flag.lstrip("-").replace("-", "_"): o
    for o in [
        # the model
        Opt(
            "--preset",
            "a built-in architecture with random weights: tiny, small, medium, flash, pro",
            dict(type=argtypes.preset),
        ),
        Opt(
            "--model",
            "a checkpoint directory or a Hugging Face Hub id org/name[@rev]",
            dict(metavar="DIR|ID", type=argtypes.path),
        ),
        Opt(
            "--config", "a model config.json (official or Hugging Face keys)", dict(metavar="FILE", type=argtypes.path)
        ),
        Opt(
            "--no-mtp",
            "with --model: load the main model without its draft (the MTP block, or a DSpark draft)",
            dict(action="store_true"),
        ),
        Opt(
            "--quant-mode",
            "numerics of the weights a checkpoint stores as FP8 / FP4: w8a8 (the official code's: "
            "activations quantized to FP8 per token in blocks of 128 before every such weight), w8a16 "
            "(activations kept in --dtype), or int8 (for hardware without FP8: those weights, from any "
            "checkpoint or random weights, requantized at load to INT8 with one scale per output row, "
            "activations to INT8 per token, INT8 x INT8 GEMMs); none = w8a8",
            dict(choices=("w8a8", "w8a16", "int8")),
            deprecated=("--quant",),
        ),
        # where and how it runs
        Opt(
            "--device",
            "where the model runs: auto = the best device present (a CUDA GPU, else the CPU), or cpu, "
            "cuda, cuda:1, ...",
            dict(default="auto", type=argtypes.device_or_auto),
        ),
        Opt(
            "--dtype",
            "weights and activations: auto = bf16 on a GPU, fp32 on a CPU; fp16 for hardware without bf16 "
            "(the MoE gate/up products in fp32)",
            dict(default="auto", choices=DTYPES),
        ),
        Opt(
            "--threads",
            "CPU threads for the model's compute; 0 = the cores this process may use",
            dict(type=argtypes.thread_count, default=0, metavar="N"),
        ),
        Opt(
            "--cuda-graph",
            "replay decode steps from CUDA graphs (CUDA only; --no-cuda-graph runs them eagerly)",
            dict(action=argparse.BooleanOptionalAction, default=True),
        ),
        # what it computes
        Opt(
            "--max-new-tokens",
            "tokens to generate at most",
            dict(type=argtypes.positive_int, default=64, metavar="N"),
            deprecated=("--max-tokens",),
        ),
        Opt(
            "--seq-len",
            "tokens per sequence",
            dict(type=argtypes.int_in(2), metavar="N"),
            deprecated=("--tokens", "--seq"),
        ),
        Opt(
            "--max-model-len",
            "context limit per sequence, prompt + output; none = the model's max_position_embeddings",
            dict(type=argtypes.int_in(2), metavar="N"),
        ),
        Opt("--seed", "random seed", dict(type=argtypes.seed_int)),
        Opt("--temperature", "sampling temperature in [0, 2]; 0 = greedy", dict(type=argtypes.temperature)),
        Opt("--top-p", "nucleus sampling in (0, 1]; 1 = off", dict(type=argtypes.top_p, default=1.0)),
        Opt("--top-k", "sample from the k most likely tokens; 0 = off", dict(type=argtypes.top_k, default=0)),
        Opt(
            "--speculative",
            "speculative decoding: the model's draft (its MTP block, or a DSpark draft) proposes K "
            "tokens per step, verified in one pass (the same output: greedy tokens are those of plain "
            "decoding, sampled tokens follow the same distribution); 0 = off",
            dict(type=argtypes.int_in(0, 15), default=0, metavar="K"),
        ),
        Opt(
            "--speculative-threshold",
            "with a DSpark draft: verify only the drafts whose survival probability (its "
            "confidence head) is at least T; 0 = verify all K",
            dict(type=argtypes.float_in(0.0, 1.0), default=0.0, metavar="T"),
        ),
        Opt(
            "--token-healing",
            "token healing for text prompts: the prompt's last tokens that the tokenizer could "
            "merge with what follows (a final newline, space or half word) are backed up and the "
            "first generated tokens must spell them again, so a prompt may end at any character "
            "(--no-token-healing runs the prompt's tokens as they are)",
            dict(action=argparse.BooleanOptionalAction, default=True),
        ),
        # several devices
        Opt(
            "--tensor-parallel-size",
            "worker processes, one per device (NCCL on GPUs, gloo on CPUs): routed experts "
            "split over them, attention replicated, one scheduler",
            dict(type=argtypes.positive_int, default=1, metavar="N"),
        ),
        Opt(
            "--enable-expert-parallel",
            "split the routed experts by expert over the --tensor-parallel-size workers "
            "(the split dsv4 uses; accepted for vLLM's command lines)",
            dict(action="store_true"),
        ),
        Opt(
            "--worker-timeout",
            "with --tensor-parallel-size N > 1: seconds a worker waits for the others in a collective "
            "before it gives up (a dead or hung worker then stops the run)",
            dict(type=argtypes.positive_float, default=300.0, metavar="S"),
        ),
        # output
        Opt("--json", "print one JSON object for machines (and no progress bars)", dict(action="store_true")),
    ]
}

# old spelling -> the option it became (for the notes and the parser-walking test)
DEPRECATED: dict[str, str] = {old: o.flag for o in SHARED.values() for old in o.deprecated}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (unless the help already says it): `(default: 64)`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if action.default is None and "none = " in text:  # the help says what none means
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        default = action.default
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and default in (True, False):
            return f"{text} (default: {'on' if default else 'off'})"
        if isinstance(action, argparse.BooleanOptionalAction):
            return f"{text} (default: {'on' if default else 'off'})"
        return f"{text} (default: {'none' if default is None else '%(default)s'})"


def _deprecating(base: type[argparse.Action], old: tuple[str, ...], new: str) -> type[argparse.Action]:
    class Deprecating(base):  # type: ignore[valid-type, misc]
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string in old:
                print(
                    f"note: {option_string} is deprecated: use {new} (the old spelling goes in the next release)",
                    file=sys.stderr,
                )
            super().__call__(parser, namespace, values, option_string)

    return Deprecating


_ACTIONS = {
    None: argparse._StoreAction,
    "store": argparse._StoreAction,
    "store_true": argparse._StoreTrueAction,
    "store_false": argparse._StoreFalseAction,
}


def add(p, name: str, note: str | None = None, deprecated: tuple[str, ...] = (), **changes: Any) -> argparse.Action:
    """Add shared option `name` to parser (or group) `p`: its one flag and help (+ what it means here, `note`),
    its kwargs with `changes` (a default, narrower choices); `deprecated`: this command's own old spellings."""
    opt = SHARED[name]
    own_help = changes.pop("help", None)  # where the shared words do not hold here (narrower choices)
    kw = {**opt.kwargs, **changes}
    old = tuple(dict.fromkeys((*opt.deprecated, *deprecated)))
    old = tuple(o for o in old if o not in _existing(p))
    if old:
        action = kw.pop("action", None)
        base = action if isinstance(action, type) else _ACTIONS[action]
        kw["action"] = _deprecating(base, old, opt.flag)
    text = (own_help or opt.help) + (f"; {note}" if note else "")
    if old:
        text += f" (old spelling{'s' if len(old) > 1 else ''}, for one release: {', '.join(old)})"
    dest = kw.pop("dest", name)
    a = p.add_argument(opt.flag, *old, help=text, dest=dest, **kw)
    a.shared = name  # read by the parser-walking test
    return a


def renamed(p, flag: str, *old: str, **kwargs: Any) -> argparse.Action:
    """A command's own option (not shared) whose old spellings `old` stay accepted for one release, with
    the same note as the shared ones."""
    action = kwargs.pop("action", None)
    base = action if isinstance(action, type) else _ACTIONS[action]
    help_text = (
        kwargs.pop("help", "") + f" (old spelling{'s' if len(old) > 1 else ''}, for one release: {', '.join(old)})"
    )
    return p.add_argument(flag, *old, action=_deprecating(base, old, flag), help=help_text, **kwargs)


def _existing(p) -> set[str]:
    container = getattr(p, "_container", p)
    return set(getattr(container, "_option_string_actions", {}))


def model_options(p, default_hint: str, mtp: bool = True) -> None:
    """--preset / --model / --config (one of them; `default_hint`: what runs when none is given), --no-mtp."""
    g = p.add_mutually_exclusive_group()
    add(g, "preset")
    add(g, "model", note=f"none = {default_hint}")
    add(g, "config")
    if mtp:
        add(p, "no_mtp")


def device_options(p, threads: bool = True) -> None:
    """--device, --dtype (and --threads) with the same defaults everywhere."""
    add(p, "device")
    add(p, "dtype")
    if threads:
        add(p, "threads")


__all__ = [
    "DEPRECATED",
    "DTYPES",
    "SHARED",
    "HelpFormatter",
    "Opt",
    "add",
    "device_options",
    "model_options",
    "renamed",
]
