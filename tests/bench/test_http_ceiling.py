"""`scripts/bench_http_ceiling.py`: the real HTTP application over a synthetic engine streams every token it
is asked for and reports the server process's CPU time per token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from subproc import checkout_env

pytest.importorskip("uvicorn")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_http_ceiling.py"


@pytest.mark.slow
def test_the_ceiling_script_streams_every_token_and_reports_cpu_per_token():
    argv = [sys.executable, str(SCRIPT), "--clients", "4", "--step-ms", "2", "--requests", "8", "--repeats", "2"]
    argv += ["--output-len", "5", "--prompt-len", "3"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=checkout_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ceiling"] == 4 * 1000 / 2
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        assert run["errors"] == 0 and run["tokens"] == 8 * 5
        assert run["tokens_per_s"] > 0 and run["server_cpu_us_per_token"] > 0
    assert "server CPU per token" in proc.stdout
