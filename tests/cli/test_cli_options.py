"""One command-line language: every subcommand's parser is walked, and each option must have help that shows
its default, every shared name (dsv4/options.py) must come from the one table, and an old or foreign
spelling of a shared option (--checkpoint, --init-from, --max-tokens, --tokens, ...) may only appear as a
declared one-release alias that prints a note. Also: `dsv4 --help` loads no torch, fresh seeds, and
progress bars only on a terminal."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from subproc import checkout_env

from dsv4 import options
from dsv4.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]

# other names users would reach for, for a shared option: present only as declared aliases
TWINS = {
    "--checkpoint": "--model",
    "--init-from": "--model",
    "--model-dir": "--model",
    "--model-config": "--config",
    "--max-tokens": "--max-new-tokens",
    "--tokens": "--seq-len",
    "--seq": "--seq-len",
    "--sequence-length": "--seq-len",
    "--num-threads": "--threads",
    "--random-seed": "--seed",
    "--no-graph": "--cuda-graph",
}
# a name of TWINS with a meaning of its own in one command (said here, with why)
OWN_MEANING = {(("bench", "w8a8"), "--tokens"): "rows of the timed GEMMs, not a sequence length"}


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and path:
        yield path, parser
    for a in subs:
        for name, sp in a.choices.items():
            yield from _leaves(sp, path + (name,))


LEAVES = list(_leaves(build_parser()))


def test_the_walk_finds_every_command():
    names = {" ".join(p) for p, _ in LEAVES}
    for cmd in (
        "info",
        "generate",
        "chat",
        "serve",
        "train",
        "convert",
        "inspect",
        "check teacher-forcing",
        "check compare",
        "check conformance",
        "eval heldout",
        "eval completions",
        "eval chat",
        "bench serve",
    ):
        assert cmd in names, cmd


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_option_has_help_with_its_default(path, parser):
    fmt = options.HelpFormatter(prog="dsv4")
    missing, no_default = [], []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        name = "/".join(a.option_strings) or a.dest
        if not (a.help or "").strip():
            missing.append(name)
            continue
        if a.option_strings and not re.search(r"default|none = ", fmt._get_help_string(a), re.I):
            no_default.append(name)
    assert missing == [] and no_default == [], (missing, no_default)


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_shared_options_come_from_the_table_and_twins_are_aliases(path, parser):
    canonical = {o.flag: name for name, o in options.SHARED.items()}
    wrong = []
    for a in parser._actions:
        for flag in a.option_strings:
            if flag in canonical and getattr(a, "shared", None) != canonical[flag]:
                wrong.append(f"{flag}: defined outside dsv4/options.py")
            if flag in TWINS and (path, flag) not in OWN_MEANING:
                alias = type(a).__name__ == "Deprecating" and a.option_strings[0] != flag
                if not alias:
                    wrong.append(f"{flag}: a twin of {TWINS[flag]} that is not a declared alias")
    assert wrong == []


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_a_zero_that_the_help_gives_a_meaning_is_accepted(path, parser):
    """An option whose help says what 0 means ("0 = all", "(0 = off)") parses 0."""
    refused = []
    for a in parser._actions:
        if a.option_strings and callable(a.type) and re.search(r"\b0 = ", a.help or ""):
            try:
                a.type("0")
            except argparse.ArgumentTypeError as e:
                refused.append(f"{a.option_strings[0]}: {e}")
    assert refused == []


def test_one_help_line_per_command_matches_its_parser():
    """`dsv4 --help` lists one-line stubs (no command module imported); they say what the full parsers say."""
    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert set(helps) == set(COMMANDS) and all(helps[k] == COMMANDS[k] for k in COMMANDS), helps


def test_top_level_help_loads_no_torch_and_is_quick():
    """`dsv4 --help` imports none of the commands' modules: no torch. Timed in CPU seconds (user + system) of
    the child, which a loaded machine does not inflate: under 1 s."""
    code = (
        "import runpy, sys\nsys.argv = ['dsv4', '--help']\ntry:\n"
        "    runpy.run_module('dsv4', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=checkout_env(), cwd=ROOT, timeout=60
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert res.returncode == 0 and "usage: dsv4" in res.stdout and res.stdout.strip().endswith("NO-TORCH"), res
    assert cpu < 1.0, cpu


def test_old_spellings_work_with_a_one_line_note(capsys):
    assert main(["check", "teacher-forcing", "--preset", "tiny", "--tokens", "12", "--prefill", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"]
    assert err.strip() == "note: --tokens is deprecated: use --seq-len (the old spelling goes in the next release)"
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "0,5", "--max-tokens", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["ids"]) == 3 and "--max-tokens is deprecated: use --max-new-tokens" in err


def test_sampling_without_a_seed_draws_a_fresh_one_and_prints_it(capsys):
    runs = []
    for _ in range(2):
        assert (
            main(
                [
                    "generate",
                    "--preset",
                    "tiny",
                    "--prompt-ids",
                    "0,5,7",
                    "--max-new-tokens",
                    "8",
                    "--temperature",
                    "1.0",
                    "--json",
                    "--no-stop",
                ]
            )
            == 0
        )
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["seed"] != runs[1]["seed"]
    again = []
    for r in runs:  # the printed seed reproduces the text
        assert (
            main(
                [
                    "generate",
                    "--preset",
                    "tiny",
                    "--prompt-ids",
                    "0,5,7",
                    "--max-new-tokens",
                    "8",
                    "--temperature",
                    "1.0",
                    "--json",
                    "--no-stop",
                    "--seed",
                    str(r["seed"]),
                ]
            )
            == 0
        )
        again.append(json.loads(capsys.readouterr().out)["ids"])
    assert again == [r["ids"] for r in runs]
    assert main(["generate", "--preset", "tiny", "--json"]) == 2  # no prompt: an error, not a generation
    assert "generate needs a prompt" in capsys.readouterr().err


def _pty_run(argv: list[str], feed: list[tuple[str, bytes, float]] = (), timeout: float = 300) -> tuple[int, str]:
    """Run `python -m dsv4 ARGV` on a pseudo-terminal (stdin, stdout and stderr); `feed`: (text to wait for in
    what came since the last keys, seconds to wait more, keys to type then). -> (exit code, all it printed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.environ.update(checkout_env(OMP_NUM_THREADS="1", COLUMNS="100"))
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "dsv4", *argv])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal of 100 columns
    out, todo, mark, deadline = b"", list(feed), 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if todo and todo[0][0].encode() in out[mark:]:
            text, delay, keys = todo.pop(0)
            time.sleep(delay)
            os.write(fd, keys)
            mark = len(out)
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            out += data
    done, status = os.waitpid(pid, os.WNOHANG) if time.monotonic() >= deadline else (0, 0)
    if not done:
        if time.monotonic() >= deadline:  # the deadline passed with the child still running: end it, say so
            os.kill(pid, signal.SIGKILL)
            waited = todo[0][0] if todo else "the exit"
            out += f"\n[still running after {timeout:.0f} s: killed; it was waiting for {waited!r}]".encode()
        _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace")


@pytest.mark.slow
def test_progress_bar_on_a_terminal_only():
    argv = ["check", "teacher-forcing", "--preset", "tiny", "--seq-len", "60", "--prefill", "4"]
    code, out = _pty_run(argv)
    assert code == 0 and "teacher forcing: decode steps" in out and "agree" in out, out[-2000:]
    res = subprocess.run(
        [sys.executable, "-m", "dsv4", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=checkout_env(OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert res.returncode == 0 and res.stderr == "" and "\r" not in res.stdout and "agree" in res.stdout
    code, out = _pty_run([*argv, "--json"])
    assert code == 0 and "decode steps" not in out


def test_chat_ctrl_c_stops_a_reply_and_twice_at_the_prompt_leaves():
    """On a terminal: a long reply is stopped by Ctrl-C (back at the prompt, the chat goes on), /help and
    /reset answer, and two Ctrl-C at the prompt leave with exit 0."""
    feed = [
        ("you> ", 0, b"/help\r"),
        ("Ctrl-C ", 0, b"hello\r"),
        ("model> ", 3.0, b"\x03"),
        ("(reply stopped)", 0, b"/reset\r"),
        # (a pause before each Ctrl-C at the prompt: one that lands between the prompt's text and readline's
        # wait for a key is seen by Python only at the next key, a race of readline's, not of the chat)
        ("(conversation reset)", 0.5, b"\x03"),
        ("again", 0.5, b"\x03"),
    ]
    code, out = _pty_run(
        ["chat", "--preset", "tiny", "--max-new-tokens", "3000", "--max-model-len", "4096", "--temperature", "0"],
        feed,
        timeout=240,
    )
    assert "/reset" in out and "/exit, /quit" in out, out[-2000:]  # /help
    assert "(reply stopped)" in out and "(conversation reset)" in out, out[-2000:]
    assert "Ctrl-C again" in out and code == 0 and "Traceback" not in out, (code, out[-2000:])


# commands that take a model or a device but compute nothing with it (headers only)
NO_COMPUTE = {("inspect",): "reads safetensors headers only"}


@pytest.mark.parametrize("path,parser", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_command_that_computes_takes_threads(path, parser):
    flags = {f for a in parser._actions for f in a.option_strings}
    computes = (path[0] == "bench" or "--device" in flags or "--model" in flags) and path not in NO_COMPUTE
    assert not computes or "--threads" in flags, path
    if "--threads" in flags:  # bounded: OpenMP crashes (no message) starting thousands of threads
        (threads,) = [a for a in parser._actions if "--threads" in a.option_strings]
        assert threads.type("1024") == 1024
        with pytest.raises(argparse.ArgumentTypeError, match=r"\[0, 1024\]"):
            threads.type("5000")


def test_token_id_lists_refuse_an_empty_item_and_allow_a_trailing_comma():
    from dsv4.argtypes import comma_ints

    ids = comma_ints(0)
    assert ids("1,2") == ids("1, 2,") == [1, 2]
    for bad in ("1,,2", ",1", "", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            ids(bad)
