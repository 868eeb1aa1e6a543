"""`python3 -m dsv4.bench.parallel`: serve a model across N worker processes and compare with one process.

Each worker joins the group (`init_workers`: gloo on CPUs, NCCL on GPUs, worker r on cuda:r), loads its
share (`load_pretrained(..., rank=r, world_size=N)`, or a preset's random weights cut by the pass),
applies `parallelize_for_serving`, and runs prefill chunks and greedy decode steps over a paged cache
(`append`). With `--reference` each worker also runs the whole model on its own device (it must fit) and
compares every step's logits. What it prints per worker: the logits' agreement (bit-equal steps, worst
relative L2), greedy tokens equal, step times (median of the decode steps, the prefill chunks), the
weights it holds beside the estimate (`rank_bytes`) and, on a GPU, its peak memory beside the estimate.

Judged: with `--deterministic` (reference ops, exact accumulation: the deterministic engine's numbers)
every step must be bit-equal; otherwise the worst relative L2 must stay within --tol. Exit code 0 / 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import defaults
from .. import memory as mem
from ..parallel.serving import ATTENTION, parallelize_for_serving
from ..parallel.workers import free_port, init_workers, shutdown_workers


def _build(args, rank: int, world: int, device: torch.device, whole: bool):
    from ..model import DeepSeekV4

    dtype = defaults.resolve_dtype(args.dtype)
    if args.preset:
        model = DeepSeekV4.from_config(args.preset, seed=args.seed, dtype=dtype, device=device)
    else:
        from ..checkpoint import load_pretrained

        model = load_pretrained(
            args.model,
            dtype=dtype,
            device=device,
            keep_quantized=args.keep_quantized,
            **({} if whole else {"rank": rank, "world_size": world}),
        )
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(model, prompts: torch.Tensor, chunk: int, decode: int, device: torch.device):
    """Prefill in chunks, then greedy decode steps -> (every step's logits, tokens, seconds per step)."""
    b, n = prompts.shape
    cache = model.new_cache(b, max_len=n + decode + 1)
    logits, times, pos, toks = [], [], 0, []
    with torch.no_grad():
        while pos < n:
            c = min(chunk, n - pos)
            tok = prompts[:, pos : pos + c]
            _sync(device)
            t0 = time.perf_counter()
            out = model.append(tok, cache.step_inputs(tok, static_start=pos), cache.kv)
            _sync(device)
            times.append(("prefill", time.perf_counter() - t0))
            cache.advance(c)
            pos += c
            logits.append(out)
        nxt = logits[-1].view(b, -1, logits[-1].size(-1))[:, -1].argmax(-1, keepdim=True)
        for _ in range(decode):
            toks.append(nxt)
            _sync(device)
            t0 = time.perf_counter()
            out = model.decode_step(nxt, cache)
            _sync(device)
            times.append(("decode", time.perf_counter() - t0))
            logits.append(out.flatten(0, 1))
            nxt = out[:, -1].argmax(-1, keepdim=True)
    return logits, torch.cat(toks, 1) if toks else None, times


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    d = torch.linalg.vector_norm(a.float() - b.float())
    return 0.0 if float(d) == 0 else float(d / torch.linalg.vector_norm(b.float()).clamp_min(1e-30))


def _numerics(deterministic: bool) -> contextlib.ExitStack:
    """Deterministic: the reference ops with exact accumulation (what the deterministic engine computes)."""
    from .. import ops
    from ..ops.precision import exact_accumulation

    stack = contextlib.ExitStack()
    stack.enter_context(exact_accumulation(deterministic))
    stack.enter_context(ops.use_backend("reference" if deterministic else None))
    return stack


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str | None) -> dict:
    w = init_workers(rank, world, master_port=port, device=args.device, timeout_s=args.timeout)
    if w.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = parallelize_for_serving(
        _build(args, rank, world, w.device, whole=bool(args.preset)), attention=args.attention
    )
    cfg = model.cfg
    seed = args.seed + (rank if args.attention == "data_parallel" else 0)
    prompts = torch.randint(
        0, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(seed)
    ).to(w.device)
    if w.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(w.device)
    with _numerics(args.deterministic):
        logits, toks, times = _run(model, prompts, args.chunk, args.decode, w.device)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    est = mem.rank_bytes(
        cfg,
        world,
        context=args.prompt_len + args.decode + 1,
        batch=args.batch,
        chunk=args.chunk,
        dtype=defaults.resolve_dtype(args.dtype),
        keep_quantized=args.keep_quantized,
        attention=args.attention,
        fused=w.device.type == "cuda",
        prefix_caching=False,
    )
    res = {
        "rank": rank,
        "device": str(w.device),
        "weights": held,
        "est_weights": est.weights,
        "est_total": est.total,
        "peak": torch.cuda.max_memory_allocated(w.device) if w.device.type == "cuda" else None,
        "decode_s": statistics.median([t for k, t in times if k == "decode"] or [0.0]),
        "prefill_s": [round(t, 6) for k, t in times if k == "prefill"],
    }
    if args.reference:
        del model
        ref = _build(args, rank, world, w.device, whole=True)
        with _numerics(args.deterministic):
            want, want_toks, rtimes = _run(ref, prompts, args.chunk, args.decode, w.device)
        res["equal_steps"] = sum(bool(torch.equal(a, b)) for a, b in zip(logits, want))
        res["steps"] = len(want)
        res["worst_rel"] = max(_rel(a, b) for a, b in zip(logits, want))
        res["tokens_equal"] = want_toks is None or bool(torch.equal(toks, want_toks))
        res["ref_decode_s"] = statistics.median([t for k, t in rtimes if k == "decode"] or [0.0])
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    shutdown_workers()
    if out_dir is not None and rank == 0:
        Path(out_dir, "ranks.json").write_text(json.dumps(everyone))
    return {"ranks": everyone}


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    _worker(rank, world, port, args, out_dir)


def judge(ranks: list[dict], deterministic: bool, tol: float) -> bool:
    if "worst_rel" not in ranks[0]:
        return True
    if deterministic:
        return all(r["equal_steps"] == r["steps"] and r["tokens_equal"] for r in ranks)
    return all(r["worst_rel"] <= tol for r in ranks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dsv4.bench.parallel", description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--preset", help="random weights of a preset (tiny, small, medium, flash, pro)")
    g.add_argument("--model", help="a checkpoint directory (e.g. written by dsv4 init)")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, worker r on cuda:r)")
    p.add_argument("--dtype", choices=list(defaults.DTYPES), default=None, help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--keep-quantized", action="store_true")
    p.add_argument("--attention", choices=ATTENTION, default="replicated")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true", help="also run the whole model on each worker's device")
    p.add_argument("--deterministic", action="store_true", help="reference ops, exact accumulation: bit-equal")
    p.add_argument("--tol", type=float, default=2e-2, help="worst relative L2 of the logits allowed otherwise")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        import torch.multiprocessing as mp

        mp.start_processes(_spawned, args=(args.nproc, free_port(), args, tmp), nprocs=args.nproc, start_method="spawn")
        ranks = json.loads(Path(tmp, "ranks.json").read_text())
    ok = judge(ranks, args.deterministic, args.tol)
    if args.json:
        print(json.dumps({"ok": ok, "ranks": ranks}))
    else:
        for r in ranks:
            line = (
                f"rank {r['rank']} on {r['device']}: weights {r['weights'] / 1e9:.3f} GB (estimate "
                f"{r['est_weights'] / 1e9:.3f}), decode step {r['decode_s'] * 1e3:.1f} ms"
            )
            if r["peak"] is not None:
                line += f", peak {r['peak'] / 1e9:.2f} GB (estimate {r['est_total'] / 1e9:.2f})"
            if "worst_rel" in r:
                line += (
                    f"; vs one process: {r['equal_steps']}/{r['steps']} steps bit-equal, worst rel "
                    f"{r['worst_rel']:.2e}, greedy tokens {'equal' if r['tokens_equal'] else 'DIFFER'}, "
                    f"its decode step {r['ref_decode_s'] * 1e3:.1f} ms"
                )
            print(line)
        print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
