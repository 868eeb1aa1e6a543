"""`dsv4 serve --tensor-parallel-size 2 --device cpu`: the engine on two real worker processes (gloo), the
routed experts split between them, one scheduler. Driven by the real `openai` client: in deterministic
mode its answers are those of the one-process server, token for token (greedy and seeded, across prompt
chunks and compression groups); a worker that dies takes the server down with one line, not a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subproc import checkout_env

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "tiny", "--device", "cpu", "--deterministic", "--max-num-seqs", "4", "--max-model-len", "512",
        "--max-batch-tokens", "192"]


def start(*extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dsv4", "serve", "--port", "0", *ARGS, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"ready: (http://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    pytest.fail("the server did not start:\n" + "".join(lines))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def answers(url: str) -> list:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    prompt = "the quick brown fox jumps over the lazy dog " * 4                     # 176 byte tokens: 3 chunks
    out = []
    for kw in (dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.0, seed=3, n=2)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=1, **kw)
        out.append([(c.text, c.logprobs.token_logprobs) for c in r.choices])
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
    out.append(chat.choices[0].message.content)
    return out


def test_two_workers_answer_as_one_process():
    one, url_one = start()
    try:
        want = answers(url_one)
    finally:
        stop(one)
    two, url_two = start("--tensor-parallel-size", "2", "--enable-expert-parallel")
    try:
        got = answers(url_two)
    finally:
        stop(two)
    assert got == want


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_a_dead_worker_stops_the_server_with_one_line():
    proc, url = start("--tensor-parallel-size", "2", "--worker-timeout", "20")
    try:
        engine = _children(proc.pid)                    # the server's engine process (rank 0) ...
        workers = [c for e in engine for c in _children(e)
                   if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]   # (not a resource tracker)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)             # ... and its worker 1
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.APIError):
            client.completions.create(model="tiny", prompt="hello", max_tokens=8)
        proc.wait(60)                                   # not a hang
        rest = proc.stdout.read()
        assert proc.returncode != 0
        assert re.search(r"worker 1 exited|engine process stopped", rest), rest[-2000:]
    finally:
        stop(proc)


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4", *argv], cwd=ROOT, env=checkout_env(OMP_NUM_THREADS="1"),
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_and_chat_on_two_workers_give_one_process_tokens():
    """`dsv4 generate` and `dsv4 chat` with --tensor-parallel-size 2 (gloo): in --deterministic mode the
    tokens are those of one process (the expert-parallel sums are exact there), and the command returns
    with its workers gone."""
    gen = ["generate", "--preset", "tiny", "--device", "cpu", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8",
           "--deterministic", "--json"]
    one, two = _run(*gen), _run(*gen, "--tensor-parallel-size", "2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert json.loads(two.stdout.splitlines()[-1])["ids"] == json.loads(one.stdout.splitlines()[-1])["ids"]
    chat = ["chat", "--preset", "tiny", "--device", "cpu", "--max-new-tokens", "6", "--temperature", "0",
            "--deterministic"]
    one, two = _run(*chat, stdin="hello\n"), _run(*chat, "--tensor-parallel-size", "2", stdin="hello\n")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout and two.stdout.strip()
