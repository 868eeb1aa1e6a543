"""Code-completion quality: does a model finish a Python function with a body that parses, and does it work?

Prompts come from held-out source files (the documents `dsv4 train` keeps out of training, the same
hash split: `dsv4.train.data.is_held_out`): every documented top-level function or method with more than
its docstring becomes a prompt made of its `def` line(s), dedented to column 0, and the docstring's first
line as a one-line docstring. The model continues it; the function it wrote is
the prompt plus the completion up to the first non-blank line back at column 0, or the end of the
completion. When the token budget ends inside the function, its last, unfinished line is dropped (a budget
is not a syntax error). A completion *has a body* when that function parses (`ast.parse`) and holds at
least one statement beyond its docstring.

Functional checks: well-known functions (mean, gcd, clamp, flatten, ...) given as a signature and a
docstring; the function the model wrote is run in a separate Python process with a time limit against
cases written here, and counts as right only when every case passes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ..train.functions import documented_functions


@dataclass(frozen=True)
class FunctionPrompt:
    source: str  # the file the function comes from (its corpus-relative name)
    name: str
    # 'def f(...):\n    """One line."""' - no newline after the docstring: the tokenizer merges a newline
    # with the next line's indentation, so a prompt cut after the newline would tell the model the next
    # line starts at column 0 (and it ends the function there)
    prompt: str


def one_line_docstring_prompts(name: str, text: str) -> list[FunctionPrompt]:
    """A prompt per documented function of one file whose body has more than its docstring, cut by the rule
    the training examples share (`dsv4.train.functions.documented_functions`)."""
    return [FunctionPrompt(name, node.name, prompt) for node, prompt, _ in documented_functions(text)]


def written_function(prompt: str, completion: str, finished: bool) -> str:
    """The function the model wrote: prompt + completion up to the first non-blank line at column 0.

    finished: the completion ended on its own (end of sequence); otherwise the token budget ended it and,
    when no line at column 0 came, the last (unfinished) line is dropped."""
    lines = (prompt + completion).split("\n")
    n_prompt = prompt.count("\n")
    for i in range(n_prompt, len(lines)):
        line = lines[i]
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:i]).rstrip() + "\n"
    if not finished and (prompt.endswith("\n") or "\n" in completion):  # the last line is the model's
        lines = lines[:-1]
    return "\n".join(lines).rstrip() + "\n"


def has_body(function_source: str) -> bool:
    """It parses and its (first) function has at least one statement beyond the docstring."""
    try:
        tree = ast.parse(function_source)
    except (SyntaxError, ValueError):
        return False
    funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs:
        return False
    body = funcs[0].body
    has_doc = (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    return len(body) > (1 if has_doc else 0)


@dataclass(frozen=True)
class FunctionalTask:
    name: str
    prompt: str
    cases: tuple[tuple[tuple, object], ...]  # (arguments, expected result)


def _task(signature: str, doc: str, *cases: tuple[tuple, object]) -> FunctionalTask:
    return FunctionalTask(signature.split("(")[0], f'def {signature}:\n    """{doc}"""', cases)


FUNCTIONAL_TASKS: tuple[FunctionalTask, ...] = (
    _task(
        "mean(values)",
        "Return the arithmetic mean of a non-empty list of numbers.",
        (([1, 2, 3, 4],), 2.5),
        (([5],), 5),
        (([-1, 1],), 0),
    ),
    _task(
        "gcd(a, b)",
        "Return the greatest common divisor of two non-negative integers.",
        ((12, 18), 6),
        ((7, 5), 1),
        ((0, 9), 9),
        ((21, 14), 7),
    ),
    _task(
        "clamp(x, lo, hi)",
        "Return x limited to the range [lo, hi].",
        ((5, 0, 10), 5),
        ((-3, 0, 10), 0),
        ((12, 0, 10), 10),
    ),
    _task(
        "flatten(lists)",
        "Return a single list with the items of a list of lists, in order.",
        (([[1, 2], [3], []],), [1, 2, 3]),
        (([],), []),
        (([["a"], ["b", "c"]],), ["a", "b", "c"]),
    ),
    _task(
        "factorial(n)", "Return n! for a non-negative integer n.", ((0,), 1), ((1,), 1), ((5,), 120), ((10,), 3628800)
    ),
    _task(
        "is_palindrome(s)",
        "Return True if the string s reads the same forwards and backwards.",
        (("abba",), True),
        (("abc",), False),
        (("",), True),
        (("racecar",), True),
    ),
    _task(
        "is_prime(n)",
        "Return True if n is a prime number.",
        ((2,), True),
        ((1,), False),
        ((9,), False),
        ((13,), True),
        ((97,), True),
    ),
    _task(
        "fibonacci(n)",
        "Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1.",
        ((0,), 0),
        ((1,), 1),
        ((10,), 55),
    ),
    _task(
        "reverse_words(text)",
        "Return the words of text in reverse order, joined by single spaces.",
        (("a b c",), "c b a"),
        (("hello world",), "world hello"),
    ),
    _task(
        "count_vowels(text)",
        "Return the number of vowels (a, e, i, o, u) in the lowercase string text.",
        (("hello",), 2),
        (("xyz",), 0),
        (("aeiou",), 5),
    ),
    _task(
        "maximum(values)",
        "Return the largest item of a non-empty list without using max().",
        (([3, 1, 2],), 3),
        (([-5, -2],), -2),
        (([7],), 7),
    ),
    _task(
        "unique(items)",
        "Return the items of a list without duplicates, keeping the first occurrence order.",
        (([1, 2, 1, 3, 2],), [1, 2, 3]),
        (([],), []),
        ((["a", "a"],), ["a"]),
    ),
)

_RUNNER = r"""
import json, sys
src, name, cases = json.loads(sys.stdin.read())
ns = {}
try:
    exec(compile(src, "<completion>", "exec"), ns)
    fn = ns[name]
    ok = all(fn(*args) == want for args, want in cases)
except BaseException:
    ok = False
print(json.dumps(bool(ok)))
"""


def functional_summary(functional: dict[str, list[bool]]) -> dict:
    """The functional check's counts: right samples, all samples, their fraction, right samples per task."""
    right = sum(sum(v) for v in functional.values())
    samples = sum(len(v) for v in functional.values())
    return {
        "functional_right": right,
        "functional_samples": samples,
        "functional_fraction": right / max(1, samples),
        "functional_by_task": {k: sum(v) for k, v in functional.items()},
    }


def passes(task: FunctionalTask, function_source: str, timeout_s: float = 5.0) -> bool:
    """Run the written function against the task's cases in an isolated Python process (-I) with a time
    limit: True only when every case returns the expected value."""
    cases = [[list(args), want] for args, want in task.cases]
    payload = json.dumps([function_source, task.name, cases])
    with tempfile.TemporaryDirectory(prefix="dsv4-eval-") as scratch:  # whatever it writes stays there
        try:
            run = subprocess.run(
                [sys.executable, "-I", "-c", _RUNNER],
                input=payload,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=scratch,
            )
        except subprocess.TimeoutExpired:
            return False
    return run.returncode == 0 and run.stdout.strip() == "true"
