"""`dsv4.model.paged.copy_rows_`: the cache writes of a paged step, the bytes of `index_copy_` exactly,
moved as 8-byte words where the rows allow it and by torch's own index_copy otherwise."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.paged import copy_rows_


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dtype,width",
    [(torch.float32, 1024), (torch.float32, 6), (torch.bfloat16, 512), (torch.bfloat16, 6), (torch.float32, 3)],
)
def test_copy_rows_writes_what_index_copy_writes(dtype, width):
    g = torch.Generator().manual_seed(width)
    dst = torch.randn(40, width, generator=g).to(dtype)
    src = torch.randn(7, width, generator=g).to(dtype)
    src[0, 0] = float("nan")  # a NaN's payload is moved, not computed
    index = torch.tensor([3, 0, 39, 17, 5, 22, 8])
    want = dst.clone().index_copy_(0, index, src)
    got = copy_rows_(dst, index, src)
    assert got is dst
    assert torch.equal(_bits(dst), _bits(want))


def test_copy_rows_into_a_slice_of_a_pool_and_from_a_gathered_source():
    pool = torch.randn(50, 64)
    entries = pool[10:]  # a region starting at a row offset, as the compressed entries of a layer's pool
    src = torch.randn(9, 64)[torch.tensor([8, 1, 3])]  # a gather: a new contiguous tensor
    want = pool.clone()
    want[10:].index_copy_(0, torch.tensor([0, 39, 2]), src)
    copy_rows_(entries, torch.tensor([0, 39, 2]), src)
    assert torch.equal(pool, want)


def test_copy_rows_falls_back_where_words_do_not_fit():
    dst = torch.zeros(8, 10)[:, 1:9]  # columns of a wider tensor: rows are not whole words apart
    src = torch.arange(16.0).view(2, 8)
    copy_rows_(dst, torch.tensor([1, 6]), src)
    assert torch.equal(dst[1], src[0]) and torch.equal(dst[6], src[1]) and dst[0].abs().sum() == 0
    t = torch.zeros(6, 4)
    copy_rows_(t, torch.tensor([2]), torch.ones(1, 4, dtype=torch.float64).float())
    assert t[2].tolist() == [1.0] * 4
