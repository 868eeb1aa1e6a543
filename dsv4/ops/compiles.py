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
            with _LOCK:
                _STATE["count"] += 1
            return prev(*args, **kwargs) if prev is not None else None

        knobs.jit_cache_hook = hook
        _STATE["installed"] = True
        return True


def count() -> int | None:
    """Compilations since `install()`, or None when not counting."""
    return _STATE["count"] if _STATE["installed"] else None
