"""A count of Triton kernel compilations in this process (a new specialization of a kernel: its first
launch at a new shape class or constant). A server warms every kernel at every step shape before it says
it is ready; this count, read again later, shows that no request paid for a compilation.

`install()` hooks Triton's JIT (its compile hook, chained to any hook already set); `count()` is None when
Triton is absent or offers no hook.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_STATE = {"installed": False, "count": 0}
_NAMES: list[str] = []  # each compilation's kernel, in order (the first MAX_NAMES)
MAX_NAMES = 1000


def install() -> bool:
    """Start counting (idempotent). False where Triton offers no hook."""
    with _LOCK:
        if _STATE["installed"]:
            return True
        try:
            import triton
        except ImportError:
            return False
        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if knobs is None or not hasattr(knobs, "jit_cache_hook"):
            return False
        prev = knobs.jit_cache_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or str(kwargs.get("repr", "?"))
            with _LOCK:
                _STATE["count"] += 1
                if len(_NAMES) < MAX_NAMES:
                    _NAMES.append(name)
            return prev(*args, **kwargs) if prev is not None else None

        knobs.jit_cache_hook = hook
        _STATE["installed"] = True
        return True


def count() -> int | None:
    """Compilations since `install()`, or None when not counting."""
    return _STATE["count"] if _STATE["installed"] else None


def names(since: int = 0) -> list[str]:
    """The kernels of compilations `since` ... now (by count: `names(count_then)`), as far as recorded."""
    with _LOCK:
        return list(_NAMES[since:])
