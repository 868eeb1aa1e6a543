"""The serving engine's host time per step, without the model: what the device would wait for.

    python3 scripts/bench_engine_host.py --clients 64 256 [--repeats 3] [--profile 30]

Builds the engine on the CPU over a `small` model whose bucketed step does no model work at all (the
runner's `bucket_forward` is replaced by nothing: every sampled token is 0, `ignore_eos` keeps every request
to its length), then drives the closed loop of `dsv4 bench engine` (same prompts, lengths and clients) and
prints the host's milliseconds per step by phase: schedule, launch (building the step's inputs and
launching it), post (reading tokens, stops, pages, outputs). On a GPU the device runs a step while the host
does the next one's work; where the host's total exceeds the device's step time, the device waits
(`dsv4 bench engine` reports that idle time). Each figure is the median (min-max) of the timed runs; with
--profile, the functions taking the most host time in one more run (under cProfile, which slows them).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4.bench.engine import _work, drive  # noqa: E402
from dsv4.config import PRESETS  # noqa: E402
from dsv4.engine import Engine, EngineConfig  # noqa: E402
from dsv4.engine.engine_process import freeze_heap  # noqa: E402
from dsv4.model import DeepSeekV4  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions of most own time")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.clients) < 1 or args.prompt_len < 1 or args.output_len < 1:
        p.error("--repeats, --clients, --prompt-len and --output-len must be at least 1")

    cfg = PRESETS[args.preset]()
    model = DeepSeekV4(cfg, init=False).to(torch.bfloat16).eval()  # weights never drawn: nothing runs it
    for clients in args.clients:
        work = _work(cfg.vocab_size, 4 * clients, args.prompt_len, args.output_len, 0.25, 0)
        longest = max(len(q) + n for q, n in work)
        config = EngineConfig(
            max_seqs=clients,
            max_model_len=min(cfg.max_seq_len, max(longest + 1, 256)),
            pad_steps=True,
            overlap=True,
            max_batch_tokens=2048,
        )
        engine = Engine(model, config)
        engine.runner.bucket_forward = lambda t, bucket: None  # no model work: the host's part of a step alone
        drive(engine, work[: 2 * clients], clients, "w")  # untimed: buckets, allocations
        freeze_heap()  # as the server's engine process does
        phases: dict[str, list[float]] = {k: [] for k in ("schedule", "launch", "post", "total")}
        for r in range(args.repeats):
            before = dict(engine.timing)
            run = drive(engine, work, clients, f"t{r}-")
            for k in ("schedule", "launch", "post"):
                phases[k].append((engine.timing[k] - before[k]) / run["steps"] * 1e3)
            phases["total"].append(run["wall_s"] / run["steps"] * 1e3)  # (the loop's own work too)
        cells = [f"{k} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for k, v in phases.items()]
        head = f"{clients} clients, {4 * clients} requests ({run['tokens']} tokens in {run['steps']} steps per run)"
        print(f"{head}, host ms per step: " + ", ".join(cells), flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            drive(engine, work, clients, "p-")
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
