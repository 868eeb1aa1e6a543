"""The speculative engine under random traffic: requests arriving at random steps, some cancelled, some ending
at stop tokens, at max_tokens or at max_model_len, parallel samples, prompts sharing prefixes (the prefix cache),
rows that sample, filter, penalize or want log-probabilities beside greedy ones, with and without overlapped
fixed-shape steps.

Oracle: each request alone. A greedy request's tokens are the plain engine's (speculation never changes a
greedy token); a sampled one's are what the speculative engine gives it alone (deterministic mode: a row
computes the same in any batch, and its draws depend on its seed and counter only). A cancelled request's
tokens are a prefix of its solo run's. After the run every page is back.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4 import DeepSeekV4
from dsv4.check.inputs import check_config
from dsv4.engine import Engine, EngineConfig, SamplingParams

SEEDS = (11, 23, 34)  # (each exercises admissions beside fed steps: the stats are checked below)
MAX_MODEL_LEN = 120


@pytest.fixture(scope="module")
def model() -> DeepSeekV4:
    return DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()


def _engine(model, overlap: bool, k: int, max_seqs: int) -> Engine:
    cfg = EngineConfig(
        deterministic=True,
        speculative=k,
        pad_steps=True,
        max_seqs=max_seqs,
        max_batch_tokens=64,
        page_size=16,
        chunk_len=8,
        max_model_len=MAX_MODEL_LEN,
        overlap=overlap,
    )
    return Engine(model, cfg)


def _drive(engine: Engine, requests: dict, arrivals: dict, cancels: dict) -> dict:
    """Adds and cancels requests before the steps named; -> (request id, sample index) -> its tokens."""
    outs: dict[tuple[str, int], list[int]] = {}
    step = 0
    while engine.has_work() or any(a >= step for a in arrivals):
        for rid in arrivals.get(step, []):
            prompt, params, n = requests[rid]
            engine.add_request(rid, prompt, params, n=n)
        for rid in cancels.get(step, []):
            if rid in engine.requests:
                engine.abort(rid)
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).extend(out.new_tokens)
        step += 1
        assert step < 3000, "the engine stopped making progress"
    return outs


def _traffic(seed: int, vocab: int) -> tuple[dict, dict, dict, int, int]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    requests: dict[str, tuple[list[int], SamplingParams, int]] = {}
    arrivals: dict[int, list[str]] = {}
    cancels: dict[int, list[str]] = {}
    for i in range(rng.randint(3, 8)):
        prompt = torch.randint(2, vocab, (rng.choice([1, 2, 5, 9, 16, 17, 30, 47, 100, 110]),), generator=g).tolist()
        if requests and rng.random() < 0.3:  # a prefix of an earlier prompt, then its own tail
            other = rng.choice(list(requests.values()))[0]
            prompt = other[: rng.randint(1, len(other))] + prompt[: rng.randint(0, 20)]
        kw = dict(
            max_tokens=rng.choice([1, 2, 3, 7, 20, 40]),
            seed=seed * 100 + i,
            ignore_eos=True,
            temperature=rng.choice([0.0, 0.0, 1.0, 5.0]),
        )
        kind = rng.random()
        if kind < 0.15:
            kw["top_k"] = 5
        elif kind < 0.25:
            kw["repetition_penalty"] = 1.3
        elif kind < 0.35:
            kw["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(2, vocab) for _ in range(20)]
        n = rng.choice([1, 1, 1, 2, 3]) if kw["temperature"] > 0 else 1
        rid = f"r{i}"
        requests[rid] = (prompt, SamplingParams(**kw), n)
        arrivals.setdefault(rng.randint(0, 25), []).append(rid)
        if rng.random() < 0.25:
            cancels.setdefault(rng.randint(0, 40), []).append(rid)
    return requests, arrivals, cancels, rng.choice([1, 2, 3]), rng.choice([2, 3, 4, 8])


@pytest.mark.parametrize("seed", SEEDS)
def test_random_traffic_gives_each_request_its_solo_tokens(model, seed):
    requests, arrivals, cancels, k, max_seqs = _traffic(seed, model.cfg.vocab_size)
    solo: dict[tuple[str, int], list[int]] = {}
    for rid, (prompt, params, n) in requests.items():
        plain = _engine(model, False, 0 if params.temperature == 0 else k, max_seqs)
        solo.update(_drive(plain, {rid: (prompt, params, n)}, {0: [rid]}, {}))
    cancelled = {rid for rids in cancels.values() for rid in rids}
    admitted = 0
    for overlap in (False, True):
        engine = _engine(model, overlap, k, max_seqs)
        free = engine.manager.free_pages()
        outs = _drive(engine, requests, arrivals, cancels)
        for (rid, index), tokens in outs.items():
            want = solo[rid, index]
            assert tokens == (want[: len(tokens)] if rid in cancelled else want), (overlap, rid, index)
        for rid, (_, _, n) in requests.items():
            if rid not in cancelled:
                assert all((rid, i) in outs for i in range(n)), (overlap, rid)
        assert not engine.has_work() and engine.manager.free_pages() == free  # every page back
        if overlap:
            st = engine.spec_stats
            assert st["fed_steps"] > 0
            admitted = st["admitted"]
    assert admitted > 0  # (the seeds are chosen so: prompts start beside a fed fixed-shape step)
