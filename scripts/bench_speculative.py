"""Batch-1 greedy decode with and without speculative decoding (the MTP draft), in one process.

    python3 scripts/bench_speculative.py [--device cuda] [--model DIR] [--tokens 256] [--k 1 2 3]

Loads the model once (default: the shipped model); per setting (speculation off, k drafts) builds one
engine, captures its graphs and runs every prompt once untimed (so no timed run captures a graph or
compiles a kernel), then times --repeats runs over the prompts and prints the median tokens/s with min and
max, acceptance, tokens per verify step, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsv4 import defaults
from dsv4.checkpoint.load import load_pretrained
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.train.tokenizer import Tokenizer

PROMPTS = ("def read_lines(path):\n    with open(path) as f:\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n")


def run(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float, dict]:
    """One prompt through a warm engine: (tokens, seconds, the engine's speculative counters of this run)."""
    before = dict(engine.spec_stats)
    engine.add_request(f"r{time.perf_counter_ns()}", prompt,
                       SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    out = []
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            out += o.new_tokens
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, {k: engine.spec_stats[k] - before.get(k, 0) for k in engine.spec_stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per setting (default 5): median, min, max")
    a = ap.parse_args()
    path = a.model or defaults.shipped_model_dir()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32     # the fused GPU kernels' dtype
    model = load_pretrained(path, device=a.device, dtype=dtype, progress=False).eval()
    tok = Tokenizer.from_file(path)
    prompts = [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    graphs = a.device.startswith("cuda")
    result = {"device": torch.cuda.get_device_name() if graphs else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "tokens": a.tokens, "repeats": a.repeats, "settings": {}}
    plain = None
    for k in [0] + a.k:
        engine = Engine(model, EngineConfig(max_seqs=1, speculative=k, cuda_graphs=graphs, prefix_caching=False,
                                            max_model_len=max(map(len, prompts)) + a.tokens + 8))
        engine.warmup()
        for p in prompts:                                  # untimed: every graph and kernel shape of the run
            run(engine, p, a.tokens)
        rates, outs, stats = [], [], {"drafted": 0, "accepted": 0, "verify_steps": 0}
        for _ in range(a.repeats):
            n, secs, outs = 0, 0.0, []
            for p in prompts:
                o, s, st = run(engine, p, a.tokens)
                outs.append(o)
                n, secs = n + len(o), secs + s
                for key in stats:
                    stats[key] += st[key]
            rates.append(n / secs)
        plain = outs if k == 0 else plain
        row = {"tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
               "same_tokens": outs == plain}
        if k:
            row["acceptance"] = stats["accepted"] / max(1, stats["drafted"])
            row["tokens_per_verify"] = 1 + stats["accepted"] / max(1, stats["verify_steps"])
            base = result["settings"]["0"]
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["speedup_min_max"] = [row["min"] / base["max"], row["max"] / base["min"]]
        result["settings"][str(k)] = row
        print(f"k={k}: " + json.dumps(row), flush=True)
        del engine
    print(json.dumps(result))


if __name__ == "__main__":
    main()
