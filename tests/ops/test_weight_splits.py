"""`ops.keep_splits`: the bf16x3 projection's three-way split of a fixed fp32 weight, made once and kept.

The properties: a kept split gives the same bits as a fresh one (it is the same split); it is made once
per weight while the weight is unchanged, and again after an in-place write or new storage; a weight that
is not marked, or that autograd tracks, is split at every call and nothing is kept; a CUDA graph captured
after the first call replays the kept split, and a capture never keeps a split (its tensors belong to
the graph's memory pool). The serving engine and the graphed decoders mark their model's weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4 import ops
from dsv4.ops import torch_native


@pytest.fixture
def splits(monkeypatch) -> list[int]:
    """Counts the weight splits made (one entry per `split_bf16x3` call)."""
    made: list[int] = []
    real = torch_native.split_bf16x3

    def counting(w: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return real(w)

    monkeypatch.setattr(torch_native, "split_bf16x3", counting)
    return made


def _layer(seed: int, device: str = "cpu") -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(96, 50, bias=False).to(device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(50, 96, generator=g).to(device))
    return lin


def _x(device: str = "cpu") -> torch.Tensor:
    return torch.randn(7, 96, generator=torch.Generator().manual_seed(9)).to(device, torch.bfloat16)


def _fresh(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The projection with an unmarked copy of the weight: split at the call."""
    with torch.no_grad():
        return ops.linear_fp32(x, weight.detach().clone(), backend="bf16x3")


def test_a_kept_split_is_made_once_and_gives_the_same_bits(splits):
    lin, x = _layer(0), _x()
    want = _fresh(lin.weight, x)
    assert ops.keep_splits(lin) == 1 and ops.keep_splits(lin) == 0  # (marked once)
    before = len(splits)
    with torch.no_grad():
        got = [ops.linear_fp32(x, lin.weight, backend="bf16x3") for _ in range(3)]
    assert len(splits) - before == 1
    assert all(torch.equal(y, want) for y in got)


def test_a_weight_of_bf16_values_keeps_its_first_part_alone(splits):
    """A kept split whose smaller parts are zero (an fp32 weight holding bf16 values, as a checkpoint's BF16
    head loaded into fp32) is kept as its first part: [N, K] bf16 equal to the weight, one product per
    term instead of three. Every call is within fp32 accumulation of the exact product (each output a sum
    of 96 exact bf16 x bf16 terms, 3 x 96 with three parts); a weight with one value off the bf16 grid
    keeps all three parts."""
    x = _x()
    for off_grid in (False, True):
        lin = _layer(5)
        with torch.no_grad():
            lin.weight.copy_(lin.weight.bfloat16().float())
            if off_grid:
                lin.weight[3, 7] += lin.weight[3, 7].abs() * 2.0**-12
        ops.keep_splits(lin)
        exact = (x.double() @ lin.weight.double().t()).float()
        terms = 3 * 96 if off_grid else 96  # exact products summed in fp32 per output
        bound = terms * 2.0**-24 * (x.float().abs() @ lin.weight.abs().t()) + 1e-30
        before = len(splits)
        with torch.no_grad():
            ys = [ops.linear_fp32(x, lin.weight, backend="bf16x3") for _ in range(3)]
        assert len(splits) - before == 1
        kept = torch_native._KEPT[lin.weight][1]
        if off_grid:
            assert kept.shape == (50, 3 * 96) and not torch_native.one_part_split(lin.weight)
        else:
            assert kept.shape == (50, 96) and torch.equal(kept.float(), lin.weight)
            assert torch_native.one_part_split(lin.weight)
        assert all(((y - exact).abs() <= bound).all() for y in ys)


def test_a_changed_weight_is_split_again(splits):
    lin, x = _layer(1), _x()
    ops.keep_splits(lin)
    with torch.no_grad():
        ops.linear_fp32(x, lin.weight, backend="bf16x3")
        lin.weight.mul_(-3.0)  # in place: the version counter moves
        assert torch.equal(ops.linear_fp32(x, lin.weight, backend="bf16x3"), _fresh(lin.weight, x))
    lin.weight.data = torch.randn(50, 96, generator=torch.Generator().manual_seed(5))  # new storage
    with torch.no_grad():
        assert torch.equal(ops.linear_fp32(x, lin.weight, backend="bf16x3"), _fresh(lin.weight, x))
        before = len(splits)
        ops.linear_fp32(x, lin.weight, backend="bf16x3")
    assert len(splits) == before  # (kept again after the re-split)


def test_unmarked_or_tracked_weights_are_split_at_every_call(splits):
    lin, x = _layer(2), _x()
    with torch.no_grad():
        for _ in range(2):
            ops.linear_fp32(x, lin.weight, backend="bf16x3")
    assert len(splits) == 2 and lin.weight not in torch_native._KEPT
    ops.keep_splits(lin)
    before = len(splits)
    for _ in range(2):  # autograd on, the weight trainable: its split follows the weight at every call
        y = ops.linear_fp32(x, lin.weight, backend="bf16x3")
    y.sum().backward()
    assert len(splits) - before == 2 and torch_native._KEPT[lin.weight] is None
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_a_weight_made_in_inference_mode_is_split_at_every_call(splits):
    """An inference tensor has no version counter, so a kept split could not see a write: none is kept."""
    with torch.inference_mode():
        lin = _layer(4)
    x = _x()
    ops.keep_splits(lin)
    with torch.inference_mode():
        got = [ops.linear_fp32(x, lin.weight, backend="bf16x3") for _ in range(2)]
    assert len(splits) == 2 and torch_native._KEPT[lin.weight] is None
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], _fresh(lin.weight, x))


def test_the_engine_marks_its_models_fp32_matrices():
    from dsv4 import DeepSeekV4
    from dsv4.check.inputs import check_config
    from dsv4.engine import Engine, EngineConfig

    model = DeepSeekV4.from_config(check_config("tiny"), seed=0).eval()
    Engine(model, EngineConfig(max_seqs=2))
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2]
    assert any(p is model.head.weight for p in fp32) and all(p in torch_native._KEPT for p in fp32)


@pytest.mark.gpu
def test_a_graph_replays_the_kept_split(splits):
    """A capture after the first call records the kept split (no split in the graph), and a capture of a
    marked weight that has no kept split yet splits inside the graph and keeps nothing."""
    x = _x("cuda")
    for first_outside in (True, False):
        lin = _layer(3, "cuda")
        ops.keep_splits(lin)
        want = _fresh(lin.weight, x)
        with torch.no_grad():
            if first_outside:
                ops.linear_fp32(x, lin.weight, backend="bf16x3")
            before = len(splits)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = ops.linear_fp32(x, lin.weight, backend="bf16x3")
            graph.replay()
            torch.cuda.synchronize()
        # the same exact products of the same split (cuBLAS may order the sum otherwise inside a capture):
        # each output sums 3 * 96 of them in fp32
        bound = 3 * 96 * 2.0**-24 * (x.float().abs() @ lin.weight.abs().t())
        assert ((y - want).abs() <= bound).all()
        assert len(splits) - before == (0 if first_outside else 1)
        assert (torch_native._KEPT[lin.weight] is not None) == first_outside


@pytest.mark.gpu
def test_the_default_on_cuda_runs_the_split_from_two_rows():
    """`torch_native.prefers_split` is what runs: one row of bf16 activations stays the fp32 GEMV, two and
    sixteen take the bf16x3 split, with the same products (each output a sum of 96 in fp32)."""
    lin = _layer(3, "cuda")
    assert _default_by_rows(lin.weight, terms=3 * 96) == {1: "reference", 2: "bf16x3", 16: "bf16x3"}


def _default_by_rows(weight: torch.Tensor, terms: int) -> dict[int, str]:
    """The backend `linear_fp32`'s default runs at 1, 2 and 16 rows of bf16 activations, each output checked
    within fp32 accumulation of the exact product: `terms` exact products summed in fp32 per output."""
    ran = {}
    for rows in (1, 2, 16):
        x = torch.randn(rows, weight.size(1), device="cuda").bfloat16()
        with torch.no_grad():
            y = ops.linear_fp32(x, weight)
        ran[rows] = ops.last_backend("linear_fp32")
        exact = (x.double() @ weight.double().t()).float()
        bound = terms * 2.0**-24 * (x.float().abs() @ weight.abs().t()) + 1e-30
        assert ((y - exact).abs() <= bound).all()
    return ran


@pytest.mark.gpu
def test_a_cuda_weight_of_bf16_values_takes_its_one_part_split_from_one_row(splits):
    """On CUDA, marking makes a bf16-valued weight's one-part split at once (no three-part split is made),
    and the default runs it at every row count, one row included (it reads 2 bytes a weight, the fp32
    GEMV 4); each output within fp32 accumulation of the exact product (96 exact terms). After an
    in-place write the kept split no longer holds, and one row goes back to the fp32 GEMV."""
    lin = _layer(6, "cuda")
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
    ops.keep_splits(lin)
    assert torch_native.one_part_split(lin.weight) and not splits
    assert _default_by_rows(lin.weight, terms=96) == {1: "bf16x3", 2: "bf16x3", 16: "bf16x3"} and not splits
    with torch.no_grad():
        lin.weight.mul_(2.0)  # still bf16 values, but the kept split is stale
        ops.linear_fp32(torch.randn(1, 96, device="cuda").bfloat16(), lin.weight)
    assert not torch_native.one_part_split(lin.weight) and ops.last_backend("linear_fp32") == "reference"
