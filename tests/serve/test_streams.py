"""`dsv4.serve.streams.merge`: the outputs of a request's engine streams as they come, merged per choice for a
consumer that fell behind (fewer, larger chunks instead of a backlog), with nothing lost or reordered
within a choice, errors after the outputs before them, and the shutdown's end after them."""

from __future__ import annotations

import asyncio

import pytest

from dsv4.engine.sequence import StepOutput, TokenLogprob
from dsv4.serve.streams import Endings, merge


def out(index: int, toks: list[int], finished: bool = False) -> StepOutput:
    return StepOutput(
        "r",
        index,
        list(toks),
        [TokenLogprob(t, -float(t)) for t in toks],
        finished,
        "length" if finished else None,
        3,
        len(toks),
        text="".join(chr(97 + t) for t in toks),
    )


async def feed(items: list, gate: asyncio.Event | None = None):
    for item in items:
        if gate is not None:
            await gate.wait()
        if isinstance(item, BaseException):
            raise item
        yield item


def run(coro):
    return asyncio.run(coro)


def test_a_slow_consumer_gets_one_chunk_per_choice_with_every_token_in_order():
    async def go():
        a = feed([out(0, [1]), out(1, [5]), out(0, [2]), out(0, [3], True), out(1, [6], True)])
        b = feed([out(0, [9]), out(0, [8], True)])
        merged = merge([a, b])  # (its pumps put everything before the consumer's first read)
        return [(i, o.index, o.new_tokens, o.text, o.finished) async for i, o in merged]

    got = run(go())
    by_choice: dict = {}
    for i, idx, toks, text, fin in got:
        by_choice.setdefault((i, idx), []).append((toks, text, fin))
    assert {k: [t for chunk in v for t in chunk[0]] for k, v in by_choice.items()} == {
        (0, 0): [1, 2, 3],
        (0, 1): [5, 6],
        (1, 0): [9, 8],
    }
    assert all(v[-1][2] and not any(c[2] for c in v[:-1]) for v in by_choice.values())  # finished last, once
    assert len(got) < 7  # merged: fewer chunks than outputs
    assert "".join(t for chunk in by_choice[(0, 0)] for t in chunk[1]) == "bcd"


def test_outputs_before_an_error_arrive_before_it():
    async def go():
        merged = merge([feed([out(0, [1]), out(0, [2]), RuntimeError("engine died")])])
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for _, o in merged:
                seen.extend(o.new_tokens)
        return seen

    assert run(go()) == [1, 2]


def test_the_end_of_the_grace_period_stops_after_what_came_before_it():
    async def go():
        endings = Endings()
        gate = asyncio.Event()
        merged = merge([feed([out(0, [1]), out(0, [2])], gate), feed([out(0, [7])], asyncio.Event())], endings)
        reading = asyncio.ensure_future(merged.__anext__())  # the merge starts; nothing has come yet
        for _ in range(3):
            await asyncio.sleep(0)
        gate.set()
        first = await reading
        for _ in range(3):
            await asyncio.sleep(0)  # the second output waits in the merge's queue
        endings.end_all()
        rest = [t async for _, o in merged for t in o.new_tokens]
        return first[1].new_tokens + rest

    assert run(go()) == [1, 2]  # the second stream never sent: ended, not waited for
