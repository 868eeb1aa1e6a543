"""`dsv4 serve --tensor-parallel-size 2 --device cpu`: the engine on two real worker processes (gloo), the
routed experts split between them, one scheduler. Driven by the real `openai` client: in deterministic
mode its answers are those of the one-process server, token for token (greedy and seeded, across prompt
chunks and compression groups); a worker that dies takes the server down with one line, not a hang.

Speculative decoding on two workers (MTP and DSpark drafts): its tokens are those of one process with the
same drafts, and for greedy requests those of plain decoding (speculation is lossless); the follower ran
every verify, draft and fixed-shape step that rank 0 ran (`dsv4.engine.mirror`).
"""

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
import torch
from spawn import launch
from subproc import checkout_env

pytestmark = pytest.mark.slow  # several processes, each with a model

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--preset",
    "tiny",
    "--device",
    "cpu",
    "--deterministic",
    "--max-num-seqs",
    "4",
    "--max-model-len",
    "512",
    "--max-batch-tokens",
    "192",
]


def start(*extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dsv4", "serve", "--port", "0", *ARGS, *extra]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=checkout_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
    prompt = "the quick brown fox jumps over the lazy dog " * 4  # 176 byte tokens: 3 chunks
    out = []
    for kw in (dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.0, seed=3, n=2)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=1, **kw)
        out.append([(c.text, c.logprobs.token_logprobs) for c in r.choices])
    chat = client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0, messages=[{"role": "user", "content": "hello"}]
    )
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
        engine = _children(proc.pid)  # the server's engine process (rank 0) ...
        workers = [
            c for e in engine for c in _children(e) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
        ]  # (not a resource tracker)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)  # ... and its worker 1
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.APIError):
            client.completions.create(model="tiny", prompt="hello", max_tokens=8)
        proc.wait(60)  # not a hang
        rest = proc.stdout.read()
        assert proc.returncode != 0
        assert re.search(r"worker 1 exited|engine process stopped", rest), rest[-2000:]
    finally:
        stop(proc)


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv4", *argv],
        cwd=ROOT,
        env=checkout_env(OMP_NUM_THREADS="1"),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_and_chat_on_two_workers_give_one_process_tokens():
    """`dsv4 generate` and `dsv4 chat` with --tensor-parallel-size 2 (gloo): in --deterministic mode the
    tokens are those of one process (the expert-parallel sums are exact there), and the command returns
    with its workers gone."""
    gen = [
        "generate",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-new-tokens",
        "8",
        "--deterministic",
        "--json",
    ]
    one, two = _run(*gen), _run(*gen, "--tensor-parallel-size", "2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert json.loads(two.stdout.splitlines()[-1])["ids"] == json.loads(one.stdout.splitlines()[-1])["ids"]
    chat = [
        "chat",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--deterministic",
    ]
    one, two = _run(*chat, stdin="hello\n"), _run(*chat, "--tensor-parallel-size", "2", stdin="hello\n")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout and two.stdout.strip()


def test_speculative_generate_on_two_workers_gives_one_process_tokens():
    """`dsv4 generate --speculative 2` on two workers: greedy tokens equal plain decoding's and one
    process's with speculation, seeded ones one process's with speculation. The 150-token prompt runs in
    chunks of 64, crosses the 128-token window and completes groups of 4 and of 128."""
    ids = ",".join(str((37 * i + 11) % 1000 + 2) for i in range(150))
    gen = [
        "generate",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--prompt-ids",
        ids,
        "--max-new-tokens",
        "12",
        "--deterministic",
        "--json",
        "--no-stop",
    ]

    def tokens(*extra: str) -> list[int]:
        r = _run(*gen, *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1])["ids"]

    two = ("--tensor-parallel-size", "2")
    plain = tokens()
    assert len(plain) == 12
    assert tokens("--speculative", "2", *two) == tokens("--speculative", "2") == plain
    seeded = ("--speculative", "3", "--temperature", "0.9", "--top-p", "0.9", "--seed", "5")
    assert tokens(*seeded, *two) == tokens(*seeded)


# ----------------------------------------------------------------------------- speculative, in-process engines
# check_config("tiny"): window 16, groups of 4 and 16, pages of 16; chunks of 16, so that prompts of 23 to 70
# tokens run in several chunks, and verifies cross pages, windows and groups
SPEC_CONFIG = dict(max_seqs=4, max_batch_tokens=48, chunk_len=16, page_size=16, deterministic=True)
SPEC_TIMEOUT_S = 600
LENGTHS = (70, 41, 57, 23)
NEW = 32


def _spec_case(draft: str) -> tuple[object, list[tuple[str, list[int], object, int]], dict]:
    """(model config, requests (name, prompt, settings, arrival step), speculative settings) of a case (the
    DSpark draft's confidence head picks verify lengths of at most 3 on the device): two greedy requests
    that outlast the others (their last steps are greedy alone: fixed-shape steps), a seeded one and one
    with penalties (penalized rows decode plainly, beside the verifies)."""
    from dsv4.check.inputs import check_config
    from dsv4.engine import SamplingParams

    cfg = check_config("tiny")
    cfg = cfg.with_draft("dspark") if draft == "dspark" else cfg
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    params = [
        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, seed=0),
        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, seed=1),
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=7, frequency_penalty=0.5, ignore_eos=True),
    ]
    names = ["greedy0", "greedy1", "seeded", "penalized"]
    spec = dict(speculative=3, speculative_threshold=0.3) if draft == "dspark" else dict(speculative=2)
    return cfg, list(zip(names, prompts, params, (0, 2, 1, 3))), spec


def _oracle(engine, answers: dict[str, list[int]]):
    """The engine's drafter, whose greedy rows propose the known greedy continuation with every third token
    wrong (acceptance at every depth, rejected tokens that completed a group or crossed a page; with DSpark
    verify lengths 3, 1, 0, 2 by turns); the draft still runs, and sampled rows keep its drafts."""
    from dsv4.engine.dspark_step import DSparkDrafter
    from dsv4.engine.speculative import Drafter

    by_seed = {0: answers["greedy0"], 1: answers["greedy1"]}
    vocab = engine.vocab

    def planted(r, n: int) -> list[int]:
        want = by_seed[r.seed][r.counter : r.counter + n]
        return [(t + 1) % vocab if (r.counter + j) % 3 == 1 else t for j, t in enumerate(want)]

    class Oracle(Drafter):
        def __call__(self, hidden, rows):
            out = super().__call__(hidden, rows)
            for i, r in enumerate(rows):
                if r.k and r.params.greedy:
                    toks = planted(r, r.k)
                    out[i] = (toks, torch.nn.functional.one_hot(torch.tensor(toks), vocab).double())
            return out

    class DSparkOracle(DSparkDrafter):
        def __call__(self, rows):
            out = super().__call__(rows)
            for i, r in enumerate(rows):
                if r.params.greedy:
                    out[i] = (planted(r, min(r.k, (3, 1, 0, 2)[r.counter % 4])), None)
            return out

    if engine.model.cfg.dspark:
        return DSparkOracle(engine.model, engine.runner, engine.sampler, engine.spec.k, engine.spec.threshold)
    return Oracle(engine.model, engine.runner, engine.sampler)


def _spec_serve(engine, requests, answers=None) -> dict:
    """Rank 0 (or one process): the requests, arriving by steps -> tokens per request, every step's drafts
    (request, tokens generated, drafts) and the counters."""
    if answers is not None:
        engine.drafter = _oracle(engine, answers)
    out: dict[str, list[int]] = {name: [] for name, *_ in requests}
    drafts = []
    pending, step = list(requests), 0
    while pending or engine.has_work():
        for req in [r for r in pending if r[3] <= step]:
            engine.add_request(req[0], req[1], req[2])
            pending.remove(req)
        for o in engine.step():
            out[o.request_id].extend(o.new_tokens)
        drafts.append(sorted([s.request.request_id, s.n_generated, s.drafts] for s in engine.running))
        step += 1
    st = engine.spec_stats
    return {
        "tokens": out,
        "drafts": drafts,
        "fixed_steps": st["fixed_steps"],
        "accepted": st["accepted"],
        "verify_steps": st["verify_steps"],
    }


def _spec_engine(cfg, spec: dict, mirror=None, group=None, pad_steps: bool = False):
    from dsv4 import DeepSeekV4, parallel
    from dsv4.engine import Engine, EngineConfig

    model = DeepSeekV4.from_config(cfg, seed=0).eval()
    if mirror is not None:
        parallel.parallelize_for_serving(model, group, attention="replicated")
    return Engine(model, EngineConfig(**SPEC_CONFIG, **spec, pad_steps=pad_steps), mirror=mirror)


def _spec_worker(rank: int, world: int, port: int, out_dir: str, answers: dict) -> None:
    """Both cases on two workers: rank 0 serves, rank 1 follows and counts the messages it followed."""
    from dsv4 import parallel
    from dsv4.engine.mirror import Mirror

    torch.set_num_threads(1)
    w = parallel.init_workers(rank, world, master_port=port, device="cpu", timeout_s=SPEC_TIMEOUT_S)
    res = {}
    for draft in ("mtp", "dspark"):
        cfg, requests, spec = _spec_case(draft)
        engine = _spec_engine(cfg, spec, Mirror(w.group, w.device), w.group)
        if rank == 0:
            res[draft] = _spec_serve(engine, requests, answers[draft])
            engine.close()
            continue
        seen: dict[int, int] = {}
        inner = engine.spec.follow

        def count(kind: int, values: list[int], inner=inner, seen=seen) -> None:
            seen[kind] = seen.get(kind, 0) + 1
            inner(kind, values)

        engine.spec.follow = count
        engine.follow()
        res[draft] = seen
    parallel.shutdown_workers()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def speculative_runs(tmp_path_factory) -> dict:
    """One process (plain; speculative with padded steps, as on several workers, so that it takes the
    same fixed-shape steps) and two workers (speculative), both drafts."""
    one: dict = {}
    for draft in ("mtp", "dspark"):
        cfg, requests, spec = _spec_case(draft)
        plain = _spec_serve(_spec_engine(cfg, {}), requests)
        one[draft] = {
            "plain": plain,
            "spec": _spec_serve(_spec_engine(cfg, spec, pad_steps=True), requests, plain["tokens"]),
        }
    out = tmp_path_factory.mktemp("spec_parallel")
    answers = {draft: one[draft]["plain"]["tokens"] for draft in one}
    leader, follower = launch(_spec_worker, out, answers, world=2, timeout_s=SPEC_TIMEOUT_S)
    return {"one": one, "leader": leader, "follower": follower}


@pytest.mark.parametrize("draft", ["mtp", "dspark"])
def test_speculative_engine_on_two_workers_gives_one_process_tokens(speculative_runs, draft):
    """Greedy (oracle drafts: kept and rejected at every depth), seeded and penalized requests in one batch,
    prompt chunks beside verifies, then greedy alone at a fixed shape: two workers give the tokens of one
    process with speculation, step by step the same drafts (each the draft's of rank 0, whose MoE layers
    sum both workers' experts: a follower that ran a draft link on other tokens would change them), and
    greedy tokens those of plain decoding."""
    from dsv4.engine.mirror import DRAFT, FIXED, VERIFY

    one, two = speculative_runs["one"][draft], speculative_runs["leader"][draft]
    assert two["tokens"] == one["spec"]["tokens"]
    assert two["drafts"] == one["spec"]["drafts"]
    assert (two["fixed_steps"], two["accepted"]) == (one["spec"]["fixed_steps"], one["spec"]["accepted"])
    plain = one["plain"]["tokens"]
    assert all(two["tokens"][n] == plain[n] for n in ("greedy0", "greedy1"))
    assert [len(two["tokens"][n]) for n in ("greedy0", "greedy1", "seeded", "penalized")] == [NEW, NEW, 6, 6]
    assert two["tokens"]["penalized"] == plain["penalized"]  # penalized rows decode plainly
    assert two["fixed_steps"] > 0 and two["accepted"] > 0 and two["verify_steps"] > 0
    seen = {int(k): v for k, v in speculative_runs["follower"][draft].items()}
    assert seen[FIXED] == two["fixed_steps"]
    assert seen[VERIFY] > 0 and seen[DRAFT] > 0
