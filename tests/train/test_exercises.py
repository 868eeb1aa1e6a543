"""Exercises (`dsv4.train.exercises`): template functions that run on their own inputs, none solving a held-out
functional task, written in the completion prompts' form that the function examples' parser reads back."""

from __future__ import annotations

import ast

from dsv4.eval.code import FUNCTIONAL_TASKS, has_body
from dsv4.train import exercises, functions
from dsv4.train.exercises import Exercise, generate, runs, solves_a_task
from dsv4.train.functions import one_line_docstring_examples

# one right answer per held-out task (what the filter must recognize), and a near miss for each kind of input
SOLUTIONS = {
    "mean": "def f(v):\n    return sum(v) / len(v)\n",
    "gcd": "def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "clamp": "def f(x, lo, hi):\n    return max(lo, min(x, hi))\n",
    "flatten": "def f(ls):\n    return [x for l in ls for x in l]\n",
    "factorial": "def f(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\n",
    "is_palindrome": "def f(s):\n    return s == s[::-1]\n",
    "is_prime": "def f(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "fibonacci": "def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "reverse_words": "def f(t):\n    return ' '.join(t.split()[::-1])\n",
    "count_vowels": "def f(t):\n    return sum(c in 'aeiou' for c in t)\n",
    "maximum": "def f(v):\n    m = v[0]\n    for x in v:\n        if x > m:\n            m = x\n    return m\n",
    "unique": "def f(v):\n    out = []\n    for x in v:\n        if x not in out:\n            out.append(x)\n"
    "    return out\n",
}


def _fn(src: str):
    scope: dict = {}
    exec(src, scope)
    return scope["f"]


def test_the_filter_recognizes_a_solution_of_every_task_and_nothing_else():
    """A filter that never fires would pass every other test here: each task's own solution is caught under
    its own name (so an exercise that solves one is dropped), and a wrong answer of each arity is not."""
    assert sorted(SOLUTIONS) == sorted(t.name for t in FUNCTIONAL_TASKS)
    for task in FUNCTIONAL_TASKS:
        n = len(task.cases[0][0])
        assert solves_a_task(_fn(SOLUTIONS[task.name]), n) == task.name
    assert solves_a_task(_fn("def f(x):\n    return None\n"), 1) is None
    assert solves_a_task(_fn("def f(a, b):\n    return a + b\n"), 2) is None
    assert solves_a_task(_fn("def f(a, b, c):\n    raise ValueError\n"), 3) is None


def test_exercises_are_distinct_run_on_their_inputs_and_solve_no_task():
    found, dropped = generate(400, seed=3)
    assert len(found) == 400
    assert generate(400, seed=3)[0] == found  # the same seed, the same exercises
    sources = [ex.source() for ex in found]
    assert len(set(sources)) == len(sources)
    task_names = {t.name for t in FUNCTIONAL_TASKS}
    for ex in found:
        assert runs(ex), ex.source()
        assert solves_a_task(ex.compiled(), len(ex.params)) is None, ex.source()
        assert ex.name not in task_names
        assert "\n" not in ex.doc and ex.doc.endswith(".")
        assert has_body(ex.source())
    assert set(dropped) == {"repeated", "failed_its_inputs", "solves_a_task"}


def test_an_exercise_that_fails_its_own_inputs_or_solves_a_task_is_not_kept(monkeypatch):
    bad = Exercise("broken", ("xs",), "Return the first item.", ("return xs[0]",), (([],),))
    assert not runs(bad)
    sneaky = Exercise("total", ("a", "b"), "Return a b.", ("while b:", "    a, b = b, a % b", "return a"), ((4, 6),))
    assert runs(sneaky) and solves_a_task(sneaky.compiled(), 2) == "gcd"
    draws = iter([bad, sneaky, bad])
    monkeypatch.setattr(exercises, "FAMILIES", (lambda rng: next(draws),))
    monkeypatch.setattr(exercises, "STALE", 1)
    found, dropped = generate(5)
    assert found == []
    assert dropped == {"repeated": 1, "failed_its_inputs": 1, "solves_a_task": 1}  # then the templates are spent


def test_written_files_read_back_as_function_examples_and_chat(tmp_path, capsys):
    out = tmp_path / "ex"
    assert exercises.main(["--out", str(out), "--count", "120", "--seed", "5", "--copies", "2"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{out}: 120 exercises in 3 files, each written 2 times")
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["exercises_00000.py", "exercises_00001.py", "exercises_00002.py"]
    want = {ex.source() for ex in generate(120, seed=5)[0]}
    read: list[str] = []
    for f in files:
        text = f.read_text()
        ast.parse(text)
        read += one_line_docstring_examples(text)  # the completion examples' own parser
    assert len(read) == 240 and set(read) == want  # every exercise twice, nothing else
    chat = tmp_path / "chat"
    assert functions.main(["--data", str(out), "--out", str(chat), "--chat", "--workers", "1"]) == 0
    assert "240 chat exchanges" in capsys.readouterr().out


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    for argv, says in (
        (["--out", str(full)], "exists and is not an empty directory"),
        (["--out", str(tmp_path / "a"), "--count", "0"], "--count 0: must be >= 1"),
        (["--out", str(tmp_path / "b"), "--copies", "0"], "--copies 0: must be >= 1"),
    ):
        assert exercises.main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
