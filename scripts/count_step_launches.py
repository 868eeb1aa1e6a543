"""Launches per serving step: the engine's steps with the index ops and the router on their references, then
on their Triton kernels, counted by what each would launch on a GPU (a diagnostic, no timing).

    TRITON_INTERPRET=1 python3 scripts/count_step_launches.py [--preset small] [--rows 4] [--prompt-len 60]

A count is the torch operations a step dispatches that launch a kernel on a GPU (views and allocations
excluded) plus the Triton kernels it launches (what the interpreter runs inside a launch is not counted).
Every other op runs its reference in both columns, so the difference is what the kernels of
`plan_window`, `plan_groups`, `plan_keep`, `plan_entries`, `select_rows`, `attend_rows`, `route` and
`clamped_swiglu` take off a step; the plan alone (`model.paged.plan_step`) is counted too. Without a GPU
it needs TRITON_INTERPRET=1; on a GPU it runs the compiled kernels and CUDA graphs off (every step eager).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from dsv4 import ops  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from dsv4.model import DeepSeekV4, transformer  # noqa: E402
from dsv4.ops.reference_plan import INDEX_OPS  # noqa: E402
from dsv4.ops.triton import _common  # noqa: E402

KERNEL_OPS = (*INDEX_OPS, "route", "clamped_swiglu")
NO_KERNEL = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "select", "slice", "t", "transpose"}
NO_KERNEL |= {"permute", "as_strided", "alias", "detach", "reshape", "unbind", "split", "split_with_sizes", "chunk"}
NO_KERNEL |= {"narrow", "_reshape_alias", "lift_fresh", "empty", "empty_strided", "view_as_real", "diagonal"}


class Launches(TorchDispatchMode):
    """Counts kernel-launching torch ops and Triton launches inside the block (not inside a launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.inside = False
        launch = _common.Kernel.__getitem__

        def counted(kernel, grid):
            run = launch(kernel, grid)

            def go(*args, **kwargs):
                self.n += 1
                self.inside = True
                try:
                    return run(*args, **kwargs)
                finally:
                    self.inside = False

            return go

        self._patch = (launch, counted)

    def __enter__(self):
        _common.Kernel.__getitem__ = self._patch[1]
        return super().__enter__()

    def __exit__(self, *exc):
        _common.Kernel.__getitem__ = self._patch[0]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and func.overloadpacket.__name__ not in NO_KERNEL:
            self.n += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--rows", type=int, default=4, help="requests decoding together (default 4)")
    p.add_argument("--prompt-len", type=int, default=60)
    p.add_argument("--output-len", type=int, default=8)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "count_step_launches: without a GPU, set TRITON_INTERPRET=1 (the kernels run on the interpreter)",
            file=sys.stderr,
        )
        return 2
    model = DeepSeekV4.from_config(ModelConfig.preset(args.preset), seed=0, dtype=torch.bfloat16).eval().to(dev)
    real_plan = transformer.plan_step
    for name, choice in (("references", {}), ("kernels", dict.fromkeys(KERNEL_OPS, "triton"))):
        steps: list[tuple[int, int, int]] = []  # (tokens, launches, of which the plan's)
        plan_launches = [0]

        def plan_step(inp, layout, compressed=True, plan_launches=plan_launches):
            with Launches() as m:
                out = real_plan(inp, layout, compressed)
            plan_launches[0] += m.n
            return out

        transformer.plan_step = plan_step
        engine = Engine(
            model, EngineConfig(max_seqs=args.rows, max_batch_tokens=256, pad_steps=True, cuda_graphs=False)
        )
        for i in range(args.rows):
            prompt = [5 + (i + j) % 200 for j in range(args.prompt_len + i)]
            engine.add_request(
                str(i), prompt, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
            )
        try:
            with ops.use_backend("reference"), ops.use_backend(choice, inherit=True):
                while engine.has_work():
                    plan_launches[0] = 0
                    with Launches() as m:
                        outs = engine.step()
                    steps.append((sum(len(o.new_tokens) for o in outs), m.n, plan_launches[0]))
        finally:
            transformer.plan_step = real_plan
        decode = [s for s in steps[1:] if s[0] == args.rows]  # steps where every row decoded one token
        print(f"{name}: first step (prompts) {steps[0][1]} launches, of which the plan {steps[0][2]}; "
              f"decode steps (median of {len(decode)}) {statistics.median(s[1] for s in decode):.0f}, "
              f"of which the plan {statistics.median(s[2] for s in decode):.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
