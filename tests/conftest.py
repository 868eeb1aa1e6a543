"""Test-wide settings: one intra-op thread per test process (tests use tiny shapes, and several test
processes may share the CPU), deterministic seeds."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="cases of the checkpoint corruption fuzzer (default: DSV4_FUZZ_CASES or 300)")
