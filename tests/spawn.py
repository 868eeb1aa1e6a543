"""Run a test's worker in N spawned processes (gloo on the CPU) and collect each rank's JSON report.

A worker killed by a signal (SIGSEGV inside the collective library's threads while a loaded 2-core machine
runs other tests beside it has happened on CI, once in dozens of runs, and never reproduced; so has a
SIGABRT on a corrupted heap, "malloc(): unaligned tcache chunk detected", with its peer then exiting 1 on
the broken connection) launches the workers once more on a fresh port, with a warning that names the
signal, whatever the other workers' exit codes; a second death, a non-zero exit in that second launch or a
missing report fails the test. A wrong number never comes from a crash: the judgements read the reports,
which a worker writes only after all of its scenarios finished.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from dsv4.parallel import free_port


def run_workers(
    worker: Callable, world: int, out: Path, args: tuple, timeout_s: float, stop_on_death: bool = True
) -> list[int]:
    """worker(rank, world, port, str(out), *args) in `world` spawned processes; -> their exit codes (-N: killed
    by signal N). stop_on_death: when one ends with an error, kill the others (they would wait on it);
    otherwise let them run (a test of how the survivors notice)."""
    ctx = mp.start_processes(
        worker, args=(world, free_port(), str(out), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in ctx.processes):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the {world} workers did not finish in {timeout_s:.0f} s")
        if stop_on_death and any(p.exitcode not in (None, 0) for p in ctx.processes):
            time.sleep(2.0)  # let a worker that is itself failing report first
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            break
        time.sleep(0.5)
    for proc in ctx.processes:
        proc.join()
    return [p.exitcode for p in ctx.processes]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def launch(worker: Callable, out: Path, *args: Any, world: int = 2, timeout_s: float = 420.0) -> list[dict]:
    """worker(rank, world, port, str(out), *args) in `world` processes; -> each rank's out/rank<r>.json."""
    before = set(Path(out).iterdir())  # what the test put there (inputs); a retry starts from just that
    for attempt in (1, 2):
        for path in set(Path(out).iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        codes = run_workers(worker, world, out, args, timeout_s)
        crashed = [c for c in codes if c is not None and c < 0 and -c != signal.SIGKILL]
        if attempt == 1 and crashed:  # (a peer of a crashed worker exits non-zero on the broken link)
            why = _signal_name(crashed[0])
            warnings.warn(f"a worker died of {why}; launching the {world} workers once more", stacklevel=2)
            continue
        break
    named = ["ok" if c == 0 else _signal_name(c) if c < 0 else f"exit {c}" for c in codes]
    assert codes == [0] * world, f"workers ended {named}"
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
