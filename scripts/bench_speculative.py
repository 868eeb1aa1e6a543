"""Batch-1 greedy decode with and without speculative decoding (the MTP draft), in one process.

    python3 scripts/bench_speculative.py [--device cuda] [--model DIR] [--tokens 256] [--k 1 2 3]

Loads the model once (default: the shipped model), runs the same prompts through the serving engine with
speculation off and with k drafts, and prints per setting: output tokens/s (after a warm-up run of the
same setting), acceptance, tokens per verify step, and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4 import defaults
from dsv4.checkpoint.load import load_pretrained
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.train.tokenizer import Tokenizer

PROMPTS = ("def read_lines(path):\n    with open(path) as f:\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n")


def run(model, prompt, k, tokens, graphs):
    engine = Engine(model, EngineConfig(max_seqs=1, speculative=k, cuda_graphs=graphs, prefix_caching=False))
    engine.add_request("0", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    out = []
    if model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            out += o.new_tokens
    if model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, dict(engine.spec_stats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    a = ap.parse_args()
    path = a.model or defaults.shipped_model_dir()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32     # the fused GPU kernels' dtype
    model = load_pretrained(path, device=a.device, dtype=dtype, progress=False).eval()
    tok = Tokenizer.from_file(path)
    prompts = [[tok.bos_id] + tok.encode(p) for p in PROMPTS]
    graphs = a.device.startswith("cuda")
    result = {"device": torch.cuda.get_device_name() if graphs else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "tokens": a.tokens, "settings": {}}
    plain = None
    for k in [0] + a.k:
        run(model, prompts[0], k, 16, graphs)                             # warm-up (graph capture, caches)
        outs, secs, stats = [], 0.0, {"drafted": 0, "accepted": 0, "verify_steps": 0}
        for p in prompts:
            o, s, st = run(model, p, k, a.tokens, graphs)
            outs.append(o)
            secs += s
            for key in stats:
                stats[key] += st[key]
        plain = outs if k == 0 else plain
        row = {"tokens_per_s": sum(map(len, outs)) / secs, "same_tokens": outs == plain}
        if k:
            row["acceptance"] = stats["accepted"] / max(1, stats["drafted"])
            row["tokens_per_verify"] = 1 + stats["accepted"] / max(1, stats["verify_steps"])
        row["speedup"] = row["tokens_per_s"] / result["settings"]["0"]["tokens_per_s"] if k else 1.0
        result["settings"][str(k)] = row
        print(f"k={k}: " + json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
