"""The templates of `dsv4.train.exercises`: each family draws one everyday function (name, parameters, a
one-line docstring, a body in one of the usual styles) and inputs of its kind to run it on.

Add a family by writing a function of a `random.Random` that returns an `Exercise` and listing it in
`FAMILIES` (twice to draw it twice as often); `dsv4.train.exercises` runs every draw on its inputs and on
the held-out tasks' cases before keeping it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    name: str
    params: tuple[str, ...]
    doc: str  # one line
    body: tuple[str, ...]  # lines at one indent (4 spaces)
    inputs: tuple[tuple, ...]  # argument tuples it must run on

    def source(self) -> str:
        body = "\n".join("    " + line for line in self.body)
        return f'def {self.name}({", ".join(self.params)}):\n    """{self.doc}"""\n{body}\n'

    def compiled(self) -> Callable:
        scope: dict = {}
        exec(compile(self.source(), f"<exercise {self.name}>", "exec"), scope)  # noqa: S102 (our own templates)
        return scope[self.name]


# ------------------------------------------------------------------------------------------ inputs
WORDS = ("apple", "river", "Stone", "cloud", "a", "to", "green", "Blue", "tree", "moon", "seven", "x", "Night", "bird")


def _ints(rng: random.Random, n: int = 6, lo: int = -9, hi: int = 20) -> tuple[tuple, ...]:
    return tuple(([rng.randint(lo, hi) for _ in range(rng.randint(0, 8))],) for _ in range(n))


def _text(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 6))]
    if rng.random() < 0.3:
        words.append(str(rng.randint(0, 999)))
    return " ".join(words)


def _texts(rng: random.Random, n: int = 6) -> tuple[tuple, ...]:
    return tuple((_text(rng),) for _ in range(n))


def _naturals(rng: random.Random, n: int = 6, hi: int = 30) -> tuple[tuple, ...]:
    return tuple((rng.randint(0, hi),) for _ in range(n))


# ------------------------------------------------------------------------------------------ parts
LIST_NAMES = ("values", "numbers", "nums", "xs", "items", "data", "seq", "lst", "arr", "scores", "counts", "readings")
TEXT_NAMES = ("text", "s", "line", "sentence", "string", "phrase", "msg", "title")
INT_NAMES = ("n", "number", "limit", "count", "size")


def _number_predicate(rng: random.Random, v: str) -> dict:
    """A test of one number `v`: name (for function names), adjective or trailing phrase, verb phrase, code."""
    k = rng.randint(2, 20)
    return rng.choice(
        [
            {"name": "even", "adj": "even", "verb": "is even", "code": f"{v} % 2 == 0"},
            {"name": "odd", "adj": "odd", "verb": "is odd", "code": f"{v} % 2 == 1"},
            {"name": "positive", "adj": "positive", "verb": "is positive", "code": f"{v} > 0"},
            {"name": "negative", "adj": "negative", "verb": "is negative", "code": f"{v} < 0"},
            {"name": "nonzero", "adj": "non-zero", "verb": "is not zero", "code": f"{v} != 0"},
            {"name": f"above_{k}", "post": f"greater than {k}", "verb": f"is greater than {k}", "code": f"{v} > {k}"},
            {"name": f"below_{k}", "post": f"less than {k}", "verb": f"is less than {k}", "code": f"{v} < {k}"},
            {
                "name": f"multiple_of_{k}",
                "post": f"divisible by {k}",
                "verb": f"is divisible by {k}",
                "code": f"{v} % {k} == 0",
            },
        ]
    )


def _numbers_that(pred: dict, p: str) -> str:
    return f"the {pred['adj']} numbers in {p}" if "adj" in pred else f"the numbers in {p} that are {pred['post']}"


def _char_predicate(rng: random.Random, v: str) -> dict:
    c = rng.choice("abcdefgkmnorstxz")
    return rng.choice(
        [
            {"name": "digit_chars", "what": "digits", "code": f"{v}.isdigit()"},
            {"name": "uppercase", "what": "uppercase letters", "code": f"{v}.isupper()"},
            {"name": "spaces", "what": "spaces", "code": f"{v} == ' '"},
            {"name": "letters", "what": "letters", "code": f"{v}.isalpha()"},
            {"name": f"char_{c}", "what": f"occurrences of the character {c!r}", "code": f"{v} == {c!r}"},
        ]
    )


def _transform(rng: random.Random, v: str) -> dict:
    """A change of one number `v`: name, "each" phrase ({p}: the list), plural noun (where there is one), code."""
    k = rng.randint(2, 12)
    return rng.choice(
        [
            {"name": "squares", "each": "the square of each number in {p}", "plural": "squares", "code": f"{v} * {v}"},
            {"name": "cubes", "each": "the cube of each number in {p}", "plural": "cubes", "code": f"{v} ** 3"},
            {"name": "doubled", "each": "each number in {p} doubled", "code": f"2 * {v}"},
            {"name": f"plus_{k}", "each": f"each number in {{p}} increased by {k}", "code": f"{v} + {k}"},
            {"name": f"minus_{k}", "each": f"each number in {{p}} decreased by {k}", "code": f"{v} - {k}"},
            {"name": f"times_{k}", "each": f"each number in {{p}} multiplied by {k}", "code": f"{v} * {k}"},
            {"name": "negated", "each": "each number in {p} negated", "code": f"-{v}"},
            {
                "name": "absolutes",
                "each": "the absolute value of each number in {p}",
                "plural": "absolute values",
                "code": f"abs({v})",
            },
            {
                "name": f"mod_{k}",
                "each": f"the remainder of each number in {{p}} divided by {k}",
                "code": f"{v} % {k}",
            },
        ]
    )


# ------------------------------------------------------------------------------------------ families
def _list_reduce(rng: random.Random) -> Exercise:
    """Sum, count, filter, any, all and first index of the numbers that pass a test."""
    p = rng.choice(LIST_NAMES)
    pred = _number_predicate(rng, "x")
    cond, what, nm = pred["code"], _numbers_that(pred, p), pred["name"]
    kind = rng.choice(["sum", "count", "filter", "any", "all", "index"])
    loop = rng.random() < 0.5
    if kind == "sum":
        name = rng.choice([f"sum_{nm}", f"sum_of_{nm}", f"{nm}_total"])
        doc = f"Return the sum of {what}."
        body = (
            ("total = 0", f"for x in {p}:", f"    if {cond}:", "        total += x", "return total")
            if loop
            else (f"return sum(x for x in {p} if {cond})",)
        )
    elif kind == "count":
        name = rng.choice([f"count_{nm}", f"number_of_{nm}", f"how_many_{nm}"])
        doc = f"Return how many numbers in {p} are {pred.get('adj') or pred['post']}."
        body = (
            ("count = 0", f"for x in {p}:", f"    if {cond}:", "        count += 1", "return count")
            if loop
            else (rng.choice([f"return sum(1 for x in {p} if {cond})", f"return len([x for x in {p} if {cond}])"]),)
        )
    elif kind == "filter":
        name = rng.choice([f"keep_{nm}", f"only_{nm}", f"filter_{nm}", f"select_{nm}"])
        doc = f"Return a list of {what}, in their original order."
        body = (
            ("result = []", f"for x in {p}:", f"    if {cond}:", "        result.append(x)", "return result")
            if loop
            else (f"return [x for x in {p} if {cond}]",)
        )
    elif kind == "any":
        name = rng.choice([f"has_{nm}", f"any_{nm}", f"contains_{nm}"])
        doc = f"Return True if some number in {p} {pred['verb']}."
        body = (
            (f"for x in {p}:", f"    if {cond}:", "        return True", "return False")
            if loop
            else (f"return any({cond} for x in {p})",)
        )
    elif kind == "all":
        name = rng.choice([f"all_{nm}", f"every_{nm}", f"only_{nm}_numbers"])
        doc = f"Return True if every number in {p} {pred['verb']}."
        body = (
            (f"for x in {p}:", f"    if not {cond}:", "        return False", "return True")
            if loop
            else (f"return all({cond} for x in {p})",)
        )
    else:
        name = rng.choice([f"first_{nm}_index", f"index_of_first_{nm}", f"find_{nm}"])
        doc = f"Return the index of the first number in {p} that {pred['verb']}, or -1 if there is none."
        body = (f"for i, x in enumerate({p}):", f"    if {cond}:", "        return i", "return -1")
    return Exercise(name, (p,), doc, body, _ints(rng))


def _list_map(rng: random.Random) -> Exercise:
    """A list of transformed numbers, or the sum of the transformed numbers."""
    p = rng.choice(LIST_NAMES)
    t = _transform(rng, "x")
    if "plural" in t and rng.random() < 0.4:
        name = rng.choice([f"sum_of_{t['name']}", f"{t['name']}_sum"])
        doc = f"Return the sum of the {t['plural']} of the numbers in {p}."
        body = (
            ("total = 0", f"for x in {p}:", f"    total += {t['code']}", "return total")
            if rng.random() < 0.5
            else (f"return sum({t['code']} for x in {p})",)
        )
    else:
        name = rng.choice([t["name"], f"{t['name']}_list", f"map_{t['name']}"])
        doc = f"Return a list of {t['each'].format(p=p)}."
        body = (
            ("result = []", f"for x in {p}:", f"    result.append({t['code']})", "return result")
            if rng.random() < 0.5
            else (f"return [{t['code']} for x in {p}]",)
        )
    return Exercise(name, (p,), doc, body, _ints(rng))


def _list_shape(rng: random.Random) -> Exercise:
    """Positions, neighbours and order within one list."""
    p = rng.choice(LIST_NAMES)
    k = rng.randint(2, 4)
    loop = rng.random() < 0.5
    options = {
        "every_other": (
            "Return every second item of {p}, starting with the first.",
            (f"return {p}[::2]",)
            if not loop
            else (
                "result = []",
                f"for i, x in enumerate({p}):",
                "    if i % 2 == 0:",
                "        result.append(x)",
                "return result",
            ),
        ),
        "rotate_left": ("Return {p} with its first item moved to the end.", (f"return {p}[1:] + {p}[:1]",)),
        "running_totals": (
            "Return a list of the running totals of the numbers in {p}.",
            (
                "totals = []",
                "total = 0",
                f"for x in {p}:",
                "    total += x",
                "    totals.append(total)",
                "return totals",
            ),
        ),
        "differences": (
            "Return a list of the differences between each number in {p} and the one before it.",
            (f"return [b - a for a, b in zip({p}, {p}[1:])]",)
            if not loop
            else (
                "result = []",
                f"for i in range(1, len({p})):",
                f"    result.append({p}[i] - {p}[i - 1])",
                "return result",
            ),
        ),
        "is_sorted": (
            "Return True if the numbers in {p} are in non-decreasing order.",
            (f"return all(a <= b for a, b in zip({p}, {p}[1:]))",)
            if not loop
            else (
                f"for i in range(1, len({p})):",
                f"    if {p}[i] < {p}[i - 1]:",
                "        return False",
                "return True",
            ),
        ),
        f"chunks_of_{k}": (
            f"Return {{p}} split into consecutive lists of {k} items (the last one may be shorter).",
            (f"return [{p}[i:i + {k}] for i in range(0, len({p}), {k})]",),
        ),
        "count_changes": (
            "Return how many times a number in {p} differs from the one before it.",
            (
                "count = 0",
                f"for i in range(1, len({p})):",
                f"    if {p}[i] != {p}[i - 1]:",
                "        count += 1",
                "return count",
            ),
        ),
        "pairs": (
            "Return a list of the pairs of neighbouring items in {p}, as tuples.",
            (f"return list(zip({p}, {p}[1:]))",),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    return Exercise(name, (p,), doc.format(p=p), body, _ints(rng))


def _ranges(rng: random.Random) -> Exercise:
    """Sums and lists over the integers from 1 (or 0) to n."""
    n = rng.choice(INT_NAMES)
    k = rng.randint(2, 9)
    loop = rng.random() < 0.5
    options = {
        "sum_to": (
            f"Return the sum of the integers from 1 to {n}.",
            ("total = 0", f"for i in range(1, {n} + 1):", "    total += i", "return total")
            if loop
            else (f"return {n} * ({n} + 1) // 2",),
        ),
        "sum_of_squares_to": (
            f"Return the sum of the squares of the integers from 1 to {n}.",
            (f"return sum(i * i for i in range(1, {n} + 1))",),
        ),
        "sum_of_evens_to": (
            f"Return the sum of the even integers from 0 to {n}.",
            ("total = 0", f"for i in range(0, {n} + 1, 2):", "    total += i", "return total")
            if loop
            else (f"return sum(range(0, {n} + 1, 2))",),
        ),
        f"count_multiples_of_{k}": (
            f"Return how many integers from 1 to {n} are divisible by {k}.",
            (f"return {n} // {k}",)
            if not loop
            else (
                "count = 0",
                f"for i in range(1, {n} + 1):",
                f"    if i % {k} == 0:",
                "        count += 1",
                "return count",
            ),
        ),
        "squares_up_to": (
            f"Return a list of the squares of the integers from 1 to {n}.",
            (f"return [i * i for i in range(1, {n} + 1)]",),
        ),
        f"first_multiples_of_{k}": (
            f"Return a list of the first n positive multiples of {k}.",
            (f"return [{k} * i for i in range(1, n + 1)]",),
        ),
        "countdown": (
            f"Return a list of the integers from {n} down to 1.",
            (f"return list(range({n}, 0, -1))",),
        ),
        "triangle_numbers": (
            "Return a list of the first n triangle numbers (1, 3, 6, ...).",
            (
                "result = []",
                "total = 0",
                "for i in range(1, n + 1):",
                "    total += i",
                "    result.append(total)",
                "return result",
            ),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    first_n = name in (f"first_multiples_of_{k}", "triangle_numbers")  # ("the first limit ..." reads badly)
    return Exercise(name, ("n",) if first_n else (n,), doc, body, _naturals(rng))


def _digits(rng: random.Random) -> Exercise:
    n = rng.choice(INT_NAMES)
    loop = rng.random() < 0.5
    options = {
        "digit_sum": (
            f"Return the sum of the decimal digits of the non-negative integer {n}.",
            ("total = 0", f"while {n} > 0:", f"    total += {n} % 10", f"    {n} //= 10", "return total")
            if loop
            else (f"return sum(int(d) for d in str({n}))",),
        ),
        "digit_count": (
            f"Return the number of decimal digits of the non-negative integer {n}.",
            (f"return len(str({n}))",),
        ),
        "reverse_digits": (
            f"Return the integer written with the decimal digits of the non-negative integer {n} in reverse order.",
            (f"return int(str({n})[::-1])",),
        ),
        "digits_of": (
            f"Return a list of the decimal digits of the non-negative integer {n}, most significant first.",
            (f"return [int(d) for d in str({n})]",),
        ),
        "largest_digit": (
            f"Return the largest decimal digit of the non-negative integer {n}.",
            (f"return int(max(str({n})))",),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    return Exercise(name, (n,), doc, body, _naturals(rng, hi=99999))


def _characters(rng: random.Random) -> Exercise:
    """Counting and transforming the characters of a string."""
    p = rng.choice(TEXT_NAMES)
    loop = rng.random() < 0.5
    if rng.random() < 0.45:
        pred = _char_predicate(rng, "ch")
        name = rng.choice([f"count_{pred['name']}", f"number_of_{pred['name']}"])
        doc = f"Return the number of {pred['what']} in {p}."
        body = (
            ("count = 0", f"for ch in {p}:", f"    if {pred['code']}:", "        count += 1", "return count")
            if loop
            else (f"return sum(1 for ch in {p} if {pred['code']})",)
        )
        return Exercise(name, (p,), doc, body, _texts(rng))
    a, b = rng.sample("aeostnrx-_", 2)
    k = rng.randint(1, 5)
    options = {
        "shout": (f"Return {p} in uppercase.", (f"return {p}.upper()",)),
        "without_spaces": (
            f"Return {p} with every space removed.",
            (f"return {p}.replace(' ', '')",)
            if not loop
            else ("result = ''", f"for ch in {p}:", "    if ch != ' ':", "        result += ch", "return result"),
        ),
        "reverse_text": (
            f"Return the characters of {p} in reverse order.",
            (f"return {p}[::-1]",)
            if not loop
            else ("result = ''", f"for ch in {p}:", "    result = ch + result", "return result"),
        ),
        "double_letters": (
            f"Return {p} with every character repeated twice.",
            (f"return ''.join(ch * 2 for ch in {p})",),
        ),
        f"first_{k}_chars": (f"Return the first {k} characters of {p}.", (f"return {p}[:{k}]",)),
        f"replace_{'dash' if a == '-' else 'underscore' if a == '_' else a}": (
            f"Return {p} with every {a!r} replaced by {b!r}.",
            (f"return {p}.replace({a!r}, {b!r})",)
            if not loop
            else ("result = ''", f"for ch in {p}:", f"    result += {b!r} if ch == {a!r} else ch", "return result"),
        ),
        "letters_only": (
            f"Return the letters of {p} in order, without its other characters.",
            (f"return ''.join(ch for ch in {p} if ch.isalpha())",),
        ),
        "starts_with_digit": (
            f"Return True if {p} is not empty and its first character is a digit.",
            (f"return {p}[:1].isdigit()",),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    return Exercise(name, (p,), doc, body, _texts(rng))


def _words(rng: random.Random) -> Exercise:
    p = rng.choice(TEXT_NAMES)
    k = rng.randint(2, 5)
    loop = rng.random() < 0.5
    options = {
        "word_count": (f"Return the number of words in {p}.", (f"return len({p}.split())",)),
        "longest_word": (
            f"Return the longest word of {p} (the first of the longest), or an empty string if it has none.",
            (
                "best = ''",
                f"for word in {p}.split():",
                "    if len(word) > len(best):",
                "        best = word",
                "return best",
            ),
        ),
        "shortest_word": (
            f"Return the shortest word of {p} (the first of the shortest), or an empty string if it has none.",
            (f"words = {p}.split()", "if not words:", "    return ''", "return min(words, key=len)"),
        ),
        f"words_longer_than_{k}": (
            f"Return a list of the words of {p} that have more than {k} characters.",
            (f"return [w for w in {p}.split() if len(w) > {k}]",)
            if not loop
            else (
                "result = []",
                f"for word in {p}.split():",
                f"    if len(word) > {k}:",
                "        result.append(word)",
                "return result",
            ),
        ),
        "word_lengths": (
            f"Return a list of the lengths of the words in {p}.",
            (f"return [len(w) for w in {p}.split()]",),
        ),
        "sorted_words": (
            f"Return the words of {p} in alphabetical order, joined by single spaces.",
            (f"return ' '.join(sorted({p}.split()))",),
        ),
        "initials": (
            f"Return the first character of each word in {p}, joined together.",
            (f"return ''.join(w[0] for w in {p}.split())",),
        ),
        "capitalize_words": (
            f"Return {p} with the first character of each word in uppercase, words joined by single spaces.",
            (f"return ' '.join(w[:1].upper() + w[1:] for w in {p}.split())",),
        ),
        "first_word": (
            f"Return the first word of {p}, or an empty string if it has none.",
            (f"words = {p}.split()", "return words[0] if words else ''"),
        ),
        "dashed": (f"Return the words of {p} joined by single dashes.", (f"return '-'.join({p}.split())",)),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    return Exercise(name, (p,), doc, body, _texts(rng))


def _two_lists(rng: random.Random) -> Exercise:
    a, b = rng.choice([("a", "b"), ("first", "second"), ("xs", "ys"), ("left", "right")])
    loop = rng.random() < 0.5
    options = {
        "pairwise_sums": (
            f"Return a list of the sums of the numbers of {a} and {b} at the same positions.",
            (f"return [x + y for x, y in zip({a}, {b})]",)
            if not loop
            else ("result = []", f"for x, y in zip({a}, {b}):", "    result.append(x + y)", "return result"),
        ),
        "dot_product": (
            f"Return the sum of the products of the numbers of {a} and {b} at the same positions.",
            (f"return sum(x * y for x, y in zip({a}, {b}))",)
            if not loop
            else ("total = 0", f"for x, y in zip({a}, {b}):", "    total += x * y", "return total"),
        ),
        "common_items": (
            f"Return a list of the items of {a} that are also in {b}, in the order of {a}.",
            (f"return [x for x in {a} if x in {b}]",),
        ),
        "missing_items": (
            f"Return a list of the items of {a} that are not in {b}, in the order of {a}.",
            (f"return [x for x in {a} if x not in {b}]",)
            if not loop
            else (
                "result = []",
                f"for x in {a}:",
                f"    if x not in {b}:",
                "        result.append(x)",
                "return result",
            ),
        ),
        "count_matches": (
            f"Return how many positions hold equal items in {a} and {b}.",
            (f"return sum(1 for x, y in zip({a}, {b}) if x == y)",),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    inputs = tuple((x[0], y[0]) for x, y in zip(_ints(rng, lo=0, hi=6), _ints(rng, lo=0, hi=6)))
    return Exercise(name, (a, b), doc, body, inputs)


def _two_numbers(rng: random.Random) -> Exercise:
    a, b = rng.choice([("a", "b"), ("x", "y"), ("m", "n")])
    loop = rng.random() < 0.5
    options = {
        "larger": (
            f"Return the larger of {a} and {b}.",
            (f"if {a} > {b}:", f"    return {a}", f"return {b}") if loop else (f"return max({a}, {b})",),
        ),
        "smaller": (
            f"Return the smaller of {a} and {b}.",
            (f"if {a} < {b}:", f"    return {a}", f"return {b}") if loop else (f"return min({a}, {b})",),
        ),
        "distance": (f"Return the absolute difference between {a} and {b}.", (f"return abs({a} - {b})",)),
        "sum_between": (
            f"Return the sum of the integers from {a} to {b} inclusive (0 if {a} > {b}).",
            ("total = 0", f"for i in range({a}, {b} + 1):", "    total += i", "return total")
            if loop
            else (f"return sum(range({a}, {b} + 1))",),
        ),
        "power": (
            f"Return {a} raised to the power of the non-negative integer {b}, by repeated multiplication.",
            ("result = 1", f"for _ in range({b}):", f"    result *= {a}", "return result"),
        ),
        "is_multiple": (f"Return True if {a} is a multiple of the positive integer {b}.", (f"return {a} % {b} == 0",)),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    inputs = tuple((rng.randint(-5, 12), rng.randint(1, 6)) for _ in range(6))
    return Exercise(name, (a, b), doc, body, inputs)


def _dicts(rng: random.Random) -> Exercise:
    k = rng.randint(0, 5)
    options = {
        "frequencies": (
            ("items",),
            "Return a dictionary mapping each item of items to the number of times it occurs.",
            ("counts = {}", "for item in items:", "    counts[item] = counts.get(item, 0) + 1", "return counts"),
        ),
        "invert": (
            ("d",),
            "Return a dictionary mapping each value of the dictionary d to its key.",
            ("return {v: k for k, v in d.items()}",),
        ),
        f"keys_above_{k}": (
            ("d",),
            f"Return a list of the keys of the dictionary d whose values are greater than {k}.",
            (f"return [key for key, value in d.items() if value > {k}]",),
        ),
        "sum_values": (("d",), "Return the sum of the values of the dictionary d.", ("return sum(d.values())",)),
    }
    name = rng.choice(sorted(options))
    params, doc, body = options[name]
    if name == "frequencies":
        inputs = tuple((x[0],) for x in _ints(rng, lo=0, hi=4))
    else:
        inputs = tuple(({w: rng.randint(-3, 9) for w in rng.sample(WORDS, rng.randint(0, 5))},) for _ in range(6))
    return Exercise(name, params, doc, body, inputs)


def _nested(rng: random.Random) -> Exercise:
    p = rng.choice(("rows", "grid", "table", "matrix"))
    options = {
        "row_sums": (f"Return a list of the sums of the lists in {p}.", (f"return [sum(row) for row in {p}]",)),
        "grand_total": (
            f"Return the sum of all the numbers in {p}, a list of lists of numbers.",
            ("total = 0", f"for row in {p}:", "    for x in row:", "        total += x", "return total"),
        ),
        "longest_row_length": (
            f"Return the length of the longest list in {p}, or 0 if there is none.",
            (f"return max((len(row) for row in {p}), default=0)",),
        ),
        "first_column": (
            f"Return a list of the first item of each non-empty list in {p}.",
            (f"return [row[0] for row in {p} if row]",),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    inputs = tuple(([x[0] for x in _ints(rng, n=rng.randint(0, 4))],) for _ in range(6))
    return Exercise(name, (p,), doc, body, inputs)


def _recursive(rng: random.Random) -> Exercise:
    n = rng.choice(("n", "k"))
    options = {
        "triangle": (
            f"Return the sum of the integers from 1 to {n}, computed recursively.",
            (f"if {n} <= 0:", "    return 0", f"return {n} + triangle({n} - 1)"),
        ),
        "power_of_two": (
            f"Return 2 to the power of the non-negative integer {n}, computed recursively.",
            (f"if {n} == 0:", "    return 1", f"return 2 * power_of_two({n} - 1)"),
        ),
        "count_digits": (
            f"Return the number of decimal digits of the non-negative integer {n}, computed recursively.",
            (f"if {n} < 10:", "    return 1", f"return 1 + count_digits({n} // 10)"),
        ),
    }
    name = rng.choice(sorted(options))
    doc, body = options[name]
    return Exercise(name, (n,), doc, body, _naturals(rng))


FAMILIES: tuple[Callable[[random.Random], Exercise], ...] = (
    _list_reduce,
    _list_reduce,
    _list_map,
    _list_shape,
    _ranges,
    _digits,
    _characters,
    _characters,
    _words,
    _two_lists,
    _two_numbers,
    _dicts,
    _nested,
    _recursive,
)
