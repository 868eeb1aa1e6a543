"""Progress of long work on a terminal: one tqdm bar on stderr, shown only when stderr is a terminal and the
command was not asked for machine output (`--json`); it is cleared when done, and the command then prints
its one result line. Elsewhere (a pipe, a log file, a test) nothing is drawn."""

from __future__ import annotations

import sys


def bar(total: int | float | None, desc: str, enabled: bool = True, unit: str = "it", **kwargs):
    """A tqdm bar (a no-op one when not shown): `.update(n)`, `.close()`, a context manager."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=True if not enabled else None,
        **kwargs,
    )  # None: only on a terminal
