"""`row_layout`: the shape-only index tensors of `uniform_inputs`, kept per shape so that a step replayed from
a CUDA graph reads them as constants. Kept tensors are the values a fresh computation gives, usable with
autograd after being made in inference mode, and never made inside a graph capture."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import paged
from dsv4.model.paged import LAYOUT_MAX_S, row_layout, uniform_inputs


def fresh(b: int, s: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.arange(s),
        torch.arange(b).repeat_interleave(s),
        torch.arange(b) * s,
        torch.arange(b * s).view(b, s),
        torch.arange(b),
    )


@pytest.mark.parametrize("b,s", [(1, 1), (4, 3), (7, 1), (3, LAYOUT_MAX_S), (2, LAYOUT_MAX_S + 5)])
def test_values_are_the_shapes_indices_and_short_rows_are_kept(b, s):
    got = row_layout(b, s, torch.device("cpu"))
    for g, want in zip(got, fresh(b, s), strict=True):
        assert g.dtype == torch.int64 and torch.equal(g, want)
    again = row_layout(b, s, torch.device("cpu"))
    kept = s <= LAYOUT_MAX_S
    assert all((x is y) == kept for x, y in zip(got, again))


def test_made_in_inference_mode_then_indexed_with_autograd():
    """A layout first made under inference mode is an ordinary tensor: a later forward with autograd may
    save it for its backward (indexing a tensor that requires grad)."""
    b, s = 5, 2
    paged._LAYOUTS.pop((b, s, torch.device("cpu")), None)
    with torch.inference_mode():
        row_layout(b, s, torch.device("cpu"))
    _, rows, _, _, _ = row_layout(b, s, torch.device("cpu"))
    assert not rows.is_inference()
    x = torch.randn(b, 3, requires_grad=True)
    x[rows].sum().backward()
    assert torch.equal(x.grad, torch.full((b, 3), float(s)))


def test_uniform_inputs_unchanged():
    """The step inputs of rows of s tokens at their starts, as they were made before the layouts were kept."""
    b, s = 3, 4
    tokens = torch.arange(b * s).view(b, s) + 10
    start = torch.tensor([0, 7, 130])
    table = torch.zeros(b, 2, dtype=torch.long)

    class Layout:
        ratios = (4, 128)

    for _ in range(2):  # made, then kept
        inp = uniform_inputs(tokens, start, table, table, torch.arange(b), Layout())
        assert torch.equal(inp.positions, (start.view(b, 1) + torch.arange(s)).flatten())
        assert torch.equal(inp.rows, torch.arange(b).repeat_interleave(s))
        assert torch.equal(inp.seg_start, torch.arange(b) * s)
        assert torch.equal(inp.index_maps[0], torch.arange(b * s).view(b, s))
        assert torch.equal(inp.index_rows[0], torch.arange(b))
        assert torch.equal(inp.length, start + s) and inp.groups == {4: None, 128: None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_not_kept_when_first_made_inside_a_graph_capture():
    """Made during a capture, the tensors hold their values only once the graph runs: not kept; the graph
    still computes them (right after a replay), and the next eager call makes and keeps its own."""
    dev = torch.device("cuda")
    b, s = 11, 3
    paged._LAYOUTS.pop((b, s, dev), None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = row_layout(b, s, dev)
    assert (b, s, dev) not in paged._LAYOUTS
    graph.replay()
    torch.cuda.synchronize()
    for g, want in zip(inside, fresh(b, s), strict=True):
        assert torch.equal(g.cpu(), want)
    kept = row_layout(b, s, dev)
    assert paged._LAYOUTS[(b, s, dev)] is kept
    for g, want in zip(kept, fresh(b, s), strict=True):
        assert torch.equal(g.cpu(), want)
