"""Source mutation testing, a handful of entries: each one-line bug, applied to a copy of the package in a
temporary directory, is killed by the tests that exist to catch it (real subprocesses, real pytest runs).
The whole list, with the conformance command, runs on demand: `python3 tools/mutate.py` (developer tooling,
not part of the installed package)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules["mutate"] = mutate  # (its dataclasses look their module up)
_spec.loader.exec_module(mutate)

# one per area the oracles guard; each run is a pytest subprocess on a copy (a few seconds)
CI_SUBSET = ("fp8-kv-sim-off", "ns-4-steps", "sink-times-scale", "output-rotated-forward", "mxfp4-scale-max")


def test_every_mutation_applies_exactly_once():
    """The list follows the code: each entry's text occurs exactly once in its file."""
    for m in mutate.MUTATIONS:
        assert (mutate.ROOT / m.path).read_text().count(m.old) == 1, m.id
        assert m.old != m.new and m.area in ("model", "ops", "formats", "optimizer", "checkpoint", "data"), m.id
    assert len({m.id for m in mutate.MUTATIONS}) == len(mutate.MUTATIONS)


@pytest.mark.parametrize("mid", CI_SUBSET)
def test_mutation_is_killed_by_its_tests(mid):
    m = mutate.BY_ID[mid]
    assert m.kills
    out = mutate.run_mutation(m, conformance=False, quick=True, timeout=120)
    assert out.suite == "killed", out.suite_detail
    assert "FAILED tests/" in out.suite_detail  # a test failed: not a collection error


def test_cli_list_and_bad_id():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "mutate.py"), "--list"], capture_output=True, text=True)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == len(mutate.MUTATIONS)
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mutate.py"), "--only", "no-such-bug"], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no-such-bug" in p.stderr
