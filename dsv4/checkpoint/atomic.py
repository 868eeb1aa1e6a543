"""Atomic directory writes: build the whole directory in a temporary sibling, then rename it into place.

What is promised:
- Nothing that exists at the destination is deleted or overwritten unless the caller asked for
  replacement. The destination is checked before any work, and the final step is a rename that fails
  when the destination exists: `renameat2(RENAME_NOREPLACE)` on Linux, which is atomic, so of two
  writers racing for one destination exactly one succeeds and the other's output is removed. Where
  that call is missing (another OS, a file system without support) the fallback is a check followed by
  `os.rename`: a non-empty directory or a file that appeared in between still makes the rename fail,
  but an empty directory created in the instant between check and rename would be replaced.
- The temporary directory is named `.<name>.dsv4-tmp-<random>` and holds a marker file
  (`.dsv4-writer.json`: pid, host, start time) until the rename. A writer that is killed leaves it
  behind; the next write into the same parent directory removes those whose pid is no longer running
  on this host and logs the others (a live writer, another host, or no marker) instead of touching them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointError

log = logging.getLogger("dsv4.checkpoint")

TMP_TAG = ".dsv4-tmp-"
MARKER = ".dsv4-writer.json"
_TMP_RE = re.compile(r"^\..+\.dsv4-tmp-[A-Za-z0-9_]+$")
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _renameat2():
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    return None


_RENAMEAT2 = _renameat2()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename src to dst; FileExistsError if dst exists (atomically where the OS allows, see above)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):  # fallback: check, then rename (the window the module doc describes)
        raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, "destination exists", str(dst)) from None
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def stale_temporaries(parent: str | Path) -> list[tuple[Path, str]]:
    """(temporary directory, why it is not removable or "dead") for every writer temp dir in parent."""
    out = []
    parent = Path(parent)
    with contextlib.suppress(OSError):
        for p in parent.iterdir():
            if not _TMP_RE.match(p.name) or p.is_symlink() or not p.is_dir():
                continue
            try:
                owner = json.loads((p / MARKER).read_text())
                pid, host = int(owner["pid"]), str(owner["host"])
            except (OSError, ValueError, KeyError, TypeError):
                out.append((p, "no readable owner marker (left by a writer killed while finishing?)"))
                continue
            if host != socket.gethostname():
                out.append((p, f"written from host {host}"))
            elif pid != os.getpid() and not _pid_alive(pid):
                out.append((p, "dead"))
            else:
                out.append((p, f"writer pid {pid} is still running"))
    return out


def clean_stale(parent: str | Path) -> list[Path]:
    """Remove temp dirs of writers that died on this host; log the others. Returns what was removed."""
    removed = []
    for p, why in stale_temporaries(parent):
        if why == "dead":
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log.warning("removed %s, the temporary directory of an interrupted writer", p)
        elif not why.startswith("writer pid"):
            log.warning("leaving %s in place (%s); remove it by hand if no writer uses it", p, why)
    return removed


def _umask() -> int:
    """The process's umask (read without changing it where Linux shows it; else set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_directory(dst: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `dst`; when the block ends normally it becomes `dst`.

    replace=False: `dst` must not exist, now or when the rename happens (CheckpointError otherwise,
    and the temporary directory is removed). replace=True: an existing `dst` is moved aside, the new
    directory renamed in, then the old one deleted. On any error `dst` is left as it was."""
    dst = Path(dst)
    if os.path.lexists(dst) and not replace:
        raise CheckpointError(f"{dst}: already exists; choose a new destination (nothing was written)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dst.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_TAG}", dir=dst.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # (mkdtemp's 0700 would become dst's: a folder only its writer can read)
    old: Path | None = None
    try:
        (tmp / MARKER).write_text(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        )
        yield tmp
        (tmp / MARKER).unlink()
        if replace and os.path.lexists(dst):
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_TAG}old", dir=dst.parent))
            os.rename(dst, old / "previous")
        try:
            rename_noreplace(tmp, dst)
        except FileExistsError:
            raise CheckpointError(
                f"{dst}: appeared while this writer ran (another process created it); it was left "
                "untouched and this output discarded"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(dst):
            with contextlib.suppress(OSError):
                os.rename(old / "previous", dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dst.parent)
