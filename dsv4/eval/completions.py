"""Run the code-completion evaluation (`dsv4.eval.code`) through the serving engine's batched generation.

Each held-out function is asked twice: its prompt ending at the docstring's closing quotes, and the same
prompt ending in the newline after them (where people end it). Prompts are healed (`dsv4.engine.healing`)
unless token_healing=False, so both measures can be had with and without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine.offline import complete
from ..train.data import read_text
from .code import (
    FUNCTIONAL_TASKS,
    FunctionPrompt,
    functional_summary,
    has_body,
    one_line_docstring_prompts,
    passes,
    written_function,
)


@dataclass
class CompletionReport:
    with_body: list[bool] = field(default_factory=list)
    with_body_newline: list[bool] = field(default_factory=list)  # the same prompts, ending in a newline
    functional: dict[str, list[bool]] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    samples: list[tuple[str, bool, str]] = field(default_factory=list)  # well-known: (name, right, function)

    def summary(self) -> dict:
        return {
            "prompts": len(self.with_body),
            "with_body": sum(self.with_body),
            "with_body_fraction": sum(self.with_body) / max(1, len(self.with_body)),
            "with_body_newline": sum(self.with_body_newline),
            "with_body_newline_fraction": sum(self.with_body_newline) / max(1, len(self.with_body_newline)),
            **functional_summary(self.functional),
        }


def held_out_prompts(docs: list[tuple[str, Path]], n: int) -> list[FunctionPrompt]:
    """n prompts spread evenly over every held-out function with a one-line docstring (deterministic)."""
    pool = [fp for name, p in docs for fp in one_line_docstring_prompts(name, read_text(p))]
    if len(pool) <= n:
        return pool
    return [pool[i * len(pool) // n] for i in range(n)]


# Lines at column 0 that end a function: generation stops at them (the function written is cut at the first
# non-blank line at column 0 anyway, `written_function`; these save the tokens after it). Sequences that end
# sooner change the batch's size, so in the default (not batch-invariant) numerics another sequence's later
# draws may differ from a run without stops: an equally valid sample, not the same one.
FUNCTION_END = (
    "\ndef ",
    "\nclass ",
    "\nasync ",
    "\n@",
    "\nif ",
    "\nfor ",
    "\nwhile ",
    "\nwith ",
    "\ntry:",
    "\nimport ",
    "\nfrom ",
    "\n#",
    "\nprint(",
    '\n"""',
    "\n_",
)


def _complete(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    progress: bool = False,
    desc: str = "completions",
    token_healing: bool = True,
    bos: bool = True,
    stop: tuple[str, ...] = FUNCTION_END,
    deterministic: bool = False,
) -> list[tuple[str, bool]]:
    """(completion text after the prompt, ended by EOS or a stop string) per prompt; prompt i samples with
    seed + i.
    `progress`: a bar of the prompts finished on a terminal; bos=False: the prompts carry their own (chat
    prompts); stop: no stop strings for chat answers (their code is fenced); deterministic: batch-invariant
    numerics (a sequence's draws do not change when others end earlier)."""
    from ..progress import bar

    made = [0] * len(prompts)
    ended = 0
    with bar(len(prompts), desc, progress, unit="prompt") as done:

        def on_token(i: int, tok: int) -> None:
            nonlocal ended
            made[i] += 1
            if tok == tokenizer.eos_id or made[i] == max_new_tokens:
                ended += 1
                done.update(1)

        outs = complete(
            model,
            tokenizer,
            prompts,
            token_healing=token_healing,
            bos=bos,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_token_id=tokenizer.eos_id,
            on_token=on_token,
            stop=stop,
            deterministic=deterministic,
        )
        done.update(len(prompts) - ended)  # (the ones a stop string ended)
    return [(c.text, c.eos or c.stopped) for c in outs]


def evaluate_completions(
    model,
    tokenizer,
    docs: list[tuple[str, Path]],
    n_prompts: int = 100,
    samples: int = 5,
    max_new_tokens: int = 80,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    progress: bool = False,
    token_healing: bool = True,
) -> CompletionReport:
    rep = CompletionReport()
    prompts = held_out_prompts(docs, n_prompts)
    for fp, (text, finished) in zip(
        prompts,
        _complete(
            model,
            tokenizer,
            [fp.prompt for fp in prompts],
            max_new_tokens,
            temperature,
            top_p,
            seed,
            progress,
            "completions: held-out functions",
            token_healing,
        ),
    ):
        fn = written_function(fp.prompt, text, finished)
        rep.with_body.append(has_body(fn))
        rep.written.append(fn)
    newline = [fp.prompt + "\n" for fp in prompts]
    for prompt, (text, finished) in zip(
        newline,
        _complete(
            model,
            tokenizer,
            newline,
            max_new_tokens,
            temperature,
            top_p,
            seed,
            progress,
            "completions: held-out functions + newline",
            token_healing,
        ),
    ):
        rep.with_body_newline.append(has_body(written_function(prompt, text, finished)))
    tasks = [t for t in FUNCTIONAL_TASKS for _ in range(samples)]
    done = _complete(
        model,
        tokenizer,
        [t.prompt for t in tasks],
        max_new_tokens,
        temperature,
        top_p,
        seed,
        progress,
        "completions: well-known functions",
        token_healing,
    )
    for t, (text, finished) in zip(tasks, done):
        fn = written_function(t.prompt, text, finished)
        ok = passes(t, fn)
        rep.functional.setdefault(t.name, []).append(ok)
        rep.samples.append((t.name, ok, fn))
    return rep
