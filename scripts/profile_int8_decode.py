"""GPU time and kernels of one graphed `small` decode step, bf16 against INT8 (`quant_mode="int8"`), at batch 1
and 16: the top kernels by time (a diagnostic; `dsv4 bench int8` gives the rates). CUDA only.

    python3 scripts/profile_int8_decode.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dsv4, also when not installed

from dsv4.bench.e2e import kernel_table  # noqa: E402
from dsv4.bench.graphs import GraphedDecoder  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.model import DeepSeekV4  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_int8_decode: needs a CUDA GPU")
    base = ModelConfig.preset("small")
    for name, cfg in (("bf16", base), ("int8", base.replace(quant_mode="int8"))):
        model = DeepSeekV4.from_config(cfg, seed=0, dtype=torch.bfloat16, device="cuda").eval()
        for batch in (1, 16):
            cache = model.new_cache(batch, 64)
            prompt = torch.randint(2, 1000, (batch, 32), device="cuda")
            with torch.no_grad():
                nxt = model.prefill(prompt, cache)[:, -1].argmax(-1, keepdim=True)
                busy, n, rows = kernel_table(partial(GraphedDecoder(model, cache).step, nxt), 3)
            print(f"{name} batch {batch}: GPU busy {busy:.3f} ms per step, {n:.0f} kernels")
            for kname, ms, k in rows[:12]:
                print(f"   {ms:7.3f} ms {k:6.1f}x {kname[:90]}")
        del model


if __name__ == "__main__":
    main()
