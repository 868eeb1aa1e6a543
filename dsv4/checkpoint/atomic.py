"""Atomic directory writes: build the whole directory in a temporary sibling, then rename it into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(dst: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `dst`; when the block ends normally it replaces `dst`
    (an existing `dst` is removed first), otherwise it is deleted and `dst` is left as it was."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dst.parent)
