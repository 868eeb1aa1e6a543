"""The server's side of the engine: outputs that pile up are merged per choice, in order, without losing
a token, a log-probability, a piece of text or the finish; text is made from tokens with stop strings
(`TextStreams`), and a stop string ends its choice and tells the engine."""

from __future__ import annotations

import asyncio

from dsv4.engine.client import Stream, coalesce, stream_outputs
from dsv4.engine.output import TextStreams
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.sequence import StepOutput, TokenLogprob
from dsv4.tokenizer import ByteTokenizer


def out(index: int, toks: list[int], text: str = "", finished: bool = False, reason=None) -> StepOutput:
    return StepOutput(
        "r", index, list(toks), [TokenLogprob(t, -float(t)) for t in toks], finished, reason, 3, 0, text=text
    )


def test_coalesce_keeps_order_and_the_last_finish():
    items = [
        out(0, [1], "a"),
        out(1, [7], "x"),
        out(0, [2, 3], "bc"),
        out(1, [8], "y", True, "stop"),
        out(0, [4], "d", True, "length"),
    ]
    merged = coalesce(items)
    assert [(m.index, m.new_tokens, m.text, m.finished, m.finish_reason) for m in merged] == [
        (0, [1, 2, 3, 4], "abcd", True, "length"),
        (1, [7, 8], "xy", True, "stop"),
    ]
    assert [lp.token for lp in merged[0].new_logprobs] == [1, 2, 3, 4]
    assert items[0].new_tokens == [1]  # the inputs are not changed
    single = [out(0, [5])]
    assert coalesce(single) == single


def test_a_stream_that_fell_behind_gets_one_chunk_per_choice():
    class Owner:
        def __init__(self):
            self.aborted, self.forgotten = [], []

        def abort(self, rid):
            self.aborted.append(rid)

        def forget(self, rid):
            self.forgotten.append(rid)

    async def main():
        owner = Owner()
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), 1)
        for item in (out(0, [1], "a"), out(0, [2], "b"), out(0, [3], "c", True, "stop")):
            stream.queue.put_nowait(item)
        got = [o async for o in stream_outputs(owner, "r", stream)]
        return owner, got

    owner, got = asyncio.run(main())
    assert [(o.new_tokens, o.text, o.finished) for o in got] == [([1, 2, 3], "abc", True)]
    assert owner.aborted == [] and owner.forgotten == ["r"]


def test_text_streams_cut_at_a_stop_string_and_stop_the_choice():
    tok = ByteTokenizer(0, 1)
    stopped = []
    text = TextStreams(tok, lambda rid, i: stopped.append((rid, i)))
    prompt = [0] + list(b"say: ")
    text.add("r", prompt, SamplingParams(max_tokens=20, stop=["END"]), 1)
    first = text.process([StepOutput("r", 0, list(b"hello E"), [], False, None, len(prompt), 7)])
    second = text.process([StepOutput("r", 0, list(b"ND more"), [], False, None, len(prompt), 14)])
    late = text.process([StepOutput("r", 0, list(b"!"), [], False, None, len(prompt), 15)])
    assert first[0].text + second[0].text == "hello "
    assert second[0].finished and second[0].finish_reason == "stop" and second[0].new_tokens == list(b"ND")
    assert second[0].completion_tokens == 9 and stopped == [("r", 0)]
    assert late == []  # tokens still in flight are dropped
    text.drop("r")
    assert not text.streams and not text.requests
    text.add("huge", prompt, SamplingParams(), 10**9)  # choices cost nothing before they speak
    assert not text.streams


def test_the_engine_loop_reports_its_idle_and_io_time_with_the_step_phases():
    """`_serve` (the engine process's loop, run here in a thread over real pipes): every metrics message
    carries the step phases plus "idle" (waiting with no work) and "io" (commands and results), both
    growing, and a step's outputs arrive with its duration."""
    import multiprocessing as mp
    import threading
    import time

    from dsv4.engine.client import AddRequest, Outputs, Stop
    from dsv4.engine.engine_process import _serve

    class Engine:
        requests: dict = {}

        def __init__(self):
            self.todo = []

        def add_request(self, rid, prompt, params, n):
            self.todo.append(rid)

        def has_work(self):
            return bool(self.todo)

        def step(self):
            time.sleep(0.01)
            self.todo.pop()
            return [out(0, [7], "x", True, "length")]

        def metrics(self):
            return {"running": len(self.todo), "step_seconds": {"schedule": 0.0}}

    cmd_recv, cmd_send = mp.Pipe(duplex=False)
    res_recv, res_send = mp.Pipe(duplex=False)
    loop = threading.Thread(target=_serve, args=(Engine(), [(cmd_recv, res_send)]), daemon=True)
    loop.start()
    time.sleep(0.6)  # one idle poll (0.5 s) with no work
    cmd_send.send(AddRequest("r", [1, 2], SamplingParams()))
    assert res_recv.poll(10)
    step = res_recv.recv()  # the step (its metrics carry the admission's gauges too)
    time.sleep(0.6)
    cmd_send.send(Stop())
    loop.join(5)
    assert not loop.is_alive()
    assert isinstance(step, Outputs) and step.outputs and step.seconds >= 0.01
    assert not res_recv.poll(0.1)  # nothing else: no work, no command, nothing to report
    phases = step.metrics["step_seconds"]
    assert set(phases) == {"schedule", "io", "idle"}
    assert phases["idle"] >= 0.4 and phases["io"] >= 0.0


def test_freeze_heap_takes_start_up_objects_out_of_full_collections():
    """What a serving process made before it serves is frozen (after a collection: no garbage kept), so a
    full collection later walks only what serving made; its garbage is still collected."""
    import gc
    import weakref

    from dsv4.engine.engine_process import freeze_heap

    class Node:
        pass

    start_up = [Node() for _ in range(1000)]
    try:
        frozen = freeze_heap()
        assert frozen >= 1000  # (not compared with gc.get_freeze_count() later: a frozen object freed since drops out)
        tracked = {id(x) for x in gc.get_objects()}
        assert not any(id(x) in tracked for x in start_up)
        later = Node()
        later.me = later  # a cycle made while serving
        alive = weakref.ref(later)
        del later
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_a_frozen_process_exits_without_leak_reports():
    """The frozen objects go back to the collector at exit: triton's bindings (where triton is installed)
    reported every frozen one as leaked, some sixty lines on each server shutdown."""
    import subprocess
    import sys

    from subproc import checkout_env

    code = (
        "import dsv4.ops, dsv4.model\n"
        "from dsv4.engine.engine_process import freeze_heap\n"
        "try:\n    import triton  # noqa: F401\nexcept ImportError:\n    pass\n"
        "freeze_heap()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=checkout_env(), timeout=300)
    assert r.returncode == 0 and "leaked" not in r.stderr, r.stderr[-2000:]
