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
cases of `dsv4.function_tasks`, and counts as right only when every case passes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ..function_tasks import FUNCTIONAL_TASKS as FUNCTIONAL_TASKS  # (re-exported: the checks run them)
from ..function_tasks import FunctionalTask
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
