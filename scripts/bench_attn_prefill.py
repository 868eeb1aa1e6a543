"""Sparse attention's forward at the serving engine's step shapes, by launch configuration: which plan
`dsv4.ops.triton.sparse_attention.plan_forward` should take for a model of few heads.

    python3 scripts/bench_attn_prefill.py [--heads 16] [--dim 512] [--window 128] [--compressed 64]
        [--prompt 128] [--decode 140] [--chunks 9] [--batch 256]

Two shapes, as a `small` preset step of the engine lays them out (one shared KV pool; each query's keys are
its window, ascending by position with -1 before the sequence start, then its sequence's compressed
entries, -1 past those that exist):
- "mixed": `--chunks` prompt chunks of `--prompt` tokens from position 0, beside `--decode` decode rows at
  positions 150-200: the queries of a step that fills the token budget;
- "decode": `--batch` decode rows at positions 150-200.
For each: the planned configuration ("auto") and each candidate, with and without TRIM (only the key
blocks that hold a valid key), each the median (min-max) of 5 replays of a CUDA graph of 20 calls after
warm-up calls. The outputs of every candidate are checked equal to the planned one's within the bf16
bound (a different key block or split rounds otherwise). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4

from bench_hc_split import time_ms  # noqa: E402  (this folder: the same graph-replay timing)

from dsv4.ops.triton import sparse_attention as sa  # noqa: E402

CANDIDATES = [  # (BLOCK_N, num_warps, num_stages, D_SPLIT)
    (64, 8, 2, 1),
    (64, 4, 2, 1),
    (64, 4, 2, 2),
    (32, 4, 3, 1),
    (32, 4, 3, 2),
    (32, 4, 2, 2),
    (32, 2, 3, 2),
    (32, 4, 3, 4),
    (16, 4, 3, 2),
    (16, 2, 3, 2),
    (32, 8, 3, 1),
]


def step_inputs(positions: list[int], h: int, d: int, window: int, compressed: int, ratio: int, seed: int = 0):
    """q [1, T, h, d], kv [1, N, d], sink [h], idx [1, T, window + compressed] for queries at `positions`,
    each of its own sequence region of the pool."""
    g = torch.Generator().manual_seed(seed)
    T = len(positions)
    region = window + compressed
    kv = torch.randn(1, T * region, d, generator=g).to(torch.bfloat16)
    q = torch.randn(1, T, h, d, generator=g).to(torch.bfloat16)
    sink = torch.randn(h, generator=g)
    idx = torch.full((1, T, window + compressed), -1, dtype=torch.int64)
    for t, p in enumerate(positions):
        base = t * region
        cols = torch.arange(window)
        pos = p - window + 1 + cols
        idx[0, t, :window] = torch.where(pos >= 0, base + pos % window, -1)
        n = min(compressed, (p + 1) // ratio)
        idx[0, t, window : window + n] = base + window + torch.randperm(compressed, generator=g)[:n]
    return q, kv, sink, idx


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--compressed", type=int, default=64, help="compressed keys per query (selected or visible)")
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--chunks", type=int, default=9)
    p.add_argument("--decode", type=int, default=140)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    decode = lambda n: torch.randint(150, 200, (n,), generator=g).tolist()  # noqa: E731
    shapes = {
        "mixed": [p for _ in range(args.chunks) for p in range(args.prompt)] + decode(args.decode),
        "decode": decode(args.batch),
    }
    scale = args.dim**-0.5
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; heads {args.heads}, dim {args.dim}")
    for name, positions in shapes.items():
        q, kv, sink, idx = (
            t.to(dev) for t in step_inputs(positions, args.heads, args.dim, args.window, args.compressed, args.ratio)
        )
        T = len(positions)
        bh, splits, planned = sa.plan_forward(1, T, args.heads, idx.size(-1), dev)
        want = sa.sparse_attention_fwd(q, kv, sink, idx, scale)
        print(
            f"{name}: {T} queries, {idx.size(-1)} key slots, {(idx >= 0).float().mean():.0%} valid; planned "
            f"{planned} (BLOCK_H {bh}, splits {splits})"
        )
        target = planned  # the plan's own dict: a candidate replaces its values while it runs
        saved = dict(target)
        rows = [("auto", None)] + [
            (
                (bn, w, st, ds, trim),
                {**saved, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "D_SPLIT": ds, "TRIM": trim},
            )
            for bn, w, st, ds in CANDIDATES
            for trim in (False, True)
        ]
        for label, cfg in rows:
            try:
                if cfg is not None:
                    target.clear()
                    target.update(cfg)
                got = sa.sparse_attention_fwd(q, kv, sink, idx, scale)
                err = float((got[0].float() - want[0].float()).norm() / want[0].float().norm())
                t = time_ms(partial(sa.sparse_attention_fwd, q, kv, sink, idx, scale), calls=20)
                row = {"shape": name, "config": label, "us": [x * 1e3 for x in t], "rel_err_vs_auto": err}
                print(json.dumps(row))
            except Exception as e:  # out of shared memory or registers
                print(json.dumps({"shape": name, "config": label, "error": f"{type(e).__name__}: {str(e)[:100]}"}))
            finally:
                target.clear()
                target.update(saved)


if __name__ == "__main__":
    main()
