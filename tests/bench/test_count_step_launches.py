"""`scripts/count_step_launches.py`: an engine step's launches with the index ops and the router on their kernels
against their references (the kernels on the CPU interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from subproc import checkout_env

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_step_launches.py"


@pytest.mark.slow
def test_the_kernels_take_a_steps_plan_down_to_a_dozen_launches():
    from dsv4.ops.triton._common import interpreter_defect

    if interpreter_defect():
        pytest.skip(interpreter_defect())
    argv = [sys.executable, str(SCRIPT), "--preset", "tiny", "--rows", "3", "--prompt-len", "20", "--output-len", "4"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=checkout_env(TRITON_INTERPRET="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = re.compile(r"^(references|kernels): .*decode steps \(median of \d+\) (\d+), of which the plan (\d+)$", re.M)
    rows = {name: (int(step), int(plan)) for name, step, plan in line.findall(proc.stdout)}
    assert set(rows) == {"references", "kernels"}, proc.stdout
    (ref_step, ref_plan), (k_step, k_plan) = rows["references"], rows["kernels"]
    # one launch per plan op (the window, and per ratio the groups, the kept rows and the entries) plus the
    # indexer cells' few torch ops; the step saves at least what the plan saves
    assert k_plan <= 16 and ref_plan >= 10 * k_plan
    assert ref_step - k_step >= ref_plan - k_plan
