"""`dsv4 eval`: the completion scorer on written-out completions, the functional runner, and held-out loss
against a cross-entropy computed here from the model's own logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsv4 import DeepSeekV4, ModelConfig
from dsv4.eval.code import FUNCTIONAL_TASKS, has_body, one_line_docstring_prompts, passes, written_function
from dsv4.eval.heldout import held_out_loss
from dsv4.tokenizer import ByteTokenizer

SOURCE = '''import os


def add(a, b):
    """Return a + b."""
    return a + b


def long_doc(x):
    """First line.

    More.
    """
    return x


def only_doc():
    """Nothing else."""


class C:
    def method(self):
        """Not top level."""
        return 1

    def nested_only_doc(self):
        """Only this."""
'''


def test_prompts_are_documented_functions_and_methods_with_a_body_cut_to_a_one_line_docstring():
    prompts = one_line_docstring_prompts("m.py", SOURCE)
    assert [p.name for p in prompts] == ["add", "long_doc", "method"]
    assert prompts[0].prompt == 'def add(a, b):\n    """Return a + b."""'
    assert prompts[1].prompt == 'def long_doc(x):\n    """First line."""'
    assert prompts[2].prompt == 'def method(self):\n    """Not top level."""'  # dedented to column 0
    multi = 'def f(a,\n      b):\n    """Doc."""\n    return a\n'
    assert one_line_docstring_prompts("m.py", multi)[0].prompt == 'def f(a,\n      b):\n    """Doc."""'
    assert one_line_docstring_prompts("bad.py", "def f(:\n") == []


PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
BARE = 'def add(a, b):\n    """Return a + b."""'  # as prompts are given: no newline after the docstring


@pytest.mark.parametrize(
    "completion, finished, want_fn, want_body",
    [
        # the function ends at the first non-blank line back at column 0
        ("    return a + b\n\n\ndef other():\n    pass\n", False, PROMPT + "    return a + b\n", True),
        # ended by end-of-sequence inside the function: all of it counts
        ("    return a + b", True, PROMPT + "    return a + b\n", True),
        # the budget ended mid-line: the unfinished line is dropped, what is left is the docstring only
        ("    return a +", False, PROMPT, False),
        # the budget ended after whole lines: the last piece is the unfinished (empty) line
        ("    x = a\n    return x\n", False, PROMPT + "    x = a\n    return x\n", True),
        # wandering into a top-level comment ends the function with no body
        ("# a comment\nimport sys\n", False, PROMPT, False),
        # a body that does not parse
        ("    return (a +\n\nx = 1\n", False, PROMPT + "    return (a +\n", False),
    ],
)
def test_written_function_and_body(completion, finished, want_fn, want_body):
    fn = written_function(PROMPT, completion, finished)
    assert fn == want_fn
    assert has_body(fn) is want_body


@pytest.mark.parametrize(
    "completion, finished, want_body",
    [
        ("\n    return a + b\n\ndef g():\n", False, True),
        ("\n    return a + b", True, True),
        ("\n    return a +", False, False),  # the unfinished line is the model's: dropped
        ("  # trailing", False, False),  # no newline came: the docstring line stays, no body
        ("\n\ndef g():\n    pass\n", False, False),  # back at column 0 right after the docstring
    ],
)
def test_prompts_without_a_final_newline(completion, finished, want_body):
    fn = written_function(BARE, completion, finished)
    assert fn.startswith(BARE)
    assert has_body(fn) is want_body


def test_has_body_without_docstring_counts_every_statement():
    assert has_body("def f():\n    pass\n")
    assert not has_body("x = 1\n")


def _task(name):
    return next(t for t in FUNCTIONAL_TASKS if t.name == name)


def test_functional_runner_accepts_right_and_rejects_wrong_crashing_and_hanging_code():
    gcd = _task("gcd")
    assert passes(gcd, gcd.prompt + "\n    while b:\n        a, b = b, a % b\n    return a\n")
    assert not passes(gcd, gcd.prompt + "\n    return a * b\n")  # wrong
    assert not passes(gcd, gcd.prompt + "\n    return a / 0\n")  # raises
    assert not passes(gcd, gcd.prompt + "\n    while True:\n        pass\n", timeout_s=2.0)  # never returns
    assert not passes(gcd, "def gcd(a, b:\n")  # does not parse
    flatten = _task("flatten")
    assert passes(flatten, flatten.prompt + "\n    return [x for xs in lists for x in xs]\n")


def test_every_task_prompt_is_a_signature_and_docstring_that_a_right_answer_passes():
    right = {
        "mean": "return sum(values) / len(values)",
        "gcd": "import math; return math.gcd(a, b)",
        "clamp": "return max(lo, min(x, hi))",
        "flatten": "return [x for xs in lists for x in xs]",
        "factorial": "import math; return math.factorial(n)",
        "is_palindrome": "return s == s[::-1]",
        "is_prime": "return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
        "fibonacci": "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "reverse_words": "return ' '.join(reversed(text.split()))",
        "count_vowels": "return sum(c in 'aeiou' for c in text)",
        "maximum": "m = values[0]\n    for v in values:\n        m = v if v > m else m\n    return m",
        "unique": "return list(dict.fromkeys(items))",
    }
    assert set(right) == {t.name for t in FUNCTIONAL_TASKS}
    for t in FUNCTIONAL_TASKS:
        assert one_line_docstring_prompts("t.py", t.prompt + "\n    pass\n")[0].prompt == t.prompt
        assert passes(t, written_function(t.prompt, "\n    " + right[t.name] + "\n", finished=False)), t.name


def test_held_out_loss_equals_the_cross_entropy_of_every_token_after_the_first(tmp_path):
    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).eval()
    tok = ByteTokenizer(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
    texts = ["def f():\n    return 1\n" * 3, "x = 'é'\n" * 5]
    docs = []
    for i, t in enumerate(texts):
        p = tmp_path / f"d{i}.py"
        p.write_text(t, encoding="utf-8")
        docs.append((p.name, p))
    seq_len = 16
    r = held_out_loss(model, tok, docs, seq_len=seq_len, batch_size=3)
    stream = [i for t in texts for i in tok.encode(t, bos=True, eos=True)]
    # the same windows scored one at a time, here: every token after the first predicted once
    nats = 0.0
    for s in range(0, len(stream) - 1, seq_len):
        w = torch.tensor(stream[s : s + seq_len + 1])[None]
        with torch.no_grad():
            logits = model(w[:, :-1]).logits
        nats += float(F.cross_entropy(logits[0].float(), w[0, 1:], reduction="sum"))
    assert r.tokens == len(stream) - 1
    assert r.bytes == sum(len(t.encode("utf-8")) for t in texts)
    # batching three windows vs one at a time: fp32 sums of ~100 terms of size ~ln(vocab)
    assert r.nats == pytest.approx(nats, rel=1e-4)
    assert r.bits_per_byte == pytest.approx(r.nats / math.log(2) / r.bytes)


def test_a_token_budget_takes_whole_documents_that_fit_and_refuses_when_none_does(tmp_path):
    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).eval()
    tok = ByteTokenizer(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
    docs = []
    for i, t in enumerate(["a" * 50, "b" * 10, "c" * 20]):
        p = tmp_path / f"d{i}.py"
        p.write_text(t, encoding="utf-8")
        docs.append((p.name, p))
    r = held_out_loss(model, tok, docs, seq_len=16, max_tokens=40)  # 52 tokens do not fit, 12 + 22 do
    assert (r.documents, r.bytes, r.tokens) == (2, 30, 12 + 22 - 1)
    from dsv4.errors import UserError

    with pytest.raises(UserError, match="no held-out document fits in 5 tokens"):
        held_out_loss(model, tok, docs, seq_len=16, max_tokens=5)


def test_show_prints_the_well_known_samples_round_robin_with_their_verdicts(capsys):
    from dsv4.eval.cli import _print_samples

    # two functions x 3 samples each, in the evaluation's order (a function's samples together)
    samples = [("gcd", i == 1, f"def gcd_{i}(): pass\n") for i in range(3)]
    samples += [("mean", False, f"def mean_{i}(): pass\n") for i in range(3)]
    _print_samples(samples, 3, 3)
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("---- ")]
    assert [h.split(" -")[0] for h in heads] == [
        "---- gcd, sample 1: wrong",
        "---- mean, sample 1: wrong",
        "---- gcd, sample 2: right",
    ]
    assert "def gcd_1(): pass" in out and "def mean_1" not in out and "def gcd_2" not in out
