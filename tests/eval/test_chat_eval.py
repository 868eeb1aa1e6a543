"""`dsv4 eval chat`: the requests are the chat training examples' requests, the answer's code is found and
judged as the completions' functions are, and the whole evaluation runs through the engine."""

from __future__ import annotations

import pytest

from dsv4 import DeepSeekV4, ModelConfig
from dsv4.eval.chat import answer_code, defines_with_body, evaluate_chat, held_out_asks, task_ask
from dsv4.eval.code import FUNCTIONAL_TASKS, passes
from dsv4.serve.chat.encode import encode_chat
from dsv4.tokenizer import ByteTokenizer
from dsv4.train.functions import chat_answer, chat_examples

SOURCE = '''def add(a, b=1):
    """Return a + b."""
    return a + b


def _hidden(x):
    """Private."""
    return x


class C:
    def method(self):
        """A method."""
        return 1
'''


@pytest.mark.parametrize(
    "answer,code",
    [
        ("```python\ndef f(x):\n    return x\n```\nIt returns x.", "def f(x):\n    return x\n"),
        ("Here:\n```\ndef f(x):\n    return x\n```", "def f(x):\n    return x\n"),
        ("```python\ndef f(x):\n    return", "def f(x):\n    return"),  # cut by the token budget
        ("def f(x):\n    return x\n", "def f(x):\n    return x\n"),  # no fence: the whole answer
    ],
)
def test_answer_code_is_the_first_fenced_block_or_the_whole_answer(answer, code):
    assert answer_code(answer) == code


def test_defines_with_body_wants_the_function_asked_for_with_a_statement():
    assert defines_with_body("def f(x):\n    return x\n", "f")
    assert not defines_with_body("def g(x):\n    return x\n", "f")  # another function
    assert not defines_with_body('def f(x):\n    """Doc only."""\n', "f")
    assert not defines_with_body("def f(x:\n", "f")
    assert defines_with_body("import math\n\n\ndef f(x):\n    return math.sqrt(x)\n", "f")


def test_held_out_requests_are_the_training_examples_requests(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(SOURCE, encoding="utf-8")
    (ask,) = held_out_asks([("m.py", p)], 10)  # the private function and the method are not asked for
    (example,) = chat_examples(SOURCE)
    assert ask.name == "add" and "add(a, b=1)" in ask.request and "Return a + b." in ask.request
    assert example.startswith(encode_chat([{"role": "user", "content": ask.request}], add_bos=False))
    assert ask.prompt == encode_chat([{"role": "user", "content": ask.request}])  # BOS ... <｜Assistant｜></think>


def test_every_well_known_function_is_asked_by_its_signature_and_a_right_answer_passes():
    right = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n"
    for t in FUNCTIONAL_TASKS:
        ask = task_ask(t)
        signature = t.prompt.splitlines()[0][len("def ") : -1]
        doc = t.prompt.splitlines()[1].strip().strip('"')
        assert signature in ask.request and doc in ask.request, t.name
    gcd = next(t for t in FUNCTIONAL_TASKS if t.name == "gcd")
    assert passes(gcd, answer_code("Sure.\n" + chat_answer(right) + "\nDone."))
    assert not passes(gcd, answer_code(chat_answer(right.replace("a % b", "a - b"))))


def test_the_evaluation_runs_every_request_through_the_engine(tmp_path):
    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0).eval()
    tok = ByteTokenizer(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
    p = tmp_path / "m.py"
    p.write_text(SOURCE, encoding="utf-8")
    rep = evaluate_chat(model, tok, [("m.py", p)], n_prompts=5, samples=1, max_new_tokens=4)
    s = rep.summary()
    (ask,) = held_out_asks([("m.py", p)], 5)
    assert s["requests"] == 1 and len(rep.answers) == 1 and rep.answers[0].startswith(ask.request + "\n")
    assert s["functional_samples"] == len(FUNCTIONAL_TASKS) and set(s["functional_by_task"]) == {
        t.name for t in FUNCTIONAL_TASKS
    }
    assert s["functional_right"] == 0  # four bytes from random weights write no working function
    assert [(name, ok) for name, ok, _ in rep.samples] == [(t.name, False) for t in FUNCTIONAL_TASKS]
