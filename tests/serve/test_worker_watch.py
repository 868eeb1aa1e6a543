"""Rank 0's watch over the other workers (`dsv4.serve.workers._watch`): a worker that exits while the engine
serves ends the engine process with one line (its collectives would hang); one that exits after the engine
told the workers to stop (`Mirror.send(STOP)` calls `on_stop` first) is the normal end, not a failure."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from dsv4.engine.mirror import STEP, STOP, Mirror
from dsv4.serve import workers


class Proc:
    def __init__(self, exitcode: int | None = None):
        self.exitcode = exitcode


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    calls: list[int] = []

    def fake_exit(code: int) -> None:
        calls.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(workers.os, "_exit", fake_exit)
    return calls


def test_a_worker_that_dies_while_serving_ends_the_engine_with_one_line(exits, capsys):
    with pytest.raises(SystemExit):
        workers._watch([Proc(), Proc(-9)], threading.Event(), poll_s=0.01)
    assert exits == [3]
    assert capsys.readouterr().err.strip() == "dsv4 serve: worker 2 exited (code -9): stopping the engine"


def test_workers_ending_after_stop_are_not_a_failure(exits):
    """The race this guards: at the end of `dsv4 generate`, Python ends the daemon followers (SIGTERM) while
    the watch still runs; the watch took that for a crash and exited with code 3."""
    procs, stopping = [Proc()], threading.Event()
    watch = threading.Thread(target=workers._watch, args=(procs, stopping, 0.01))
    watch.start()
    stopping.set()  # what Mirror.send(STOP) does first, through on_stop
    procs[0].exitcode = -15
    watch.join(5)
    assert not watch.is_alive() and exits == []


def test_mirror_calls_on_stop_when_it_sends_stop_only(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        seen: list[str] = []
        mirror = Mirror(None, torch.device("cpu"), on_stop=lambda: seen.append("on_stop"))
        mirror.send(STEP, 1, 2)
        assert seen == []
        mirror.send(STOP)
        assert seen == ["on_stop"] and mirror.header[0].item() == STOP
    finally:
        dist.destroy_process_group()
