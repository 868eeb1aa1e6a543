"""The prefix cache's keys (`CacheManager`, host bookkeeping only: no model).

A compressed page is keyed by the chain hash of every token up to its end. A window page is too, unless
the MTP block drafts (`next_token_keys`): its rows in the window pages are computed from the token after
each position, so a page's last row depends on the first token of the next page, and the key must hold it.
"""

from __future__ import annotations

import pytest

from dsv4.engine.cache_manager import CacheManager
from dsv4.model.paged import CacheLayout

P = 16


def manager(next_token_keys: bool) -> CacheManager:
    layout = CacheLayout(P, 16, (4, 16), 33, 33, 4, 256, True)
    return CacheManager(layout, True, next_token_keys=next_token_keys)


def computed(m: CacheManager, tokens: list[int], n: int):
    """A sequence of `tokens` with its first n positions computed and offered to the cache."""
    seq = m.new_sequence()
    assert m.allocate(seq, 0, n)
    m.register(seq, tokens, n)
    return seq


@pytest.mark.parametrize("next_token_keys", [False, True])
def test_a_page_is_served_where_the_next_token_allows(next_token_keys):
    m = manager(next_token_keys)
    base = list(range(100, 100 + 2 * P))
    computed(m, base[: P + 1], P + 1)  # page 0 complete, its next token known
    same_next = base[: P + 1] + [7, 8]
    other_next = base[:P] + [9, 10, 11]
    assert m.match(m.new_sequence(), same_next) == P
    assert m.match(m.new_sequence(), other_next) == (0 if next_token_keys else P)
    assert m.cached_prefix(m.prompt_keys(other_next)) == (0 if next_token_keys else P)


def test_a_window_page_is_offered_once_its_next_token_is_known():
    """A page whose positions are computed but whose next token is not yet known (the step's draw still on
    the device) offers its compressed page at once and its window page when the token comes."""
    m = manager(True)
    tokens = list(range(200, 200 + P))
    seq = computed(m, tokens, P)  # (the 17th token not drawn yet)
    assert len(m.cached_c) == 1 and len(m.cached_w) == 0
    tokens.append(5)
    m.register(seq, tokens, P)
    assert len(m.cached_w) == 1
    other = m.new_sequence()
    assert m.match(other, tokens + [6]) == P
    m.release(seq)
    m.release(other)
    assert m.free_pages() == (m.wpool.n_pages - 1, m.cpool.n_pages - 1)  # every page free or evictable
