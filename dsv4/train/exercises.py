"""Exercises: small everyday Python functions written from templates, each one run before it is kept.

    python3 -m dsv4.train.exercises --out exercises/                          # 30,000 functions, seed 0
    python3 -m dsv4.train.functions --data exercises/ --out ex-chat/ --chat   # the same as chat exchanges
    dsv4 train --data corpus.json functions/ exercises/ ex-chat/ ...

The training corpus (the standard library and installed packages, `dsv4.train.corpus`) holds few of the
short, self-contained functions people ask a model for: library code calls into itself, and a model trained
on it alone answers "sum the even numbers" with an import. Each exercise is a `def` line, a one-line
docstring saying what it returns (the completion prompts' form, `dsv4.eval.code`), and a body of a few lines
in one of the usual styles (a loop, a comprehension, a builtin). The families are the patterns of everyday
code: filters, counts, sums and maps over lists; character, string and word operations; digits; ranges; two
lists; two numbers; dictionaries; lists of lists; recursion.

Every exercise is compiled and run on inputs of its own kind before it is kept, so none is wrong by
construction. **None solves a held-out task**: each is also run on the cases of every task of
`dsv4.function_tasks.FUNCTIONAL_TASKS` with the same number of arguments, and one that returns every expected
result of a task is dropped (`solves_a_task`), whatever its name; no family rewords one of those tasks.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from .exercise_families import FAMILIES, Exercise

PER_FILE = 50  # exercises per written file (the held-out split hashes file names)
STALE = 20000  # draws in a row that repeat earlier exercises: the templates are spent


# ------------------------------------------------------------------------------------------ checks
def runs(ex: Exercise) -> Callable | None:
    """The exercise's function if it compiles and returns (no exception) on every one of its inputs, else
    None."""
    try:
        fn = ex.compiled()
        for args in ex.inputs:
            fn(*copy.deepcopy(args))
    except Exception:  # noqa: BLE001 (a template that fails its own inputs is dropped, whatever the error)
        return None
    return fn


def solves_a_task(fn: Callable, n_params: int) -> str | None:
    """The name of the first `dsv4.function_tasks.FUNCTIONAL_TASKS` task with n_params arguments whose every case
    `fn` answers right (None: none): an exercise that does so is not training data."""
    from ..function_tasks import FUNCTIONAL_TASKS

    for task in FUNCTIONAL_TASKS:
        if any(len(args) != n_params for args, _ in task.cases):
            continue
        try:
            if all(fn(*copy.deepcopy(args)) == want for args, want in task.cases):
                return task.name
        except Exception:  # noqa: BLE001 (a wrong type for this task: not a solution)
            continue
    return None


def generate(count: int, seed: int = 0, progress: bool = False) -> tuple[list[Exercise], dict[str, int]]:
    """Up to `count` distinct exercises, each checked (`runs`) and none solving a held-out task
    (`solves_a_task`); fewer where the templates run out (STALE draws in a row gave nothing new). ->
    (exercises, counts of what was dropped and why). progress: a bar on a terminal (`dsv4.progress`)."""
    from ..progress import bar

    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Exercise] = []
    dropped = {"repeated": 0, "failed_its_inputs": 0, "solves_a_task": 0}
    stale = 0
    shown = bar(count, "exercises", enabled=progress)
    while len(out) < count and stale < STALE:
        ex = rng.choice(FAMILIES)(rng)
        src = ex.source()
        if src in seen:
            dropped["repeated"] += 1
            stale += 1
            continue
        stale = 0
        seen.add(src)
        fn = runs(ex)
        if fn is None:
            dropped["failed_its_inputs"] += 1
            continue
        if solves_a_task(fn, len(ex.params)):
            dropped["solves_a_task"] += 1
            continue
        out.append(ex)
        shown.update(1)
    shown.close()
    return out, dropped


def write(exercises: list[Exercise], out: Path, copies: int = 1, seed: int = 0) -> int:
    """Files of PER_FILE exercises each (two blank lines between functions), written atomically; with
    copies > 1 a file holds its exercises that many times, each time in another order (more weight in a
    training mix, while the held-out split, which hashes file names, still keeps each exercise on one
    side). -> files."""
    rng = random.Random(seed)
    files = 0
    for i in range(0, len(exercises), PER_FILE):
        dst = out / f"exercises_{i // PER_FILE:05d}.py"
        tmp = dst.with_name(dst.name + ".tmp")
        group = [ex.source() for ex in exercises[i : i + PER_FILE]]
        order = list(group)
        for _ in range(copies - 1):
            rng.shuffle(group)
            order += group
        tmp.write_text("\n\n".join(order), encoding="utf-8")
        os.replace(tmp, dst)
        files += 1
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dsv4.train.exercises", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a new or empty directory for the exercises' files")
    ap.add_argument(
        "--count",
        type=int,
        default=30000,
        help="distinct exercises wanted (default: 30000; the templates hold about 34,000, and the last ones "
        "take the most draws)",
    )
    ap.add_argument("--seed", type=int, default=0, help="the draws' seed (default: 0); the same seed, the same files")
    ap.add_argument(
        "--copies",
        type=int,
        default=1,
        help="times each exercise is written, each copy of a file in another order (its weight in a training "
        "mix; default: 1)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        if args.count < 1:
            raise UserError(f"--count {args.count}: must be >= 1")
        if args.copies < 1:
            raise UserError(f"--copies {args.copies}: must be >= 1")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out}: exists and is not an empty directory (nothing written)")
        exercises, dropped = generate(args.count, args.seed, progress=True)
        out.mkdir(parents=True, exist_ok=True)
        files = write(exercises, out, args.copies, args.seed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 1
    why = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in dropped.items())
    times = f", each written {args.copies} times" if args.copies > 1 else ""
    print(f"{out}: {len(exercises)} exercises in {files} files{times} (drawn and dropped: {why})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
