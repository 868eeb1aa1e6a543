"""`dsv4.model.paged.lookup_page`: the physical page of each (row, logical page), -1 outside the table."""

from __future__ import annotations

import torch

from dsv4.model.paged import lookup_page


def test_lookup_page_inside_and_outside_the_table():
    table = torch.tensor([[5, 6, 7], [8, 0, 9]])
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0])
    col = torch.tensor([-1, 0, 2, 3, -5, 1, 2, 100, 1])
    want = [-1, 5, 7, -1, -1, 0, 9, -1, 6]  # a 0 entry (no page yet) is returned as it is
    assert lookup_page(table, rows, col).tolist() == want
    many = torch.arange(-4, 8).unsqueeze(0).expand(2, -1)  # [2, 12] cols, rows broadcast
    got = lookup_page(table, torch.tensor([[0], [1]]).expand_as(many), many)
    for r in range(2):
        for j, c in enumerate(range(-4, 8)):
            assert got[r, j].item() == (table[r, c].item() if 0 <= c < 3 else -1)
