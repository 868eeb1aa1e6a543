"""Why a training run stops at a step whose numbers are not finite (`Trainer._stop_if_nonfinite`)."""

from __future__ import annotations

import math
from pathlib import Path

from . import checkpoint


def nonfinite_stop(row: dict, skip_nonfinite: bool, checkpoints: Path) -> str | None:
    """The one line a run stops with after the step `row` (its metrics), or None to go on: a non-finite
    held-out loss (the weights themselves) stops it always; a step whose loss or gradients turned NaN/Inf
    (skipped) unless --skip-nonfinite. The line names the step, what was not finite and the checkpoint kept."""
    bad_eval = "eval_loss" in row and not math.isfinite(row["eval_loss"])
    if not (bad_eval or (row.get("skipped") and not skip_nonfinite)):
        return None
    kept = checkpoint.latest_name(checkpoints)
    what = (
        f"the held-out loss is {row['eval_loss']}"
        if bad_eval
        else f"the loss is {row.get('loss')}"
        if not math.isfinite(row.get("loss", 0.0))
        else f"{row['nonfinite']} gradient elements are NaN/Inf"
    )
    hint = "" if bad_eval else "; --skip-nonfinite skips such batches instead"
    return (
        f"training stopped at step {row['step']}: {what} (metrics.jsonl has every step so far; "
        f"{f'the last checkpoint, {kept}, is kept' if kept else 'no checkpoint was written'}"
        f"{hint})"
    )
