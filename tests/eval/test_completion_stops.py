"""Stop strings in offline completion, and the completions evaluation's stops at a function's end: they save
tokens and change nothing else (`dsv4.engine.offline.complete`, `dsv4.eval.completions.FUNCTION_END`).

Oracle: the same prompts, seeds and settings run without stop strings, in deterministic mode (batch-invariant
numerics, so a sequence's draws do not depend on when the others end; each prompt has its own seed)."""

from __future__ import annotations

import pytest

from dsv4.checkpoint import load_pretrained
from dsv4.engine.offline import complete, generate
from dsv4.eval.code import FUNCTIONAL_TASKS, written_function
from dsv4.eval.completions import FUNCTION_END, _complete
from dsv4.loading import default_model_dir
from dsv4.tokenizer import Tokenizer

PROMPTS = [t.prompt for t in FUNCTIONAL_TASKS[:6]] + [
    'def area(w, h):\n    """Area of a rectangle."""\n',
    "import os\n\n\ndef ",
    "class Point:\n    def __init__(self, x, y):\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(default_model_dir())


@pytest.fixture(scope="module")
def model():
    return load_pretrained(default_model_dir(), progress=False).eval()


def test_a_stop_string_ends_the_text_before_it_and_nothing_else_changes(model, tok):
    kw = dict(max_new_tokens=40, temperature=1.0, top_p=0.95, seed=3, deterministic=True)
    free = complete(model, tok, PROMPTS, **kw)
    stop = ["\n\n", "return"]
    cut = complete(model, tok, PROMPTS, stop=stop, **kw)
    assert any(c.stopped for c in cut) and not any(c.stopped for c in free)
    for f, c in zip(free, cut):
        at = min((j for j in (f.text.find(s) for s in stop) if j >= 0), default=-1)
        assert c.stopped == (at >= 0)
        assert c.text == (f.text[:at] if at >= 0 else f.text)
        assert c.tokens == f.tokens[: len(c.tokens)]  # the same draws, fewer of them where a stop came
        if not c.stopped:  # no stop string came: the whole run, as without stops
            assert c.tokens == f.tokens and c.eos == f.eos


def test_the_evaluation_writes_the_same_functions_with_and_without_its_stops(model, tok):
    args = (PROMPTS, 48, 0.8, 0.9, 5)
    free = _complete(model, tok, *args, stop=(), deterministic=True)
    cut = _complete(model, tok, *args, deterministic=True)
    assert [written_function(p, *f) for p, f in zip(PROMPTS, free)] == [
        written_function(p, *c) for p, c in zip(PROMPTS, cut)
    ]
    assert sum(c[1] and not f[1] for f, c in zip(free, cut)) > 0  # some ended at a stop (a function's end)


def test_the_function_ends_open_a_line_at_column_0_and_fit_a_request():
    assert all(s.startswith("\n") and not s[1].isspace() for s in FUNCTION_END)
    assert len(FUNCTION_END) <= 16  # (a request's stop strings, `SamplingParams`)


def test_stop_strings_without_a_tokenizer_are_refused(model):
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        generate(model, [[0, 5, 6]], max_new_tokens=2, stop=["x"], token_healing=False)
