"""Every command README.md shows, run as written.

The commands are read from README.md's code blocks: each line of a ```bash block, each `$ ` line (with the
output printed below it) and each `dsv4 ...` line of a plain block, and each ```python block. Per command:

- runnable here: run exactly as written with bash (cwd: a fresh directory; this checkout first on PYTHONPATH,
  so `dsv4` and `python3 -m dsv4` are this checkout's); it must exit 0 (the example that README shows exiting
  1, a planted bug, must exit 1), and every line of an output README prints below it must appear in the
  output, in order ("..." lines stand for lines left out);
- `bash scripts/setup.sh ... && CMD`: `.ci/run` runs the setup itself first, so CMD is run;
  `python3 -m pytest ...` is `.ci/run`'s own command;
- a template (placeholders such as DIR, EPS or `[--flag]`): its subcommand and every flag it names must exist;
- a command README marks "(needs a GPU ...)" or "(needs the Hugging Face Hub ...)": skipped with that reason,
  never run here (the Hub is not reachable from the test machines); a `dsv4 ...` one is checked as a template;
- a python block that uses names it does not define (a sketch): its imports are run;
- `dsv4 serve ...` runs until stopped: it is started in the background, and the commands after it that talk
  to its address (127.0.0.1:8000) run against it, in order, before it is stopped.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PLACEHOLDERS = re.compile(r"\b(DIR|DIR_A|DIR_B|SRC|DST|EPS|ZID|N)\b|\[|\{|mypkg\.")
GPU_MARK = "(needs a GPU"
HUB_MARK = "(needs the Hugging Face Hub"
TIMEOUT_S = 600


@dataclass
class Command:
    line: str  # as README writes it (comment removed)
    comment: str = ""
    output: list[str] = field(default_factory=list)
    python: bool = False
    clients: list[Command] = field(default_factory=list)  # commands run against this server

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.,=-]+", "_", self.line)[:90]


def _split_comment(line: str) -> tuple[str, str]:
    """'cmd   # note' -> ('cmd', 'note'); a '#' inside quotes is part of the command."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def readme_commands() -> list[Command]:
    cmds: list[Command] = []
    lang, block = None, []
    for raw in README.read_text().splitlines():
        if raw.startswith("```"):
            if lang is None:
                lang, block = raw[3:].strip() or "text", []
                continue
            cmds += _block_commands(lang, block)
            lang = None
            continue
        if lang is not None:
            block.append(raw)
    return cmds


def _block_commands(lang: str, lines: list[str]) -> list[Command]:
    if lang == "python":
        return [Command("\n".join(lines), python=True)]
    out: list[Command] = []
    for line in lines:
        if lang == "bash" and line.strip():
            out.append(Command(*_split_comment(line)))
        elif line.startswith("$ "):
            out.append(Command(line[2:].strip()))
        elif line.startswith("dsv4 "):
            out.append(Command(*_split_comment(line)))
        elif out and out[-1].line and lang != "bash" and not out[-1].comment and line.strip():
            out[-1].output.append(line)
    return out


SERVER_ADDRESS = "127.0.0.1:8000"


def _needs(cmd: Command) -> str | None:
    """What a command README marks as needed and this machine lacks (a GPU, the Hub), else None."""
    return next((m for m in (GPU_MARK, HUB_MARK) if m in cmd.comment), None)


def _attach_clients(cmds: list[Command]) -> list[Command]:
    """Commands that talk to a `dsv4 serve` started earlier become that server's clients."""
    out: list[Command] = []
    server: Command | None = None
    for c in cmds:
        if _needs(c):
            pass
        elif not c.python and c.line.startswith("dsv4 serve") and not PLACEHOLDERS.search(c.line):
            server = c
        elif server is not None and SERVER_ADDRESS in c.line:
            server.clients.append(c)
            continue
        out.append(c)
    return out


COMMANDS = _attach_clients(readme_commands())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TRITON_INTERPRET", None)  # a command that needs it says so itself
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU commands mean the CPU, also on a GPU machine
    return env


def _dsv4_script_env(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """`dsv4` on PATH runs this checkout's CLI (an installed entry point may belong to another checkout)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "dsv4"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dsv4 "$@"\n')
    script.chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


_MEASURED = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:e[-+]?\d+)?")


def _line_pattern(want: str) -> re.Pattern:
    """A shown line as a pattern: '...' elides anything; a decimal number (a measured value: an error, a
    time, a cosine) stands for any number, since its digits depend on the machine and torch; integers
    (counts, ids, sizes) must match."""
    parts = []
    for piece in want.split("..."):
        out, pos = [], 0
        for m in _MEASURED.finditer(piece):
            if "." in m.group() or "e" in m.group():
                out.append(re.escape(piece[pos : m.start()]) + _MEASURED.pattern)
                pos = m.end()
        out.append(re.escape(piece[pos:]))
        parts.append("".join(out))
    return re.compile(".*".join(parts) + "$")


def _shown_output_in_order(shown: list[str], printed: str) -> str | None:
    """None when every shown line (whitespace-normalized, '...' skipped, measured decimals free) appears in
    order, else the first one that does not."""
    got = [" ".join(x.split()) for x in printed.splitlines()]
    i = 0
    for line in shown:
        want = " ".join(line.split())
        if want in ("...", "[exit 1]") or not want:
            continue
        pattern = _line_pattern(want)
        while i < len(got) and not pattern.match(got[i]):
            i += 1
        if i == len(got):
            return line
        i += 1
    return None


def _free_names(code: str) -> set[str]:
    """Names a python block reads but never binds (and that are not builtins): non-empty for a sketch such
    as `for piece in generated_text_pieces: ...`, whose imports are then all that can run."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def _template_check(line: str) -> None:
    """The subcommand and every --flag a template names exist in the CLI's parser."""
    from dsv4.cli import build_parser

    words = [w for w in shlex.split(line.replace("[", " ").replace("]", " ").replace("{", " ").replace("}", " "))]
    assert words[0] == "dsv4", line
    parser = build_parser()
    sub = parser
    for w in words[1:]:
        if w.startswith("-"):
            break
        actions = [a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not actions or w not in actions[0].choices:
            break
        sub = actions[0].choices[w]
    flags = {opt for a in sub._actions for opt in a.option_strings}
    for w in words:
        if w.startswith("--"):
            assert w.split("=")[0] in flags, f"{line}: {sub.prog} has no {w}"


def _run_python(cmd: Command, env: dict, cwd: Path) -> None:
    code = cmd.line
    free = _free_names(code)
    if free:  # a sketch: it uses names it leaves to the reader
        imports = [n for n in ast.parse(code).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        code = "\n".join(ast.unparse(n) for n in imports)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0, run.stderr[-3000:]


def _run_server(cmd: Command, env: dict, cwd: Path) -> None:
    """Start the server command, wait until it is ready, run its clients, stop it."""
    server = subprocess.Popen(
        ["bash", "-c", f"exec {cmd.line}"],
        cwd=cwd,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "ready: " in line:
                break
        assert any("ready: " in x for x in lines), "".join(lines)
        assert cmd.clients, f"{cmd.line}: README shows no command that uses it"
        for client in cmd.clients:
            if client.python:
                _run_python(client, env, cwd)
                continue
            run = subprocess.run(
                ["bash", "-c", client.line], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            )
            assert run.returncode == 0, f"{client.line}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
            missing = _shown_output_in_order(client.output, run.stdout)
            assert missing is None, f"README shows {missing!r}, the command printed:\n{run.stdout}"
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_readme_command(cmd: Command, tmp_path):
    if _needs(cmd):
        if cmd.line.startswith("dsv4 "):
            _template_check(cmd.line)  # not run here, but its subcommand and flags must exist
        pytest.skip(f"README marks what it needs: {cmd.comment}")
    env = _dsv4_script_env(_env(), tmp_path)
    if cmd.clients or (not cmd.python and cmd.line.startswith("dsv4 serve") and not PLACEHOLDERS.search(cmd.line)):
        _run_server(cmd, env, tmp_path)
        return
    if cmd.python:
        _run_python(cmd, env, tmp_path)
        return
    line = cmd.line
    setup = re.match(r"bash scripts/setup\.sh( --test)? && (.*)", line)
    if setup:
        line = setup.group(2)  # .ci/run ran the setup already
    if line.strip().startswith("python3 -m pytest"):
        pytest.skip("this is .ci/run's own test command")
    if PLACEHOLDERS.search(line):
        _template_check(line)
        return
    if line.startswith("TRITON_INTERPRET=1 "):
        from dsv4.ops.triton._common import interpreter_defect

        if interpreter_defect():
            pytest.skip(f"README's interpreter command, and {interpreter_defect()}")
    run = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    want_rc = 1 if "[exit 1]" in cmd.output or "exits 1" in cmd.comment else 0
    assert run.returncode == want_rc, f"{line}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}"
    missing = _shown_output_in_order(cmd.output, run.stdout)
    assert missing is None, f"README shows {missing!r}, the command printed:\n{run.stdout}"


def test_readme_commands_are_found():
    lines = [c.line for c in COMMANDS]
    serve = [c for c in COMMANDS if c.line.startswith("dsv4 serve") and not _needs(c)]
    assert serve and serve[0].clients and any(c.python for c in serve[0].clients)
    assert any(x.startswith("torchrun --nproc-per-node 2 -m dsv4.train.cli train") for x in lines)
    assert sum(c.python for c in COMMANDS) >= 2 and sum(bool(c.output) for c in COMMANDS) >= 3
