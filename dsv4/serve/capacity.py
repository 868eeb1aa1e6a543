"""How long a sequence the engine's cache can hold, computed once in the engine process at start-up and
sent to the HTTP process, which refuses longer requests at admission (a 400 that states the limit)
instead of admitting them and failing mid-generation.

The rule is the engine's own page arithmetic (`CacheManager.pages_for`, and the window pages a sequence
holds at most: its window plus one prompt chunk, as `Engine.check_request` counts them), applied to the
whole sequence (prompt + output + the speculative drafts of the last step) rather than to the prompt.
"""

from __future__ import annotations

import math


def fits_alone(engine, length: int) -> bool:
    """Whether one sequence of `length` positions fits the cache with nothing else running."""
    layout = engine.layout
    w, c = engine.manager.pages_for(0, length)
    w = min(w, math.ceil((layout.window + engine.scheduler.config.max_batch_tokens) / layout.page_size) + 1)
    return w <= layout.n_window_pages - 1 and c <= layout.n_comp_pages - 1


def longest_sequence(engine) -> int:
    """The most positions (prompt + output) one sequence can reach in this engine's cache, at most its
    max_model_len (0 when not even one position fits)."""
    extra = engine.config.speculative or 0  # a verify step writes its drafts' positions too
    lo, hi = 0, engine.max_model_len
    while lo < hi:  # the largest L with fits_alone(L + extra)
        mid = (lo + hi + 1) // 2
        if fits_alone(engine, mid + extra):
            lo = mid
        else:
            hi = mid - 1
    return lo
