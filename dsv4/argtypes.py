"""Argument types of the command line: each one parses a value and checks its range while argparse reads
the command line, so a bad argument is refused (one line, exit 2) before any model is loaded or any
file is written.

Every numeric flag of every `dsv4` command takes one of these as `type=`; the message names the range and
the value given. NaN and infinities are refused wherever a finite number is meant.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .sampling_limits import RANGES


def _interval(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"{'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
    return "finite"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def int_in(lo: int | None = None, hi: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An integer in [lo, hi] (either bound may be None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {_interval(lo, hi)}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {what} {_interval(lo, hi)}, got {value}")
        return value

    parse.__name__ = "integer"
    parse.bounds = (lo, hi)  # read by the argument fuzzer of the test suite
    return parse


def float_in(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """A finite float in the interval (open or closed at each end; either bound may be None)."""
    where = _interval(lo, hi, lo_open, hi_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {where}, got {text!r}") from None
        ok = math.isfinite(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number {where}, got {text}")
        return value

    parse.__name__ = "number"
    parse.bounds = (lo, hi, lo_open, hi_open)
    return parse


positive_int = int_in(1)  # counts: tokens, steps, batch sizes, clients
nonneg_int = int_in(0)  # counts where 0 means "off" or "default"
MAX_THREADS = 1024  # (OpenMP fails to start thousands of threads: a crash, not an error, past a few thousand)
thread_count = int_in(0, MAX_THREADS, "a thread count")  # --threads: 0 = the cores this process may use
seed_int = int_in(0, 2**63 - 1, "an integer seed")
port = int_in(0, 65535, "a port")
# sampling settings: the ranges of dsv4.sampling_limits, which the HTTP API checks too
temperature = float_in(RANGES["temperature"].lo, RANGES["temperature"].hi)  # 0 = greedy
top_p = float_in(RANGES["top_p"].lo, RANGES["top_p"].hi, lo_open=True)  # 1 = off
top_k = int_in(0, 2**31 - 1)  # 0 = off; the model's vocabulary bounds it once its config is read
min_p = float_in(RANGES["min_p"].lo, RANGES["min_p"].hi)  # 0 = off
positive_float = float_in(0.0, lo_open=True)
nonneg_float = float_in(0.0)
percent = float_in(0.0, 100.0)


def text(value: str) -> str:
    """Text that can be encoded as UTF-8 (a command line's undecodable bytes arrive as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 (byte {e.start} of the argument)") from None
    return value


text.__name__ = "text"


def path(value: str) -> str:
    """A file-system path: non-empty, without NUL bytes (the OS would refuse it later with a traceback)."""
    if not value or "\0" in value:
        raise argparse.ArgumentTypeError(f"is not a usable path: {value!r}")
    return value


path.__name__ = "path"


def preset(value: str) -> str:
    """The name of a built-in architecture (dsv4.config.PRESETS)."""
    from .config import PRESETS

    if value not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {value!r}; choose one of {', '.join(PRESETS)}")
    return value


preset.__name__ = "preset"


def device(value: str) -> str:
    """A torch device this process can use: `cuda` on a torch without CUDA or a machine without a GPU is
    refused here, not after the model has been built."""
    from . import defaults
    from .errors import UserError

    if value.strip().lower().startswith("meta"):
        raise argparse.ArgumentTypeError(
            "the meta device holds shapes, not values: nothing can run on it (use cpu, cuda, ...)"
        )
    try:
        defaults.resolve_device(value)
    except UserError as e:
        why = str(e).removeprefix(f"--device {value}: ")
        if why.startswith("not a device name"):
            why = "not a device name (e.g. cpu, cuda, cuda:1, mps)"
        raise argparse.ArgumentTypeError(why) from None
    return value


device.__name__ = "device"


def device_or_auto(value: str) -> str:
    """`auto` (a GPU when there is one) or a device name as `device` takes it."""
    return value if value == "auto" else device(value)


device_or_auto.__name__ = "device"


def comma_ints(lo: int | None = None) -> Callable[[str], list[int]]:
    """Comma-separated integers (token ids), each >= lo."""

    def parse(value: str) -> list[int]:
        items = value.split(",")
        if len(items) > 1 and not items[-1].strip():
            items.pop()  # (a trailing comma)
        if any(not x.strip() for x in items) and len(items) > 1:  # "1,,2": an id left out, not a separator
            raise argparse.ArgumentTypeError(f"has an empty item in {value!r} (comma-separated integers, e.g. 0,15,27)")
        items = [x for x in items if x.strip()]
        try:
            ids = [int(x, 10) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError("takes comma-separated integers, e.g. 0,15,27") from None
        if not ids:
            raise argparse.ArgumentTypeError("needs at least one integer")
        if lo is not None and any(i < lo for i in ids):
            raise argparse.ArgumentTypeError(f"takes integers >= {lo}")
        return ids

    parse.__name__ = "integers"
    return parse
