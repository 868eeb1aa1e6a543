"""Opening the files a checkpoint names without trusting them: containment, file types, bounded reads.

A checkpoint directory is input like any other. Three rules hold for every file it names (weight
shards, the index, config.json, tokenizer files) and for a run directory's `latest` pointer:

- Containment: the name is relative, has no `..` part, and resolves (symlinks followed) inside the
  directory it belongs to. One exception: a Hugging Face cache snapshot (`.../snapshots/<rev>/`) keeps
  its files as symlinks into the repository's `blobs/` folder, which is accepted as part of it.
- Regular files only: a FIFO, device, socket or directory where a file is expected is refused from
  `os.stat` before any open, and the open itself uses O_NONBLOCK (then checks `fstat`), so a file
  swapped for a FIFO between the two checks still cannot block the process.
- Bounded reads: small text files (config, index, pointer) are read up to a size limit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import CheckpointError

# config.json / index json / tokenizer_config.json are kilobytes to a few megabytes (a large index)
MAX_TEXT_BYTES = 64 << 20


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _stat_error(path: Path, e: OSError) -> CheckpointError:
    if e.errno == errno.ENOENT:
        return CheckpointError(f"{path}: file not found")
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{path}: symlink loop")
    if e.errno == errno.EACCES:
        return CheckpointError(f"{path}: permission denied")
    return CheckpointError(f"{path}: cannot read ({e.strerror or e})")


def regular_file(path: str | Path) -> os.stat_result:
    """stat(path) following symlinks; CheckpointError unless it is a regular file. Opens nothing."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise _stat_error(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is {_kind(st.st_mode)}, expected a regular file")
    return st


def open_regular(path: str | Path) -> BinaryIO:
    """Open a regular file for binary reading; never blocks on a FIFO or device (see the module doc)."""
    path = Path(path)
    regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _stat_error(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: is {_kind(st.st_mode)}, expected a regular file")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A small UTF-8 text file, refused when it is not a regular file or is larger than `limit`."""
    path = Path(path)
    with open_regular(path) as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes; not a config/index file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_bytes(path: str | Path, limit: int, what: str | None = None) -> bytes:
    """A whole file the user (or a run directory) names: a regular file (symlinks followed: a link to a
    FIFO or a device is refused like the FIFO or device itself), opened without blocking, at most `limit`
    bytes (refused, not cut, when larger). `what` prefixes the error (e.g. "--prompt-file FILE")."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            raw = f.read(limit + 1)
    except CheckpointError as e:
        if what is None:
            raise
        raise CheckpointError(f"{what}: {str(e).removeprefix(f'{path}: ')}") from None
    except OSError as e:  # EIO, EISDIR on exotic file systems ...
        raise CheckpointError(f"{what or path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > limit:
        raise CheckpointError(f"{what or path}: larger than {_size(limit)} (the limit for this file)")
    return raw


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def allowed_roots(root: str | Path) -> list[Path]:
    """The real directories a checkpoint's files may resolve into: the directory itself and, for a
    Hugging Face cache snapshot, the repository's `blobs/` folder."""
    real = Path(os.path.realpath(root))
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def contained(root: str | Path, name: str, what: str) -> Path:
    """root/name after checking that `name` stays inside root; `what` says who named it (for the error).

    Refused by name: absolute paths, `..` parts, empty names; refused after resolution: symlinks (of
    the file or of a folder on the way) that lead outside the allowed roots."""
    root = Path(root)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{what}: invalid file name {name!r}")
    rel = Path(name)
    if rel.is_absolute() or name.startswith(("/", "\\")):
        raise CheckpointError(f"{what}: file name {name!r} is an absolute path; only names inside {root} are allowed")
    if ".." in rel.parts or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(
            f"{what}: file name {name!r} leaves the directory ('..'); only names inside {root} are allowed"
        )
    path = root / rel
    try:
        real = Path(os.path.realpath(path, strict=False))
    except OSError as e:  # a symlink loop on some Pythons
        raise _stat_error(path, e) from None
    if not any(real == r or r in real.parents for r in allowed_roots(root)):
        raise CheckpointError(
            f"{what}: {name!r} resolves to {real}, outside the checkpoint directory {root} (a symlink out of it)"
        )
    return path


__all__ = ["MAX_TEXT_BYTES", "allowed_roots", "contained", "open_regular", "read_bytes", "read_text", "regular_file"]
