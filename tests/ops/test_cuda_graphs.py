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
