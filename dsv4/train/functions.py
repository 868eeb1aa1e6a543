"""Function examples: the documented functions of a corpus's training documents, in the completion prompts' form.

    python3 -m dsv4.train.functions --data corpus.json --out functions/   # from a corpus manifest
    python3 -m dsv4.train.functions --out functions/                      # from the Python stdlib
    python3 -m dsv4.train.functions --data corpus.json --out chat/ --chat # as V4 chat exchanges
    dsv4 train --data corpus.json functions/ chat/ ...                    # train on all three

Library code documents its functions with long docstrings, so a model trained on it alone learns that a
docstring goes on for lines and that the body comes late; the completion prompts (`dsv4.eval.code`), and
people, give a `def` line and a one-line docstring and expect the body next. Each example here is one real
function of the corpus written that way: its `def` line(s) at column 0, its docstring's first line as a
one-line docstring, then its own body (`one_line_docstring_examples`; the prompts are cut by the same rule,
`documented_functions`). The examples of a document are written to a file of the same relative name under
--out, so `dsv4 train`'s held-out split (a hash of the name, `dsv4.train.data.is_held_out`) treats the file
as it treats its source; documents of the held-out split are left out altogether, so nothing held out is
trained on in either form.

`--chat` writes the same functions (the public top-level ones) as V4 chat exchanges instead: the user asks
for the function by its signature and its docstring's first line, in one of a few phrasings
(`CHAT_ASKS`), and the assistant answers with the function in a fenced block (`chat_examples`); `dsv4 eval
chat` asks for functions the same way.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

from ..errors import UserError
from .data import find_documents, is_held_out, read_text


def _functions(tree: ast.Module):
    """Top-level functions and the methods of top-level classes (not functions nested in functions)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def documented_functions(text: str):
    """(node, prompt text, source lines) of every documented function of one file whose body has more than
    its docstring; the prompt: the `def` line(s), dedented to column 0 (a method keeps its `self`), and the
    docstring's first line as a one-line docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in _functions(tree):
        if len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        first = (doc.value.value.strip().splitlines() or [""])[0].strip()
        if not first or '"""' in first or first.endswith("\\"):
            continue
        header = lines[node.lineno - 1 : doc.lineno - 1]
        if any(line[: node.col_offset].strip() for line in header):
            continue
        header = [line[node.col_offset :] for line in header]
        indent = " " * (doc.col_offset - node.col_offset)
        yield node, "\n".join(header) + f'\n{indent}"""{first}"""', lines


def _whole_functions(text: str):
    """(node, the function written out whole) for each function of `documented_functions`: its prompt
    followed by its own body (the statements after the docstring, dedented as the prompt is). Functions
    whose docstring shares its last line with code, or whose body is indented less than the `def`, are
    left out."""
    for node, prompt, lines in documented_functions(text):
        doc = node.body[0]
        if lines[doc.end_lineno - 1][doc.end_col_offset :].strip():
            continue
        body = lines[doc.end_lineno : node.end_lineno]
        if any(line[: node.col_offset].strip() for line in body):
            continue
        yield node, prompt + "\n" + "\n".join(line[node.col_offset :] for line in body).rstrip() + "\n"


def one_line_docstring_examples(text: str) -> list[str]:
    """Each function of `documented_functions` (those `dsv4.eval.code.one_line_docstring_prompts` asks about)
    written out whole (`_whole_functions`)."""
    return [fn for _, fn in _whole_functions(text)]


# ------------------------------------------------------------------------------------------ chat form
# How a user asks for a function; an example's phrasing is chosen by its name (`chat_request`)
CHAT_ASKS = (
    "Write a Python function `{signature}`: {doc}",
    "Implement `{signature}` in Python. {doc}",
    "{doc} Write it as a Python function `{signature}`.",
    "I need a Python function `{signature}`. {doc}",
)


def chat_request(signature: str, doc: str) -> str:
    """The user's request for the function `signature` ("name(args)") that does `doc` (one line)."""
    name = signature.split("(")[0]
    pick = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little") % len(CHAT_ASKS)
    return CHAT_ASKS[pick].format(signature=signature, doc=doc)


def chat_answer(function: str) -> str:
    """The assistant's answer: the function in a fenced Python block."""
    return "```python\n" + function.rstrip("\n") + "\n```"


def chat_functions(text: str):
    """(name, the user's request, the whole function) of each documented top-level public function of one
    file (`_whole_functions`): what the chat examples answer and `dsv4 eval chat` asks."""
    from ..serve.chat.tokens import TOKENIZER_SPECIAL_STRINGS

    for node, fn in _whole_functions(text):
        if node.col_offset or node.name.startswith("_"):  # a method, or private: not what people ask for
            continue
        if any(m in fn for m in TOKENIZER_SPECIAL_STRINGS):  # code that spells the format's markers (a chat
            continue  # encoder's own source) would read as turn boundaries once tokenized
        doc = (ast.get_docstring(node) or "").strip().splitlines()[0].strip()
        yield node.name, chat_request(f"{node.name}({ast.unparse(node.args)})", doc), fn


def chat_examples(text: str) -> list[str]:
    """Each function of `chat_functions` as a V4 chat exchange: the user asks for it by its signature and
    its docstring's first line (`chat_request`), the assistant answers with the whole function
    (`chat_answer`). Rendered by the V4 chat encoder, not thinking, without BOS (the training loader puts
    one before each document; `chat_document` joins a file's exchanges)."""
    from ..serve.chat.encode import encode_chat

    out = []
    for _, request, fn in chat_functions(text):
        messages = [{"role": "user", "content": request}, {"role": "assistant", "content": chat_answer(fn)}]
        out.append(encode_chat(messages, add_bos=False))
    return out


def chat_document(exchanges: list[str]) -> str:
    """One training document of several exchanges: BOS between them, none before the first and no EOS
    after the last (the loader writes each document as BOS ... EOS)."""
    from ..serve.chat.tokens import BOS, EOS

    text = BOS.join(exchanges)
    return text[: -len(EOS)] if text.endswith(EOS) else text


def _examples_of(path: Path) -> list[str]:
    return one_line_docstring_examples(read_text(path))


def _chat_of(path: Path) -> list[str]:
    return chat_examples(read_text(path))


def write_examples(
    docs: list[tuple[str, Path]], out: Path, held_out_pct: float, workers: int = 1, chat: bool = False
) -> dict:
    """Write out/<name> for every training document with at least one example (parsed by `workers`
    processes; chat: the exchanges of `chat_examples` instead); -> counts."""
    py = [(name, path) for name, path in docs if name.endswith(".py")]
    todo = [(name, path) for name, path in py if not is_held_out(name, held_out_pct)]
    skipped = len(py) - len(todo)
    files = examples = 0
    root = out.resolve()
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        paths = [path for _, path in todo]
        of = _chat_of if chat else _examples_of
        found_all = pool.map(of, paths, chunksize=32) if pool else map(of, paths)
        for (name, _), found in zip(todo, found_all):
            if not found:
                continue
            dst = (out / name).resolve()
            if root not in dst.parents:  # a manifest's name never leaves --out
                raise UserError(f"document name {name!r} would be written outside --out")
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".tmp")
            # two blank lines between functions; BOS between chat exchanges
            tmp.write_text(chat_document(found) if chat else "\n\n".join(found), encoding="utf-8")
            os.replace(tmp, dst)
            files += 1
            examples += len(found)
    return {"files": files, "examples": examples, "held_out_documents_left_out": skipped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dsv4.train.functions", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data", nargs="*", default=None, help="files, directories or a corpus manifest (default: the Python stdlib)"
    )
    ap.add_argument("--out", required=True, help="a new or empty directory for the examples")
    ap.add_argument(
        "--held-out-pct", type=float, default=2.0, help="the training run's --held-out-pct (default: 2.0, the recipes')"
    )
    ap.add_argument(
        "--workers", type=int, default=0, help="processes that parse the sources; 0 = one per core (default)"
    )
    ap.add_argument(
        "--chat",
        action="store_true",
        help="write each public top-level function as a V4 chat exchange instead (the user asks for it by "
        "signature and docstring line, the assistant answers with the code): a model trained on these "
        "answers `dsv4 chat` and /v1/chat/completions",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = args.workers or cores
    try:
        if args.workers < 0:
            raise UserError(f"--workers {args.workers}: must be >= 0 (0 = one per core)")
        if not 0 <= args.held_out_pct < 100:
            raise UserError(f"--held-out-pct {args.held_out_pct}: must be in [0, 100)")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out}: exists and is not an empty directory (nothing written)")
        out.mkdir(parents=True, exist_ok=True)
        counts = write_examples(find_documents(args.data), out, args.held_out_pct, workers, chat=args.chat)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or out}: {e.strerror or e}", file=sys.stderr)  # a source or the output
        return 1
    print(
        f"{out}: {counts['examples']} {'chat exchanges' if args.chat else 'functions'} in {counts['files']} files "
        f"({counts['held_out_documents_left_out']} held-out documents left out)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
