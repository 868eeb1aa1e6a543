"""CUDA graph capture goes through `dsv4.ops.cuda_graphs.capturing`, which holds Python's collector off."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_every_capture_in_the_package_goes_through_capturing():
    """A `torch.cuda.graph(...)` block elsewhere would capture with the collector on (see the module)."""
    found = []
    for path in sorted((ROOT / "dsv4").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.cuda.graph", "torch.cuda.graphs.graph"):
                found.append(str(path.relative_to(ROOT)))
    assert found == ["dsv4/ops/cuda_graphs.py"], found


@pytest.mark.gpu
def test_a_capture_survives_the_collector_freeing_an_older_graph():
    """An older graph held only by a reference cycle is garbage while a new one is captured; with the
    collector run at nearly every allocation, it would be destroyed inside the capture (which CUDA refuses)."""
    from dsv4.ops.cuda_graphs import capturing

    x = torch.zeros(4, device="cuda")

    def graph_in_a_cycle() -> None:
        g = torch.cuda.CUDAGraph()
        with capturing(g):
            x.add_(1)
        holder: dict = {"graph": g}
        holder["self"] = holder  # only the collector frees it

    for _ in range(3):
        graph_in_a_cycle()
    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        g = torch.cuda.CUDAGraph()
        with capturing(g):
            for _ in range(20):
                _ = [[] for _ in range(50)]  # allocations that would start a collection
                x.add_(1)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*old)
    gc.collect()  # the old graphs go now, outside any capture
    x.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [20.0] * 4


@pytest.mark.gpu
def test_the_logits_watch_counts_inside_graph_replays_and_nested_watches_see_their_own():
    """Engine steps are graph replays: the non-finite check captured in a graph runs on every replay, into
    the model's own counter (alive as long as the model), and each watch compares with its own start."""
    from dsv4.check.finite_logits import watch_logits
    from dsv4.model import DeepSeekV4
    from dsv4.ops.cuda_graphs import capturing

    model = DeepSeekV4.from_config("tiny", device="cuda", dtype=torch.bfloat16)
    logits = torch.zeros(2, 8, device="cuda")
    with watch_logits(model) as outer:
        with watch_logits(model) as inner:
            graph = torch.cuda.CUDAGraph()
            with capturing(graph):
                model._watched(logits)  # what `append` does with its logits
            graph.replay()
            assert not inner.seen()
            logits[1, 3] = float("nan")
            graph.replay()
            assert inner.seen()
        logits.zero_()
        with watch_logits(model) as later:
            graph.replay()  # the graph outlives the watch it was captured in
            assert not later.seen()
        assert outer.seen()
