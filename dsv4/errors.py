"""Errors the CLI reports as one line (`error: ...`) instead of a traceback, and their exit codes.

Exit codes: 2 for what the user can fix (a bad argument or input, a broken or mismatched file: `UserError`
and the library's own value errors: config, request), 1 for a failure of the machine (I/O: disk full,
read-only or missing destination, permission denied; memory), for what dsv4 recognizes but does not
implement (`Unsupported`: the input is valid, this package cannot run it) and for anything unexpected,
130 for Ctrl-C. A traceback is only shown with `--debug`.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path


class UserError(Exception):
    """Something the user can fix: a bad argument, a missing or broken file, a config mismatch."""


class RunFailed(Exception):
    """A run that stopped for a reason its message states in full (e.g. a training loss that turned NaN,
    logits that turned non-finite): exit code 1, the message as the line, no type name or --debug hint."""


class CheckpointError(UserError):
    """A checkpoint file or tensor is missing, broken, unsafe to open or does not match the config."""


class Unsupported(CheckpointError):
    """A valid input that dsv4 recognizes but does not implement; the line says how to go on without it."""


_interrupted = False


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def watch_interrupts() -> None:
    """Remember a Ctrl-C of this process, so that `interrupted()` can tell it behind whatever a library made
    of the KeyboardInterrupt (one raised inside a C extension's import can come back as an ImportError on
    the next import). Python's own handler keeps its behaviour; a handler someone else set is left alone."""
    import signal
    import threading

    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _on_sigint)
        if hasattr(signal, "pthread_sigmask") and not any(isinstance(f, _HoldCtrlC) for f in sys.meta_path):
            sys.meta_path.insert(0, _HoldCtrlC())


class _HoldCtrlC:
    """Import hook: while torch's package runs its start-up, a Ctrl-C waits until it is done. A
    KeyboardInterrupt raised in Python code that torch's C++ start-up called aborts the whole process
    (SIGABRT and a C++ stack) instead of reaching `interrupted()`; held back, the signal arrives as the
    import returns and ends the command as any other Ctrl-C does (one line, exit 130)."""

    names = ("torch",)

    def find_spec(self, name, path, target=None):
        if name not in self.names or name in sys.modules:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _HeldLoader(spec.loader)
        return spec


class _HeldLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import signal

        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.loader.exec_module(module)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a Ctrl-C that came meanwhile arrives here

    def __getattr__(self, name):  # (the rest of the loader's interface: resources, get_source, ...)
        return getattr(self.loader, name)


def interrupted() -> bool:
    """True once this process has been sent a Ctrl-C it watched for (see `watch_interrupts`)."""
    return _interrupted


def exit_process(code: int) -> None:
    """Leave the process with `code`. After a Ctrl-C, the exit handlers run and the streams are flushed, then
    the process ends at once: a KeyboardInterrupt that reached C code running Python (torch's and numpy's
    start-up do) leaves a flag that would make the interpreter kill itself with SIGINT on its way out, so
    the shell would see a signal instead of the documented 130."""
    if code == 130 and _interrupted:
        import atexit
        import os

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


_IO_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory (or a symlink pointing nowhere)",
    errno.EEXIST: "something else is already there (a file, or a symlink pointing nowhere)",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EISDIR: "it is a directory",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "the name is too long",
    errno.EMFILE: "too many open files",
}


@contextlib.contextmanager
def writing(path: str | Path, kept: str | None = None) -> Iterator[None]:
    """Name the destination and what is left intact on an I/O error raised inside (a failed write() of a
    full disk carries no file name of its own); the error itself goes on unchanged."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        if kept is not None and not hasattr(e, "kept"):
            e.kept = kept
        raise


def describe_os_error(e: OSError) -> str:
    """What failed, on which path, and why, in one line."""
    cause = _IO_CAUSES.get(e.errno or -1, e.strerror or str(e))
    where = e.filename if e.filename is not None else None
    if where is not None and e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}"
    return f"{where}: {cause}" if where is not None else cause


def describe_error(e: BaseException) -> tuple[int, str]:
    """(exit code, one line) for an error that reached the top of a command."""
    from .config_schema import ConfigError

    if isinstance(e, (Unsupported, RunFailed)):
        return 1, str(e)
    if isinstance(e, (UserError, ConfigError)):
        return 2, str(e)
    if isinstance(e, UnicodeError):
        return 2, f"input is not valid UTF-8: {e}"
    if type(e).__name__ == "RequestError":  # the engine's refusal of a request (dsv4.engine.engine)
        return 2, str(e)
    if isinstance(e, OSError):
        kept = getattr(e, "kept", None) or "earlier outputs are left as they were"
        return 1, f"{describe_os_error(e)} (the output being written was not completed; {kept})"
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return 1, f"out of memory: {str(e).splitlines()[0] if str(e) else 'an allocation failed'}"
    first = str(e).splitlines()[0] if str(e) else ""
    return 1, f"{type(e).__name__}: {first} (run with --debug for the traceback)"
