"""Peak GPU memory of the runs `dsv4 info` estimates, beside the estimates (the numbers behind README's
"Running the real models" and `dsv4.memory`'s GPU figures).

    python3 scripts/measure_gpu_memory.py --data DIR [--json out.json]

Training: the shipped model's recipe (`dsv4/train/recipes/stdlib-mini.toml`, bf16 autocast, the fused
kernels) for a few steps at several batch sizes, with and without activation checkpointing, each in its own
process; the peak is the largest `peak_mem_gib` the trainer logs (torch.cuda.max_memory_allocated).
Serving: the `small` preset in bf16 through the engine (eager steps: no CUDA graphs), prompts prefilled in
chunks then decoded; the peak is torch.cuda.max_memory_allocated over the run, weights included.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "dsv4/train/recipes/stdlib-mini.toml"
sys.path.insert(0, str(ROOT))  # this checkout's dsv4, also when it is not installed


def train_peak(data: str, batch: int, ckpt: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "dsv4.train.cli",
            "train",
            "--config",
            str(RECIPE),
            "--data",
            data,
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--eval-every",
            "0",
            "--sample-prompt",
            "",
            "--out",
            f"{tmp}/run",
            "--tokenizer-docs",
            "50",
            "--max-docs",
            "400",
        ]
        if ckpt:
            cmd.append("--activation-checkpointing")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"training run failed:\n{p.stderr[-3000:]}")
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
        return max(r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r) * 1024**3


def train_estimate(batch: int, seq_len: int, ckpt: bool) -> dict:
    from dsv4 import memory as mem
    from dsv4.config import ModelConfig
    from dsv4.train.trainer import TrainConfig

    c = TrainConfig.from_file(RECIPE)
    cfg = ModelConfig.preset(c.preset).replace(**c.model)
    st = mem.train_state_bytes(cfg)
    state = st.weights + st.grads + st.optimizer
    # the bf16 weight copies exist under autocast (the GPU run); the reference-op figure is the CPU's fp32 run
    return {
        f: state + (st.copies(1, ckpt) if f else 0) + mem.train_activation_bytes(cfg, batch, seq_len, ckpt, 2, fused=f)
        for f in (True, False)
    }


def train_breakdown(batch: int, seq_len: int = 512) -> dict:
    """One step of the recipe's model in this process (fp32 weights, bf16 autocast, default backends):
    bytes the forward leaves saved for backward, the forward's peak above them, and the backward's peak."""
    from dsv4.config import ModelConfig
    from dsv4.model import DeepSeekV4
    from dsv4.train.losses import total_loss
    from dsv4.train.trainer import TrainConfig

    c = TrainConfig.from_file(RECIPE)
    cfg = ModelConfig.preset(c.preset).replace(**c.model)
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.float32, device="cuda").train()
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(tokens, mtp=True, indexer_loss=True, balance_alpha=c.balance_alpha)
        loss = total_loss(out, tokens, c.mtp_weight, c.indexer_weight).total
    torch.cuda.synchronize()
    saved, fwd_peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    return {
        "batch": batch,
        "saved_per_token": saved / (batch * seq_len),
        "fwd_peak": fwd_peak,
        "saved": saved,
        "bwd_peak": bwd_peak,
        "weights": sum(p.numel() * 4 for p in model.parameters()),
    }


def serve_peak(batch: int, context: int, chunk: int) -> tuple[float, dict]:
    from dsv4 import memory as mem
    from dsv4.config import ModelConfig
    from dsv4.engine import Engine, EngineConfig, SamplingParams
    from dsv4.model import DeepSeekV4

    cfg = ModelConfig.preset("small")
    model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.bfloat16, device="cuda").eval()
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(context - 2)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(
        model,
        EngineConfig(
            max_seqs=batch,
            max_model_len=context,
            max_batch_tokens=chunk * batch,
            prefix_caching=False,
            cuda_graphs=False,
        ),
    )
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    fixed = (
        mem.weight_bytes(cfg, torch.bfloat16).dequantized
        + mem.cache_bytes(cfg, context, batch, 2, max_batch_tokens=chunk * batch, prefix_caching=False).total
    )
    est = {
        f: fixed + mem.activation_bytes(cfg, chunk * batch, context, 2, logits_rows=batch, fused=f)
        for f in (True, False)
    }
    return peak, est


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a folder of .py files to train on (e.g. a Python Lib/ tree)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: scripts/measure_gpu_memory.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for b in (8, 32):
        print(json.dumps(train_breakdown(b)), flush=True)
    for b in args.batches:
        for ckpt in (False, True):
            m = train_peak(args.data, b, ckpt, args.steps)
            e = train_estimate(b, 512, ckpt)
            rows.append(
                {
                    "what": f"train stdlib-mini {b} x 512{' ckpt' if ckpt else ''}",
                    "measured": m,
                    "est_fused": e[True],
                    "est_reference": e[False],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    for batch, context, chunk in ((1, 4096, 4096), (16, 2048, 512)):
        m, e = serve_peak(batch, context, chunk)
        rows.append(
            {
                "what": f"serve small bf16 {batch} x {context} chunks of {chunk}",
                "measured": m,
                "est_fused": e[True],
                "est_reference": e[False],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        print(
            f"{r['what']}: measured {r['measured'] / 2**30:.2f} GiB, estimated {r['est_fused'] / 2**30:.2f} GiB "
            f"(fused, {r['est_fused'] / r['measured'] - 1:+.0%}), {r['est_reference'] / 2**30:.2f} GiB "
            f"(reference ops, {r['est_reference'] / r['measured'] - 1:+.0%})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
