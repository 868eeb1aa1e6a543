"""The count of Triton kernel compilations (`dsv4.ops.compiles`): it counts each call of Triton's compile
hook, names the kernel each compiled, and keeps calling a hook that was there before it."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def test_the_hook_counts_and_chains():
    from dsv4.ops import compiles

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is None or not hasattr(knobs, "jit_cache_hook"):
        assert compiles.install() is False and compiles.count() is None
        return
    seen = []
    saved = knobs.jit_cache_hook
    try:
        if not compiles._STATE["installed"]:
            knobs.jit_cache_hook = lambda *a, **k: seen.append(k.get("key"))
        assert compiles.install() is True and compiles.install() is True
        before = compiles.count()
        knobs.jit_cache_hook(key="k1")

        def my_kernel():
            pass

        knobs.jit_cache_hook(key="k2", fn=my_kernel)
        assert compiles.count() == before + 2
        assert compiles.names(before)[-1] == "my_kernel"  # (the first, without fn: its repr or "?")
        if seen:
            assert seen == ["k1", "k2"]
    finally:
        knobs.jit_cache_hook = saved
