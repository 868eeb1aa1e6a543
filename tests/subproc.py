"""The environment of a subprocess a test starts: this checkout first on PYTHONPATH, ahead of whatever the
caller's PYTHONPATH holds (packages installed with `pip install --target`, for one), plus the test's own
variables."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
