"""One eager training step under the torch profiler, by op and input shape: which calls launch a step's kernels.

    python3 scripts/profile_train_step.py [--train-config dsv4/train/recipes/pycode-base.toml] [--batch 64]
                                          [--seq-len 1024] [--activation-checkpointing] [--out DIR]

The model a recipe trains (or --preset), random weights in fp32 (master weights) and random tokens; forward
with every loss (MTP, indexer) under bf16 autocast, backward, as `dsv4 train` runs them but eagerly (a CUDA
graph would hide which op launched a kernel). Two warm-up steps, then one profiled: prints the ops and
kernels by self CUDA time, and writes the table by input shape to DIR/by_shape.txt. `dsv4 bench train
--profile` gives the graphed step's time and kernel totals; this names their callers. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from dsv4.bench.e2e import _bench_config, _tokens  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.model import DeepSeekV4  # noqa: E402
from dsv4.train.losses import total_loss  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-config", default="dsv4/train/recipes/pycode-base.toml", help="recipe (its model)")
    p.add_argument("--preset", default=None, help="a preset instead of the recipe's model")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--rows", type=int, default=30, help="rows of each table (default 30)")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's forward in backward (how `medium` fits one GPU)",
    )
    p.add_argument("--out", default=None, help="folder for by_shape.txt (default: not written)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_train_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    cfg = _bench_config(argparse.Namespace(train_config=None if args.preset else args.train_config, preset=args.preset))
    if isinstance(cfg, str):  # a preset's name
        cfg = ModelConfig.preset(cfg)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = DeepSeekV4(cfg, dtype=torch.float32, device=dev).train()
    model.set_options(activation_checkpointing=args.activation_checkpointing)
    tokens = _tokens(cfg, args.batch, args.seq_len, dev)
    mtp = cfg.n_mtp_layers > 0 and not cfg.dspark

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = total_loss(model(tokens, mtp=mtp, indexer_loss=True), tokens).total
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        by_shape = prof.key_averages(group_by_input_shape=True)
        widths = {"max_name_column_width": 40, "max_shapes_column_width": 90}
        table = by_shape.table(sort_by="self_cuda_time_total", row_limit=2 * args.rows, **widths)
        (Path(args.out) / "by_shape.txt").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
