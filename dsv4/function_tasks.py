"""The well-known functions of the functional check: a signature, a one-line docstring and the cases a right
answer passes (mean, gcd, clamp, flatten, ...).

`dsv4.eval.code` runs a model's answers against them (`dsv4 eval completions` and `dsv4 eval chat`), and
`dsv4.train.exercises` keeps its training functions away from them; this module sits below both packages,
so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass


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
