"""Function examples (`dsv4.train.functions`): real functions written in the completion prompts' form, the
held-out split respected by name, the same output from any number of processes, bad arguments refused."""

from __future__ import annotations

import ast

from dsv4.eval.code import has_body, one_line_docstring_prompts
from dsv4.train import functions
from dsv4.train.data import find_documents, is_held_out
from dsv4.train.functions import one_line_docstring_examples

SOURCE = '''"""A module."""
import os


def add(a,
        b):
    """Add two numbers.

    Longer text that the example leaves out.
    """
    # a comment stays
    return a + b


def only_doc():
    """Nothing else."""


class Box:
    def size(self):
        """The size."""
        if self.items:
            return len(self.items)
        return 0

    def same_line(self):
        """Doc."""; return 1


def undocumented():
    return 2
'''


def test_examples_are_the_completion_prompts_followed_by_the_functions_own_bodies():
    examples = one_line_docstring_examples(SOURCE)
    prompts = [p.prompt for p in one_line_docstring_prompts("m.py", SOURCE)]
    assert examples == [
        'def add(a,\n        b):\n    """Add two numbers."""\n    # a comment stays\n    return a + b\n',
        'def size(self):\n    """The size."""\n    if self.items:\n        return len(self.items)\n    return 0\n',
    ]
    for ex in examples:  # each one starts with a prompt `dsv4 eval completions` would ask, and is a whole function
        assert any(ex.startswith(p + "\n") for p in prompts)
        assert has_body(ex) and isinstance(ast.parse(ex).body[0], ast.FunctionDef)
    assert one_line_docstring_examples("def f(:\n") == []


def _held_out_and_kept(pct):
    names = [f"pkg/m{i}.py" for i in range(200)]
    held = [n for n in names if is_held_out(n, pct)]
    kept = [n for n in names if not is_held_out(n, pct)]
    assert held and kept  # (both kinds, or the test says nothing)
    return held[:3], kept[:3]


def test_held_out_documents_give_no_examples_and_the_rest_keep_their_names(tmp_path):
    held, kept = _held_out_and_kept(30.0)
    src = tmp_path / "src"
    for name in held + kept:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(SOURCE, encoding="utf-8")
    (src / "pkg" / "notes.txt").write_text(SOURCE, encoding="utf-8")  # not Python: no examples
    docs = find_documents([src])
    out = tmp_path / "out"
    counts = functions.write_examples(docs, out, 30.0)
    written = sorted(name for name, _ in find_documents([out]))
    assert written == sorted(kept)  # the same names, so `dsv4 train` splits them as their sources
    assert counts == {"files": 3, "examples": 6, "held_out_documents_left_out": 3}
    assert (out / kept[0]).read_text() == "\n\n".join(one_line_docstring_examples(SOURCE))
    again = tmp_path / "again"
    functions.write_examples(docs, again, 30.0, workers=2)
    assert all((again / n).read_bytes() == (out / n).read_bytes() for n in kept)


def test_the_command_writes_into_a_new_directory_only_and_refuses_bad_arguments(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text(SOURCE, encoding="utf-8")
    out = tmp_path / "out"
    assert functions.main(["--data", str(src), "--out", str(out), "--held-out-pct", "0", "--workers", "1"]) == 0
    assert "2 functions in 1 files" in capsys.readouterr().out
    before = (out / "a.py").read_bytes()
    assert functions.main(["--data", str(src), "--out", str(out)]) == 1  # not empty: nothing touched
    assert "not an empty directory" in capsys.readouterr().err and (out / "a.py").read_bytes() == before
    assert functions.main(["--data", str(src), "--out", str(tmp_path / "o2"), "--held-out-pct", "100"]) == 1
    assert functions.main(["--data", str(src), "--out", str(tmp_path / "o3"), "--workers", "-1"]) == 1
    assert functions.main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o4")]) == 1
    err = capsys.readouterr().err
    assert "--held-out-pct 100" in err and "--workers -1" in err and "no such file" in err


def test_chat_examples_ask_for_public_top_level_functions_and_answer_with_the_whole_function():
    from dsv4.serve.chat.encode import encode_chat

    (ex,) = functions.chat_examples(SOURCE)  # `size` is a method, `only_doc` has no body
    whole = one_line_docstring_examples(SOURCE)[0]
    request = functions.chat_request("add(a, b)", "Add two numbers.")
    assert request in [a.format(signature="add(a, b)", doc="Add two numbers.") for a in functions.CHAT_ASKS]
    messages = [{"role": "user", "content": request}, {"role": "assistant", "content": "```python\n" + whole + "```"}]
    assert ex == encode_chat(messages, add_bos=False)
    assert ex.startswith("<｜User｜>") and ex.endswith("```<｜end▁of▁sentence｜>")
    assert functions.chat_examples('def _private():\n    """Doc."""\n    return 1\n') == []
    marker = 'def eos():\n    """The end."""\n    return "<｜end▁of▁sentence｜>"\n'  # it would end the exchange
    assert functions.chat_examples(marker) == [] and one_line_docstring_examples(marker) != []
    # every phrasing is used, chosen by the name alone
    names = [f"f{i}" for i in range(40)]
    picks = {functions.chat_request(f"{n}(x)", "Do it.").replace(n, "NAME") for n in names}
    assert len(picks) == len(functions.CHAT_ASKS)
    assert functions.chat_request("f1(x)", "Do it.") == functions.chat_request("f1(x)", "Do it.")


def test_a_chat_document_is_bos_exchange_eos_for_each_exchange_once_the_loader_wraps_it():
    from dsv4.defaults import shipped_model_dir
    from dsv4.serve.chat.tokens import BOS, EOS
    from dsv4.tokenizer import Tokenizer

    tok = Tokenizer.from_file(shipped_model_dir() / "tokenizer.json")
    two = functions.chat_examples(SOURCE.replace("def add(", "def plus(") + "\n" + SOURCE)
    assert len(two) == 2
    text = functions.chat_document(two)
    assert not text.startswith(BOS) and not text.endswith(EOS)
    ids = tok.encode(BOS + text + EOS)
    assert ids.count(tok.bos_id) == 2 and ids.count(tok.eos_id) == 2  # the special tokens, not their text
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids.index(tok.eos_id) + 1 == len(ids) - 1 - ids[::-1].index(tok.bos_id)  # EOS then BOS between


def test_the_chat_command_writes_exchanges_under_the_same_names(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text(SOURCE, encoding="utf-8")
    out = tmp_path / "chat"
    argv = ["--data", str(src), "--out", str(out), "--held-out-pct", "0", "--workers", "1", "--chat"]
    assert functions.main(argv) == 0
    assert "1 chat exchanges in 1 files" in capsys.readouterr().out
    assert (out / "a.py").read_text() == functions.chat_document(functions.chat_examples(SOURCE))
