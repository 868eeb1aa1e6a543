"""`scoped(local, name, value)`: a thread-local setting that holds for the length of a `with` block.

The dispatcher's backend choices (`dsv4.ops.use_backend`, `prefer_backend`) and the model's stage
recorder (`dsv4.model.layers.recording`) are such settings: set on entry, the enclosing value back on exit
(also when the block raises), and invisible to other threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def scoped(local: threading.local, name: str, value: object) -> Iterator[None]:
    """Set `local.<name>` to value inside the block; restore the previous value (None if unset) after."""
    prev = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, prev)
