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

--grouped times the per-query kernel's plan against the grouped-query plan
(`dsv4.ops.triton.sparse_attention_grouped`) instead, on the same two shapes laid out as the engine lays
out a step: the tokens of a chunk share their sequence's window rows (token p + 1's window is p's shifted
by one) and entries (listed in a random order per token, as the indexer's top-k lists them); decode rows
keep keys of their own.
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


def shared_step_inputs(chunks: int, prompt: int, decode: list[int], h: int, d: int, window: int, ratio: int):
    """A step of `chunks` prompts of `prompt` tokens (positions 0...) then decode rows at `decode` positions,
    each sequence with its own window rows and entries in the pool. -> q, kv, sink, idx [1, T, window + entries]"""
    g = torch.Generator().manual_seed(0)
    entries = max(prompt, max(decode, default=0) + 1) // ratio
    rows, base = [], 0
    for p_list in [list(range(prompt))] * chunks + [[p] for p in decode]:
        last = p_list[-1]
        for p in p_list:
            pos = torch.arange(p - window + 1, p + 1)
            win = torch.where(pos >= 0, base + pos.clamp_min(0), -1)
            seen = torch.randperm((p + 1) // ratio, generator=g) + base + last + 1
            rows.append(torch.cat([win, seen, torch.full((entries - seen.numel(),), -1)]))
        base += last + 1 + entries
    idx = torch.stack(rows).unsqueeze(0)
    q = torch.randn(1, idx.size(1), h, d, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, base, d, generator=g).to(torch.bfloat16)
    return q, kv, torch.randn(h, generator=g), idx


def grouped_rows(args, decode) -> None:
    """Per-query plan against the grouped-query plan, a JSON line each (microseconds: median, min, max)."""
    from dsv4.ops.triton import sparse_attention_grouped as grouped

    dev, scale = torch.device("cuda"), args.dim**-0.5
    for name, (chunks, rows) in {
        "mixed": (args.chunks, decode(args.decode)),
        "decode": (0, decode(args.batch)),
    }.items():
        q, kv, sink, idx = (
            t.to(dev)
            for t in shared_step_inputs(chunks, args.prompt, rows, args.heads, args.dim, args.window, args.ratio)
        )
        want = sa.sparse_attention_fwd(q, kv, sink, idx, scale)
        for plan, fn in (("per-query", sa.sparse_attention_fwd), ("grouped", grouped.grouped_forward)):
            row = {"shape": name, "queries": idx.size(1), "plan": plan}
            try:  # (a plan that does not compile here, e.g. out of shared memory, is reported, not fatal)
                got = fn(q, kv, sink, idx, scale)
                row["rel_err_vs_per_query"] = float((got[0].float() - want[0].float()).norm() / want[0].float().norm())
                row["us"] = [x * 1e3 for x in time_ms(partial(fn, q, kv, sink, idx, scale), calls=20)]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(row))


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
    p.add_argument("--grouped", action="store_true", help="the per-query plan against the grouped-query plan")
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
    if args.grouped:
        return grouped_rows(args, decode)
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
