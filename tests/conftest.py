"""Test-wide settings: one intra-op thread per test process (tests use tiny shapes, and several test
processes may share the CPU), deterministic seeds, the `gpu` and `slow` markers.

The tests are grouped by the part of dsv4 they test (tests/model, tests/engine, tests/serve, ...); the
shared helpers (subproc, bounds, triton_interp) sit in tests/, and a test module may import another part's
helpers by name (`from test_checkpoint_helpers import tiny_model`): every part's folder is on the path.
"""

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _part in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_part) not in sys.path:
        sys.path.append(str(_part))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-cases",
        type=int,
        default=None,
        help="cases of the checkpoint corruption fuzzer (default: DSV4_FUZZ_CASES or 300)",
    )


def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first (the order is otherwise kept): in a run of every test (`python3 -m
    pytest`, scripts/gpu_suite.sh) the longest ones - several processes, a model each - then start at once
    instead of last, where they set the run's length (a run of one tier, -m slow or -m "not slow", keeps its
    order). `gpu` tests are skipped, with that reason, where this process has no CUDA device."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (stable)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With DSV4_TEST_TIMES=<file>, each test phase's seconds, phase, outcome and test id are appended to that
    file as they end (by the run's main process only), so a run stopped by a time limit still says where the
    time went (scripts/gpu_suite.sh sets it)."""
    path = os.environ.get("DSV4_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"{report.duration:.2f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
