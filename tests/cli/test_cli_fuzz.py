"""Argument fuzzing of every `dsv4` command: any invalid value is one line on stderr and exit 2, before
anything is loaded; no traceback without --debug. I/O failures are one line naming the path and the cause.

The table of invalid values is generated from the parser itself: every flag of every subcommand is found
by walking the argparse tree, and each range-checked type (dsv4/argtypes.py) declares its bounds, from
which the values just outside them (and NaN, infinities, garbage) are derived. A flag added with a plain
`type=int` or `type=float` fails `test_every_numeric_flag_is_range_checked`.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from subproc import checkout_env

from dsv4 import argtypes
from dsv4.checkpoint import read_config_file
from dsv4.cli import build_parser, main
from dsv4.errors import describe_error

ROOT = Path(__file__).resolve().parents[2]

# what a command needs besides the flag under test for argparse to get that far (required positionals)
REQUIRED = {("convert",): ["src", "dst", "--to", "hf"]}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its parser) for every leaf command of the tree."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and path:
        yield path, parser
    for a in subs:
        for name, sp in a.choices.items():
            yield from _commands(sp, path + (name,))


def _invalid_values(kind) -> list[str]:
    """Values a flag of this type must refuse."""
    bounds = getattr(kind, "bounds", None)
    if kind is argtypes.text:
        return ["\udcff\udcfe", "ok\udc80"]  # undecodable argv bytes (surrogateescape)
    if kind is argtypes.path:
        return ["", "a\0b"]
    if kind is argtypes.preset:
        return ["huge", "TINY", ""]
    if kind in (argtypes.device, argtypes.device_or_auto):
        bad = ["gpu0", "", "cuda:-1", "meta"]
        if not torch.cuda.is_available():
            bad += ["cuda", "cuda:0"]
        else:
            bad.append(f"cuda:{torch.cuda.device_count()}")
        return bad
    if getattr(kind, "__name__", "") == "integers":
        return ["1,x", "", "1.5", "-3"]
    if getattr(kind, "__name__", "") == "_shape":
        return ["4096", "0x5", "ax4", "-1x3"]
    if bounds is not None and len(bounds) == 2:  # argtypes.int_in
        lo, hi = bounds
        bad = ["nan", "1.5", "", "x", "1e3", "0x10"]
        if lo is not None:
            bad.append(str(lo - 1))
        if hi is not None:
            bad.append(str(hi + 1))
        return bad
    if bounds is not None:  # argtypes.float_in
        lo, hi, lo_open, hi_open = bounds
        bad = ["nan", "NaN", "inf", "-inf", "1e999", "x", ""]
        if lo is not None:
            bad.append(repr(lo - 1.0))
            if lo_open:
                bad.append(repr(float(lo)))
        if hi is not None:
            bad.append(repr(hi + 1.0))
            if hi_open:
                bad.append(repr(float(hi)))
        return bad
    return []


def _table():
    rows = []
    for path, parser in _commands(build_parser()):
        for action in parser._actions:
            if action.type is None and not action.choices:
                continue
            if not action.option_strings:  # positionals: the prompt text
                if action.type is argtypes.text:
                    rows += [(path, None, v) for v in _invalid_values(action.type)]
                continue
            flag = max(action.option_strings, key=len)
            values = _invalid_values(action.type) if action.type is not None else []
            if action.choices and not isinstance(action.choices, dict):
                values = values + ["no-such-choice"]
            rows += [(path, flag, v) for v in values]
    return rows


TABLE = _table()


def test_the_table_covers_every_command():
    """The walk finds every command of `dsv4 --help` and generates cases for each that takes values."""
    found = {p for p, _, _ in TABLE}
    for cmd in [
        ("generate",),
        ("chat",),
        ("serve",),
        ("train",),
        ("convert",),
        ("inspect",),
        ("info",),
        ("check", "teacher-forcing"),
        ("check", "compare"),
        ("check", "conformance"),
        ("bench", "serve"),
        ("bench", "kernels"),
        ("bench", "w8a8"),
    ]:
        assert cmd in found, cmd
    assert len(TABLE) > 400


def test_every_numeric_flag_is_range_checked():
    """No flag parses a number with plain int/float (which accept NaN, inf, negatives, zero)."""
    plain = [
        (" ".join(path), a.option_strings)
        for path, parser in _commands(build_parser())
        for a in parser._actions
        if a.type in (int, float)
    ]
    assert plain == []


@pytest.mark.parametrize("path,flag,value", TABLE, ids=[f"{' '.join(p)} {f} {v!r}" for p, f, v in TABLE])
def test_invalid_argument_is_one_line_exit_2(path, flag, value, capsys):
    argv = [*path, *REQUIRED.get(path, [])] + ([flag, value] if flag else [value])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    if flag:
        assert f"argument {flag}" in lines[0] or any(s in lines[0] for s in flag.split("/")), lines[0]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--top-p", "nan"], "--top-p"),
        (["train", "--steps", "0"], "--steps"),
        (["serve", "--port", "70000"], "--port"),
        (["generate", b"caf\xe9".decode("utf-8", "surrogateescape")], "UTF-8"),
    ],
)
def test_real_process_prints_no_traceback(argv, needle):
    """The same through a real `python -m dsv4` process: exit 2, one line, no traceback."""
    env = checkout_env()
    res = subprocess.run(
        [sys.executable, "-m", "dsv4", *[os.fsencode(a) for a in argv]],
        capture_output=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    err = res.stderr.decode("utf-8", "replace").strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_debug_shows_the_traceback():
    env = checkout_env()
    res = subprocess.run(
        [sys.executable, "-m", "dsv4", "generate", "--prompt-file", "/nonexistent/prompt.txt", "--debug"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode != 0 and "Traceback" in res.stderr and "prompt.txt" in res.stderr


# ------------------------------------------------------------------------------------------ limits
def test_prompt_longer_than_the_context_is_refused_with_the_numbers(capsys):
    from dsv4.config import ModelConfig

    ctx = ModelConfig.preset("tiny").max_seq_len
    ids = ",".join(["5"] * (ctx + 10))
    assert main(["generate", "--preset", "tiny", "--prompt-ids", ids, "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"has {ctx + 10} tokens" in err and f"is {ctx} tokens" in err and f"at most {ctx - 8} prompt" in err
    assert "max_position_embeddings" in err and "--truncate-prompt" in err
    # a configured limit below the model's context: its numbers
    assert (
        main(
            [
                "generate",
                "--preset",
                "tiny",
                "--prompt-ids",
                "0,5,5,5,5,5,5,5,5,5",
                "--max-model-len",
                "12",
                "--max-new-tokens",
                "4",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "has 10 tokens" in err and "--max-model-len is 12 tokens" in err and "at most 8 prompt" in err
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "0,5", "--max-model-len", str(ctx + 1)]) == 2
    assert f"exceeds the model's context (max_position_embeddings) of {ctx}" in capsys.readouterr().err
    assert main(["check", "teacher-forcing", "--preset", "tiny", "--seq-len", str(ctx + 1)]) == 2
    assert (
        f"--seq-len {ctx + 1} exceeds the model's context (max_position_embeddings) of {ctx}" in capsys.readouterr().err
    )


def test_truncate_prompt_keeps_bos_and_the_last_tokens(capsys):
    import json

    prompt = [0] + list(range(10, 30))  # BOS (tiny's is 0) + 20 tokens
    argv = [
        "generate",
        "--preset",
        "tiny",
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-model-len",
        "12",
        "--max-new-tokens",
        "4",
        "--truncate-prompt",
        "--json",
        "--no-stop",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["prompt_ids"] == [0] + list(range(23, 30))  # 8 = 12 - 4 tokens: BOS + the last 7
    assert len(res["ids"]) == 4 and "cut to its last 8 of 21 tokens" in err


def test_prompt_file_must_be_utf8(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"print('caf\xe9')\n")
    assert main(["generate", "--preset", "tiny", "--prompt-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompt-file") and "not UTF-8" in err and len(err.splitlines()) == 1
    assert main(["generate", "--preset", "tiny", "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "file not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ I/O failures
def test_io_failures_name_the_path_and_the_cause(tmp_path, capsys):
    """A run directory that cannot be created: under a regular file, at a dangling symlink, in /sys."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "run")
    cases = [(blocker / "run", "not a directory"), (dangling, "symlink pointing nowhere")]
    if Path("/sys/kernel").is_dir():
        cases.append((Path("/sys/kernel/dsv4-run"), "not permitted"))
    for out, cause in cases:
        assert main(["train", "--preset", "tiny", "--steps", "1", "--out", str(out), "--no-progress"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and cause in err and str(out.name) in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "nowhere").exists() and blocker.read_text() == "not a directory"


def test_disk_full_is_named():
    """A real ENOSPC (writing to /dev/full: write() errors carry no file name) is described as a full disk,
    with the destination and what was kept, when the write happens under `writing`."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    from dsv4.train.metrics import JsonlLog

    log = JsonlLog("/dev/full", append=True)
    with pytest.raises(OSError) as info:
        log.write({"step": 1, "loss": 2.0})
    assert info.value.errno == errno.ENOSPC
    code, line = describe_error(info.value)
    assert code == 1 and "disk is full" in line and "/dev/full" in line and "earlier steps are kept" in line


def test_unexpected_errors_are_one_line_with_a_debug_hint():
    code, line = describe_error(ZeroDivisionError("division by zero\nsecond line"))
    assert code == 1 and line.count("\n") == 0 and "--debug" in line


def test_a_prompt_longer_than_the_window_pool_is_computed_in_chunks():
    """The engine admits a prompt whose window pages would not all fit at once: it computes it in chunks
    and releases the window pages behind it, with the same greedy tokens as one whole-prompt pass."""
    from dsv4.config import ModelConfig
    from dsv4.engine import EngineConfig, generate
    from dsv4.model import DeepSeekV4
    from dsv4.model.paged import default_page_size

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32).eval()
    P = default_page_size(cfg)
    n = 12 * P + 5  # 13 window pages; the pool holds 6
    prompt = [cfg.bos_token_id] + [(7 * i) % cfg.vocab_size for i in range(1, n)]
    kw = dict(max_new_tokens=3, deterministic=True)
    chunked = generate(
        model,
        [prompt],
        engine_config=EngineConfig(
            max_seqs=1,
            max_model_len=n + 3,
            max_batch_tokens=64,
            prefix_caching=False,
            deterministic=True,
            cuda_graphs=False,
        ),
        **kw,
    )
    whole = generate(
        model,
        [prompt],
        engine_config=EngineConfig(
            max_seqs=1,
            max_model_len=n + 3,
            max_batch_tokens=n + 3,
            prefix_caching=False,
            deterministic=True,
            cuda_graphs=False,
        ),
        **kw,
    )
    assert len(chunked[0]) == 3 and chunked == whole


def test_chat_refuses_a_message_past_the_context_or_not_utf8_and_goes_on():
    env = checkout_env(OMP_NUM_THREADS="1")
    stdin = b"word " * 400 + b"\ncaf\xe9 \xff\nhello\n"  # too long, not UTF-8, fine
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4",
            "chat",
            "--max-model-len",
            "128",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ],
        input=stdin,
        capture_output=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    res.stdout, res.stderr = res.stdout.decode(), res.stderr.decode()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 2 and "Traceback" not in res.stderr, res.stderr
    assert "not valid UTF-8" in errors[1]
    from dsv4.loading import default_model_dir

    ctx = read_config_file(default_model_dir() / "config.json").max_seq_len
    assert "the context is 128 tokens" in errors[0] and f"max_position_embeddings is {ctx}" in errors[0]
    assert "raise --max-model-len" in errors[0]  # (128 < the model's context: raising it would help)
    assert re.search(r"the conversation is \d{3,} tokens", errors[0])
    assert res.stdout.strip() != ""  # the second message was answered


# ------------------------------------------------------------------------------------------ hostile files
def _hostile(tmp_path: Path, kind: str) -> Path:
    """A path where a file is expected: a FIFO, a device, symlinks to either, a symlink loop, a dangling
    symlink, a directory, a file over the size limit (a sparse one: no disk used)."""
    p = tmp_path / f"{kind}.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "device":
        os.symlink("/dev/zero", p)
    elif kind == "link to fifo":
        os.mkfifo(tmp_path / "f")
        os.symlink(tmp_path / "f", p)
    elif kind == "loop":
        os.symlink(p, p)
    elif kind == "dangling":
        os.symlink(tmp_path / "nowhere", p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(2**30)
    return p


HOSTILE = ["fifo", "device", "link to fifo", "loop", "dangling", "directory", "huge"]
# every flag that names a file the command reads, with what else the command needs to get to reading it
READS = [
    (["generate", "--preset", "tiny", "--prompt-file"], []),
    (["generate", "--config"], ["hi"]),
    (["info", "--config"], []),
    (["train", "--config"], ["--no-progress"]),
    (["train", "--train-config"], ["--no-progress"]),
]


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("argv,rest", READS, ids=[" ".join(a) for a, _ in READS])
def test_a_hostile_file_is_one_line_at_once(argv, rest, kind, tmp_path, capsys):
    """No read blocks (FIFO), none runs until memory is gone (/dev/zero, a 1 GiB file): one line, exit 2."""
    from test_checkpoint_fuzz import time_bound

    path = _hostile(tmp_path, kind)
    extra = ["--out", str(tmp_path / "run")] if argv[0] == "train" else []
    t0 = time.monotonic()
    with time_bound(30):
        code = main([*argv, str(path), *rest, *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err and time.monotonic() - t0 < 30
    if kind == "huge" and argv[-1] in ("--prompt-file", "--config", "--train-config"):
        assert "larger than" in lines[0], lines[0]


def test_parser_refuses_values_the_model_would_fail_on(capsys):
    """Refused while parsing, before a model loads: exit 2 naming the flag."""
    for argv, flag in [
        (["generate", "--temperature", "1e300", "hi"], "--temperature"),
        (["generate", "--temperature", "2.5", "hi"], "--temperature"),
        (["generate", "--device", "meta", "hi"], "--device"),
        (["generate", "--top-k", str(2**63), "hi"], "--top-k"),
        (["convert", "src", "dst", "--to", "hf", "--shard-gb", "1e300"], "--shard-gb"),
    ]:
        t0 = time.monotonic()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"argument {flag}" in err, err
        assert time.monotonic() - t0 < 5
    # a top-k past the model's vocabulary: refused once the config is read, before the weights
    assert main(["generate", "--preset", "tiny", "--top-k", "5000", "hi"]) == 2
    assert "exceeds the model's vocabulary of 1024" in capsys.readouterr().err


def test_ctrl_c_while_starting_is_one_line_exit_130():
    """SIGINT at several moments of start-up (while torch and the model load): exit 130, one line."""
    import signal

    interrupted = 0
    for delay in (0.3, 1.0, 2.0):
        p = subprocess.Popen(
            [sys.executable, "-m", "dsv4", "generate", "--preset", "tiny", "hi"],
            cwd=ROOT,
            env=checkout_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        if p.returncode in (0, -signal.SIGINT) and not err:
            continue  # done before the signal, or signalled before Python ran: silent
        assert p.returncode == 130 and err.strip() == "interrupted", (delay, p.returncode, err[-2000:])
        interrupted += 1
    assert interrupted >= 1


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX signal masks")
def test_a_ctrl_c_while_torch_starts_waits_for_its_import(tmp_path):
    """A KeyboardInterrupt raised inside torch's start-up (Python code its C++ calls) aborts the process; with
    the CLI's interrupt watch, a Ctrl-C that comes during `import torch` arrives when the import returns.
    A stand-in torch package signals itself half-way through its start-up and records whether it finished."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import builtins, os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)  # (a Ctrl-C let through ends this sleep with KeyboardInterrupt)\n"
        "builtins.stand_in_finished = True\n"
    )
    script = (
        "import builtins\n"
        "from dsv4.errors import interrupted, watch_interrupts\n"
        "{watch}\n"
        "try:\n"
        "    import torch\n"
        "    print('no interrupt')\n"
        "except KeyboardInterrupt:\n"
        "    print('finished' if getattr(builtins, 'stand_in_finished', False) else 'cut', interrupted())\n"
    )
    env = checkout_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    got = {}
    for watch in ("watch_interrupts()", "pass"):
        run = subprocess.run(
            [sys.executable, "-c", script.format(watch=watch)], env=env, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr[-2000:]
        got[watch] = run.stdout.split()
    assert got["watch_interrupts()"] == ["finished", "True"]  # held until the import returned
    assert got["pass"] == ["cut", "False"]  # (the stand-in does signal inside its start-up)


def test_non_finite_logits_stop_generate_naming_the_first_module(tmp_path, capsys):
    """A finite but huge weight (3.39e38, a BF16 value) passes the load checks; the logits it leads to are
    Inf/NaN: generate says so (exit 1) and names the first module that produced one, instead of printing
    what argmax(NaN) = token 0 gives."""
    from dsv4.checkpoint.writer import model_values, save
    from dsv4.config import ModelConfig
    from dsv4.model import DeepSeekV4

    cfg = ModelConfig.preset("tiny")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        dict(model.named_parameters())["layers.1.attn.wq_a.weight"].view(-1)[0] = 3.39e38
    save(model_values(model), cfg, tmp_path / "m", target="bf16")
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", "0,5,6", "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-finite" in err and "layers.1.attn.wq_a" in err, err
