"""`dsv4 eval chat`: asked for a function in the V4 chat format, does the model answer with code that works?

The requests are phrased as the chat training examples phrase them (`dsv4.train.functions.chat_request`:
the function's signature and its docstring's first line). Two measures:
- held-out functions (the public top-level documented functions of the held-out documents): the answer's
  code (`answer_code`: its first fenced block, else the whole answer) parses and defines the function
  asked for with a body (`dsv4.eval.code.has_body`);
- the well-known functions of `dsv4.eval.code.FUNCTIONAL_TASKS`, asked by the signature and docstring of
  their completion prompt: the answer's code is run against the task's cases (`passes`).
Chat prompts end at a turn boundary, so they are not healed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..serve.chat.encode import encode_chat
from ..train.data import read_text
from ..train.functions import chat_functions, chat_request
from .code import FUNCTIONAL_TASKS, FunctionalTask, functional_summary, has_body, passes
from .completions import _complete

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def answer_code(answer: str) -> str:
    """The code of an answer: its first fenced block (to the closing fence, or the end of an answer cut
    by the token budget), else the whole answer."""
    m = _FENCE.search(answer)
    return m.group(1) if m else answer


def defines_with_body(code: str, name: str) -> bool:
    """The code parses and its top level defines `name` with at least one statement beyond a docstring."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return has_body(ast.unparse(node))
    return False


@dataclass(frozen=True)
class ChatAsk:
    name: str
    request: str  # the user's message

    @property
    def prompt(self) -> str:
        return encode_chat([{"role": "user", "content": self.request}])


def held_out_asks(docs: list[tuple[str, Path]], n: int) -> list[ChatAsk]:
    """n requests spread evenly over the held-out documents' functions that chat examples are made of
    (`dsv4.train.functions.chat_functions`)."""
    pool = [ChatAsk(name, request) for _, path in docs for name, request, _ in chat_functions(read_text(path))]
    if len(pool) <= n:
        return pool
    return [pool[i * len(pool) // n] for i in range(n)]


def task_ask(task: FunctionalTask) -> ChatAsk:
    """A well-known function's request: its completion prompt's signature and docstring."""
    fn = ast.parse(task.prompt + "\n    ...").body[0]
    doc = (ast.get_docstring(fn) or "").strip()
    return ChatAsk(task.name, chat_request(f"{fn.name}({ast.unparse(fn.args)})", doc))


@dataclass
class ChatReport:
    with_code: list[bool] = field(default_factory=list)
    functional: dict[str, list[bool]] = field(default_factory=dict)
    answers: list[str] = field(default_factory=list)
    samples: list[tuple[str, bool, str]] = field(default_factory=list)  # well-known: (name, right, answer)

    def summary(self) -> dict:
        return {
            "requests": len(self.with_code),
            "with_code": sum(self.with_code),
            "with_code_fraction": sum(self.with_code) / max(1, len(self.with_code)),
            **functional_summary(self.functional),
        }


def evaluate_chat(
    model,
    tokenizer,
    docs: list[tuple[str, Path]],
    n_prompts: int = 100,
    samples: int = 5,
    max_new_tokens: int = 160,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    progress: bool = False,
) -> ChatReport:
    rep = ChatReport()
    sampling = (max_new_tokens, temperature, top_p, seed, progress)
    asks = held_out_asks(docs, n_prompts)
    answers = _complete(
        model, tokenizer, [a.prompt for a in asks], *sampling, "chat: held-out functions", False, bos=False, stop=()
    )
    for ask, (text, _) in zip(asks, answers):
        rep.with_code.append(defines_with_body(answer_code(text), ask.name))
        rep.answers.append(f"{ask.request}\n{text}")
    tasks = [t for t in FUNCTIONAL_TASKS for _ in range(samples)]
    prompts = [task_ask(t).prompt for t in tasks]
    answers = _complete(model, tokenizer, prompts, *sampling, "chat: well-known functions", False, bos=False, stop=())
    for t, (text, _) in zip(tasks, answers):
        ok = passes(t, answer_code(text))
        rep.functional.setdefault(t.name, []).append(ok)
        rep.samples.append((t.name, ok, text))
    return rep
